"""Text loss: per-token NLL under any cache policy and the mean loss by position in the row."""

from __future__ import annotations

import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fpa_jax.eval.stats import check_policy, merge_stats
from fpa_jax.eval.tables import progress
from fpa_jax.inference import as_policy, cached_logits, vocab_size


def _check_ids(name: str, ids: np.ndarray, vocab: int) -> None:
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    raise ValueError(f"{name} token ids must be in [0, vocab_size={vocab}), got [{ids.min()}, {ids.max()}]")


@functools.partial(jax.jit, static_argnums=0)
def _nll_parallel(graphdef, state, inputs, targets, segment_ids):
  logits = nnx.merge(graphdef, state)(inputs, segment_ids)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@jax.jit
def _nll_from_logits(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def token_nll(
  model,
  inputs,
  targets,
  segment_ids=None,
  *,
  policy: str = "full",
  **policy_kw,
) -> tuple[np.ndarray, dict[str, Any] | None]:
  """Per-token NLL in nats of `targets` given `inputs` (int [B, T], segment_ids int [B, T] or None).

  `full`: the parallel model (jitted once per model structure and shape); other policies: every
  token decoded through the cache (`cached_logits`), restarting where the segment id changes.
  `model`: a `DecoderLM` or a model of your own (`fpa_jax.inference.graph`). policy: a name with
  its keywords in policy_kw (budget, tolerance, threshold, ...), or a `CachePolicy`.
  -> (nll float32 [B, T], the cache stats of `cached_logits`, or None for the parallel path).
  """
  inputs, targets = np.asarray(inputs), np.asarray(targets)
  if inputs.ndim != 2 or inputs.shape != targets.shape:
    raise ValueError(f"inputs and targets must both be int [batch, seq], got {inputs.shape} and {targets.shape}")
  vocab = vocab_size(model)
  _check_ids("input", inputs, vocab)
  _check_ids("target", targets, vocab)
  seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  policy = as_policy(policy, **policy_kw)
  if policy.kind.keeps_all:  # full: the parallel model
    policy.resolve(inputs.shape[1])
    graphdef, state = nnx.split(model)
    nll = _nll_parallel(graphdef, state, jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32), seg)
    return np.asarray(nll), None
  logits, stats = cached_logits(model, inputs, policy=policy, segment_ids=seg)
  return np.asarray(_nll_from_logits(logits, jnp.asarray(targets, jnp.int32))), stats


def _rows_of(item, index: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
  """One item of `rows` -> (inputs [T], targets [T], counted bool [T], segment ids [T] or None) per row."""
  if isinstance(item, dict):
    if "inputs" not in item or "targets" not in item:
      raise ValueError(f"a batch dict needs 'inputs' and 'targets' (a pipeline batch), got keys {sorted(item)}")
    x, y = np.asarray(item["inputs"]), np.asarray(item["targets"])
    if x.ndim != 2 or x.shape != y.shape:
      raise ValueError(f"batch {index}: inputs and targets must be [batch, seq], got {x.shape} and {y.shape}")
    seg = None if item.get("segment_ids") is None else np.asarray(item["segment_ids"])
    keep = np.ones(x.shape, bool)
    if item.get("loss_mask") is not None:
      keep &= np.asarray(item["loss_mask"]) > 0
    if seg is not None:
      keep &= seg > 0  # 0 = padding
    for r in range(len(x)):
      yield x[r], y[r], keep[r], None if seg is None else seg[r]
    return
  a = np.asarray(item)
  if a.ndim not in (1, 2) or a.shape[-1] < 2:
    raise ValueError(f"token rows must be int [N, T + 1] (T >= 1) or [T + 1], got shape {a.shape} (item {index})")
  if not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"token rows must be integers, got dtype {a.dtype} (item {index})")
  for r in a.reshape(-1, a.shape[-1]):
    yield r[:-1], r[1:], np.ones(len(r) - 1, bool), None


def _row_stream(rows, max_rows: int | None):
  """Every row of `rows` (an array [N, T + 1], a batch dict, or an iterable of rows / arrays / dicts)."""
  if isinstance(rows, dict) or (hasattr(rows, "ndim") and hasattr(rows, "shape")):
    items = [rows]
  else:
    items = rows
  n = 0
  for i, item in enumerate(items):
    for row in _rows_of(item, i):
      if max_rows is not None and n >= max_rows:
        return
      yield row
      n += 1


