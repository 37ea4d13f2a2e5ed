"""Tiny in-memory data iterators for the trainer tests (the `fpa_jax.data` Pipeline interface)."""

from __future__ import annotations

import numpy as np


class FixedBatch:
  """Yields the same batch forever (for overfitting); `get_state` is a counter.

  Optionally poisons the loss mask with NaN from the `nan_at`-th batch on (1-based), to drive the
  non-finite-loss guard.
  """

  def __init__(self, *, vocab_size: int = 64, seq_len: int = 32, batch_size: int = 8, seed: int = 0,
               nan_at: int | None = None):
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    self.batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                  "segment_ids": np.ones((batch_size, seq_len), np.int32),
                  "loss_mask": np.ones((batch_size, seq_len), np.float32)}
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
