"""`synthetic`: a test-only task of deterministic random tokens, made in memory (no files).

Batch n of process p is a pure function of (seed + split offset, n, p): the iterator state is just n.
Each row repeats a short random motif (learnable) and holds two packed segments (segment_ids 1
and 2), so the trainer's segment path is exercised. The stream is endless: there are no epochs.
"""

from __future__ import annotations

import numpy as np

SPLITS = {"train": 0, "validation": 1, "test": 2}  # seed offset of each split's stream
MOTIF = 8  # tokens in a row's repeated motif


class SyntheticPipeline:
  """Endless batches in the `Pipeline` format, with `vocab_size`, `info` and exact
  `get_state` / `set_state`. `batch_size` is global: each of the `process_count` processes
  gets its own `batch_size // process_count` rows. Token ids are drawn from [1, vocab_size).
  """

  def __init__(
    self,
    *,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
  ):
    if batch_size % process_count:
      raise ValueError(f"batch_size {batch_size} not divisible by process_count {process_count}")
    if vocab_size < 2:
      raise ValueError(f"synthetic data needs vocab_size >= 2 (id 0 is padding), got {vocab_size}")
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    self.local_batch, self.process_index = batch_size // process_count, process_index
    self.step = 0
    self.info = {
      "task": "synthetic",
      "vocab_size": vocab_size,
      "seq_len": seq_len,
      "batch_size": batch_size,
      "seed": seed,
      "process_index": process_index,
      "process_count": process_count,
    }

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.step, self.process_index])
    self.step += 1
    b, t = self.local_batch, self.seq_len
    motif = rng.integers(1, self.vocab_size, (b, MOTIF))
    toks = np.tile(motif, (1, (t + 1) // MOTIF + 1))[:, : t + 1].astype(np.int32)
    seg = np.where(np.arange(t) < t // 2, 1, 2).astype(np.int32)
    return {
      "inputs": toks[:, :-1],
      "targets": toks[:, 1:],
      "segment_ids": np.broadcast_to(seg, (b, t)).copy(),
      "loss_mask": np.ones((b, t), np.float32),
    }

  def get_state(self) -> dict:
    return {"step": self.step}  # the whole position: batches are a function of it

  def set_state(self, state: dict) -> None:
    self.step = int(state["step"])


def make_synthetic(
  split: str,
  *,
  vocab_size: int | None,
  seq_len: int,
  batch_size: int,
  seed: int,
  process_index: int,
  process_count: int,
) -> SyntheticPipeline:
  """The `split` stream with a per-process `batch_size` (as `make_pipeline` takes it)."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r} for synthetic: valid are {tuple(SPLITS)}")
  if vocab_size is None:
    raise ValueError("the synthetic task needs vocab_size (it has no data to take one from)")
  return SyntheticPipeline(
    vocab_size=vocab_size,
    seq_len=seq_len,
    batch_size=batch_size * process_count,
    seed=seed + SPLITS[split],
    process_index=process_index,
    process_count=process_count,
  )
