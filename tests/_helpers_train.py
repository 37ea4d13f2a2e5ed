"""Tiny in-memory data iterators for the trainer tests (the `fpa_jax.data` Pipeline interface)."""

from __future__ import annotations

import re

import numpy as np

_SHAPE = re.compile(r"\b(f32|bf16|f16)\[([\d,]*)\]")


def float_shapes(hlo: str) -> set[tuple[int, ...]]:
  """The shapes of the float tensors in compiled HLO text (the sharding tests' per-device check)."""
  return {tuple(int(d) for d in m.group(2).split(",") if d) for m in _SHAPE.finditer(hlo)}


class FixedBatch:
  """Yields the same batch forever (for overfitting); `get_state` is a counter.

  Optionally poisons the loss mask with NaN from the `nan_at`-th batch on (1-based), to drive the
  non-finite-loss guard.
  """

  def __init__(
    self, *, vocab_size: int = 64, seq_len: int = 32, batch_size: int = 8, seed: int = 0, nan_at: int | None = None
  ):
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    self.batch = {
      "inputs": toks[:, :-1],
      "targets": toks[:, 1:],
      "segment_ids": np.ones((batch_size, seq_len), np.int32),
      "loss_mask": np.ones((batch_size, seq_len), np.float32),
    }
    self.vocab_size, self.nan_at, self.n = vocab_size, nan_at, 0

  def __iter__(self):
    return self

  def __next__(self):
    self.n += 1
    b = {k: v.copy() for k, v in self.batch.items()}
    if self.nan_at is not None and self.n >= self.nan_at:
      b["loss_mask"][0, 0] = np.nan
    return b

  def get_state(self):
    return {"n": self.n}

  def set_state(self, state):
    self.n = int(state["n"])


class ProcessTaggedSynthetic:
  """SyntheticPipeline whose state names its process: restoring another process's state fails."""

  def __init__(self, cfg, process_index: int, process_count: int):
    from fpa_jax.data import SyntheticPipeline

    self.pi = process_index
    self.p = SyntheticPipeline(
      vocab_size=cfg.vocab_size,
      seq_len=cfg.seq_len,
      batch_size=cfg.batch_size,
      seed=cfg.seed,
      process_index=process_index,
      process_count=process_count,
    )

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.p)

  def get_state(self):
    return {"step": self.p.step, "process": self.pi}

  def set_state(self, state):
    if state["process"] != self.pi:
      raise ValueError(f"process {self.pi} got the data state of process {state['process']}")
    self.p.set_state(state)


class GlobalSynthetic:
  """One process reading the global batch of `process_count` ProcessTaggedSynthetic hosts (rows in
  process order), so a single-process run sees what a multi-process run sees."""

  def __init__(self, cfg, process_count: int):
    self.parts = [ProcessTaggedSynthetic(cfg, i, process_count) for i in range(process_count)]

  def __iter__(self):
    return self

  def __next__(self):
    bs = [next(p) for p in self.parts]
    return {k: np.concatenate([b[k] for b in bs]) for k in bs[0]}

  def get_state(self):
    return {"parts": [p.get_state() for p in self.parts]}

  def set_state(self, state):
    for p, s in zip(self.parts, state["parts"]):
      p.set_state(s)


def train_fixed(cfg, workdir: str) -> dict:
  """`train.train` of `cfg` on a FixedBatch of its shape, on one device, quietly -> its summary."""
  import jax

  from fpa_jax import sharding, train

  return train.train(
    cfg,
    workdir=workdir,
    data=FixedBatch(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size),
    mesh=sharding.make_mesh("data=1,model=1", devices=jax.devices()[:1]),
    progress=False,
    log=lambda s: None,
  )
