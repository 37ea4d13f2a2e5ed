"""Load a trained model (parameters only, no optimizer state) and its config from a training workdir."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from flax import nnx

from fpa_jax import configs as C
from fpa_jax.checkpoint import Checkpointer
from fpa_jax.models import DecoderLM


def config_from_dict(d: dict) -> C.Config:
  """The `config.json` of a run -> its typed Config (its preset class, so derived defaults match)."""
  cls = C.CONFIGS.get(d.get("name"), C.Config)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(
      f"the run's config has fields this fpa_jax does not know: {unknown}; it was written by "
      "another version of the library"
    )
  return cls(**d).validate()


def load_model(workdir: str | os.PathLike, *, step: int | None = None) -> tuple[DecoderLM, C.Config]:
  """(model with the run's trained parameters, the run's whole Config) from `python -m fpa_jax.train`
  outputs; `model.cfg` is its model part (`cfg.model`), the Config also gives the tokenizer etc.

  Restores the latest checkpoint (or `step`) on the default device. The optimizer state is read
  from disk with the parameters (the checkpoint is one item) and dropped at once.
  """
  ckdir = os.path.join(os.fspath(workdir), "checkpoints")
  if not os.path.isdir(ckdir):
    raise FileNotFoundError(
      f"{workdir} has no checkpoints/ directory: not a training workdir "
      "(train one with python -m fpa_jax.train --workdir ...)"
    )
  ckpt = Checkpointer(ckdir, async_save=False)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"no finished checkpoint in {ckdir}")
    step = max(steps) if step is None else step
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} in {ckdir}; have {sorted(steps)}")
    cfg = config_from_dict(ckpt.saved_config(step))
    from fpa_jax.train import _init_fn, make_optimizer  # the exact state layout the trainer saved

    abstract = nnx.state(nnx.eval_shape(_init_fn(cfg, make_optimizer(cfg))))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    state, _, _ = ckpt.restore(step, target)
  finally:
    ckpt.close()
  model = nnx.eval_shape(lambda: DecoderLM(cfg.model, rngs=nnx.Rngs(params=0)))
  graphdef, _ = nnx.split(model)
  return nnx.merge(graphdef, state[0]), cfg


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
  """The run's metrics.jsonl as a list of records (step, loss, ...)."""
  path = os.path.join(os.fspath(workdir), "metrics.jsonl")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
