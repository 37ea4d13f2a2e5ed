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
    from fpa_jax.train import abstract_state  # the exact state layout the trainer saved

    _, abstract = abstract_state(cfg)  # (model, optimizer) as shapes, with the run's own optimizer
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    state, _, _ = ckpt.restore(step, target)
  finally:
    ckpt.close()
  model = nnx.eval_shape(lambda: DecoderLM(cfg.model, rngs=nnx.Rngs(params=0)))
  graphdef, _ = nnx.split(model)
  return nnx.merge(graphdef, state[0]), cfg


def export_model(model: DecoderLM, cfg: C.Config, path: str | os.PathLike, *, meta: dict | None = None) -> None:
  """Write a trained model as one portable folder: `params.npz` (every nnx.Param, float arrays keyed
  by their path in the module graph) and `config.json` (the run's Config plus `meta`, e.g. the command
  that trained it). No orbax, no optimizer state: small models ship with a repository this way and
  load with `load_exported` on any machine."""
  import numpy as np

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  flat = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  np.savez(os.path.join(path, "params.npz"), **flat)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"config": cfg.to_dict(), "meta": meta or {}}, f, indent=1, sort_keys=True)


def load_exported(path: str | os.PathLike) -> tuple[DecoderLM, C.Config, dict]:
  """(model, Config, meta) from an `export_model` folder. Raises if the arrays do not match the
  config's parameters one for one (names and shapes), naming the first mismatch."""
  import numpy as np

  path = os.fspath(path)
  with open(os.path.join(path, "config.json")) as f:
    saved = json.load(f)
  cfg = config_from_dict(saved["config"])
  model = DecoderLM(cfg.model, rngs=nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  with np.load(os.path.join(path, "params.npz")) as z:
    arrays = dict(z)
  flat = nnx.to_flat_state(params)
  names = {".".join(map(str, k)) for k, _ in flat}
  if names != set(arrays):
    raise ValueError(
      f"{path}/params.npz does not match its config: missing {sorted(names - set(arrays))[:3]}, "
      f"unexpected {sorted(set(arrays) - names)[:3]}"
    )
  for k, v in flat:
    a = arrays[".".join(map(str, k))]
    if a.shape != v[...].shape:
      raise ValueError(
        f"{path}/params.npz: {'.'.join(map(str, k))} has shape {a.shape}, the config wants {v[...].shape}"
      )
    v[...] = jax.numpy.asarray(a, v[...].dtype)
  return nnx.merge(graphdef, params, rest), cfg, saved.get("meta", {})


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
  """The run's metrics.jsonl as a list of records (step, loss, ...)."""
  path = os.path.join(os.fspath(workdir), "metrics.jsonl")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