def _segment_positions(seg: np.ndarray) -> np.ndarray:
  """seg int [B, T] -> index of each token since its segment started, int [B, T]."""
  t = np.arange(seg.shape[1])
  start = np.concatenate([np.ones((len(seg), 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return t - np.maximum.accumulate(np.where(start, t, 0), axis=1)


def loss_by_position(
  model,
  rows,
  *,
  bucket: int = 64,
  batch_size: int = 8,
  max_rows: int | None = None,
  policy: str = "full",
  budget: float | int | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  train_len: int | None = None,
  per_position: bool = False,
  show_progress: bool = True,
  desc: str = "loss by position",
  **policy_kw,
) -> dict[str, Any]:
  """Mean next-token NLL (nats) per position bucket, each row read from its start in one pass.

  rows: token rows int [N, T + 1] (inputs row[:-1], targets row[1:], every position counted), or a
    pipeline batch dict (inputs/targets int [B, T], optional loss_mask and segment_ids: a token
    counts where loss_mask > 0 and segment_ids > 0), or an iterable of such rows / arrays / dicts
    (a pipeline: give `max_rows` if it never ends). All rows must have the same T.
  Position t of a token is the number of tokens before it in its row (in its segment, where rows
  carry segment_ids: the model restarts there), i.e. its prediction sees t + 1 tokens. Bucket
  [a, b) averages every counted token at positions a..b-1 over all rows (empty: None). Rows are
  batched `batch_size` at a time (the last batch padded, so each shape compiles once).
  policy, budget, tolerance, threshold, **policy_kw: the KV-cache policy and its keywords
    (`fpa_jax.inference.make_policy`; module docstring; `full` = the parallel model), or policy a
    `CachePolicy` alone. `model`: a `DecoderLM` or a model of your own (`fpa_jax.inference.graph`).
  train_len: recorded, for tables that mark multiples of the training length.
  show_progress: a tqdm bar over rows (stderr).
  -> {"buckets": [[a, b], ...], "nll": [...], "bucket_tokens": [...], "nll_mean", "tokens", "rows",
  "seq_len", "cache": {policy record, stats}, ["nll_by_position", "position_tokens"]}.
  """
  if int(bucket) != bucket or bucket < 1:
    raise ValueError(f"bucket must be a positive int (positions per bucket), got {bucket!r}")
  if int(batch_size) != batch_size or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  if max_rows is not None and max_rows < 1:
    raise ValueError(f"max_rows must be >= 1 (or None: every row), got {max_rows}")
  policy_kw = dict(budget=budget, tolerance=tolerance, threshold=threshold, **policy_kw)
  sums = counts = None
  rec, stats, n_rows, seq_len = None, None, 0, None

  def flush(batch):  # one padded batch of rows through the model, accumulated per position
    nonlocal stats
    real, pad = len(batch), batch_size - len(batch)
    x, y, keep = (np.pad(np.stack([r[i] for r in batch]), ((0, pad), (0, 0))) for i in range(3))
    seg = None
    if any(r[3] is not None for r in batch):  # rows without segment ids are one segment; padding is 0
      seg = np.zeros(x.shape, np.int32)
      for i, r in enumerate(batch):
        seg[i] = 1 if r[3] is None else r[3]
    nll, s = token_nll(model, x, y, seg, policy=policy, **policy_kw)
    if s is not None:
      stats = merge_stats(stats, s)
    pos = np.broadcast_to(np.arange(seq_len), x.shape) if seg is None else _segment_positions(seg)
    keep[real:] = False
    np.add.at(sums, pos[keep], nll[keep].astype(np.float64))
    np.add.at(counts, pos[keep], 1)

  batch = []
  total = max_rows
  if isinstance(rows, np.ndarray) and rows.ndim == 2:
    total = len(rows) if max_rows is None else min(len(rows), max_rows)
  bar = progress(_row_stream(rows, max_rows), enabled=show_progress, desc=desc, total=total, unit="row", leave=False)
  for row in bar:
    if seq_len is None:
      seq_len = len(row[0])
      rec = check_policy(policy, seq_len, **policy_kw)
      sums, counts = np.zeros(seq_len, np.float64), np.zeros(seq_len, np.int64)
    elif len(row[0]) != seq_len:
      raise ValueError(
        f"every row must have the same length: row {n_rows} has {len(row[0])} positions, row 0 {seq_len}"
      )
    batch.append(row)
    n_rows += 1
    if len(batch) == batch_size:
      flush(batch)
      batch = []
  if batch:
    flush(batch)
  if seq_len is None:
    raise ValueError("rows is empty: no token row to evaluate")
  edges = [(a, min(a + bucket, seq_len)) for a in range(0, seq_len, bucket)]
  bsum = [float(sums[a:b].sum()) for a, b in edges]
  bcnt = [int(counts[a:b].sum()) for a, b in edges]
  out = {
    "task": "loss_by_position",
    "unit": "nats per token; bucket [a, b): tokens at positions a..b-1 of their row (segment), mean over rows",
    "seq_len": seq_len,
    "train_length": train_len,
    "rows": n_rows,
    "tokens": int(counts.sum()),
    "bucket": bucket,
    "buckets": [list(e) for e in edges],
    "nll": [s / c if c else None for s, c in zip(bsum, bcnt)],
    "bucket_tokens": bcnt,
    "nll_mean": float(sums.sum() / counts.sum()) if counts.sum() else None,
    "cache": {**rec, **(stats or {})},
  }
  if per_position:
    out["nll_by_position"] = [float(s / c) if c else None for s, c in zip(sums, counts)]
    out["position_tokens"] = counts.tolist()
  return out


def token_nll_fn(model):
  """Jitted per-token NLL of the parallel model: (inputs, targets int [B, T]) -> nats fp32 [B, T]
  (causal, no segments; one compile per model structure and shape)."""
  graphdef, state = nnx.split(model)
  return lambda inputs, targets: _nll_parallel(graphdef, state, inputs, targets, None)
