"""Evaluate a trained model: loss by position and passkey retrieval, under any KV-cache policy.

    python -m fpa_jax.eval --workdir runs/small_fpa --task loss_by_position --multiple 8 --rows 32
    python -m fpa_jax.eval --workdir runs/small_fpa --task passkey --multiples 1 2 4 8 --n 20
    python -m fpa_jax.eval --workdir runs/small_fpa --task passkey --policy fpa_budget --budget 0.25

    from fpa_jax.eval import loss_by_position, passkey_eval, passkey_cell, wilson_interval
    res = loss_by_position(model, rows, bucket=64)    # rows int [N, T + 1], or an iterable of rows / batches
    res = passkey_eval(model, 256, multiples=(1, 8), n=20, policy="window", budget=0.25)
    write_results(res, "eval/passkey.json")           # + eval/passkey.md

Cache policies (`fpa_jax.inference.policies`): `full` (the default) runs the parallel model, one
forward pass per batch; any other policy decodes every token through the KV cache
(`fpa_jax.inference.cached_logits`), so no query attends to more keys than the policy keeps. A
float budget is a fraction of each row's (each passkey cell's) length, an int a key count.

Passkey prompts are `fpa_jax.data.passkey.passkey_eval_examples` (the `fpa_passkey` eval splits).
A prompt counts as retrieved when greedy decoding reproduces its whole answer (the key's digits)
exactly. By default that is computed from one teacher-forced pass: greedy decoding emits answer
token k iff the argmax after prompt + answer[:k] is answer[k], so by induction it reproduces the
whole answer iff that holds at every answer position; under a cache policy this is the cache fed
the prompt token by token (`generate(prefill="decode")`), since the cache only ever sees the
tokens a correct generation would have produced. `prefill="parallel"|"decode"` instead generates
the answer with `fpa_jax.inference.generate` (parallel prefill: the prompt goes through the
chunked kernel with all of it in view, then the policy cuts the cache). Accuracies carry a 95%
Wilson score interval.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fpa_jax import cli
from fpa_jax.data.passkey import EVAL_DEPTHS, EVAL_MULTIPLES, passkey_eval_examples
from fpa_jax.data.tokenizers import ByteTokenizer
from fpa_jax.inference import CachePolicy, as_policy, cached_logits, generate, vocab_size
from fpa_jax.inference.policies import add_policy_args, parse_budget, policy_from_args

TASKS = ("loss_by_position", "passkey")
Z95 = 1.959963984540054  # standard normal quantile at 0.975
LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------------


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
  """Wilson score interval of a binomial proportion `correct / n` (default 95%).

  (p + z^2 / 2n -/+ z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n), with p = correct / n:
  unlike p -/+ z sqrt(p (1 - p) / n) it stays in [0, 1] and is not empty at p = 0 or 1.
  """
  if isinstance(n, bool) or int(n) != n or n < 1:
    raise ValueError(f"n must be a positive integer count, got {n!r}")
  if int(correct) != correct or not 0 <= correct <= n:
    raise ValueError(f"correct must be an integer in [0, n={n}], got {correct!r}")
  p, z2 = correct / n, z * z
  centre = (p + z2 / (2 * n)) / (1 + z2 / n)
  half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
  return max(0.0, centre - half), min(1.0, centre + half)


def check_policy(policy: str | CachePolicy, seq_len: int, **policy_kw) -> dict[str, Any]:
  """Validate a cache policy for sequences of `seq_len` before any work starts: a name with its
  keywords (budget or compression_ratio, tolerance, threshold, or any other `CachePolicy` field) or
  a `CachePolicy`; -> its JSON record {"policy": name, and each argument given (not None)}."""
  pol = as_policy(policy, **policy_kw)
  pol.resolve(seq_len)  # raises what to change
  return pol.record()


def policy_label(rec: dict[str, Any]) -> str:
  """'full', 'fpa_budget 0.25', 'fpa tolerance=0.001', 'snapkv 0.25 recent=8' (tables)."""
  parts = [rec["policy"]] + ([f"{rec['budget']:g}"] if rec.get("budget") is not None else [])
  fmt = lambda v: f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)  # noqa: E731
  known = ("policy", "budget", "cache_fraction", "kept_fraction_mean", "lost_mass_max", "overflow", "batches")
  parts += [f"{k}={fmt(v)}" for k, v in rec.items() if k not in known and v is not None]
  return " ".join(parts)


def _merge_stats(acc: dict[str, Any] | None, s: dict[str, Any]) -> dict[str, Any]:
  """Combine the cache stats of two batches: peaks and losses by max, the kept mean by mean."""
  keys = ("cache_fraction", "kept_fraction_mean", "lost_mass_max", "overflow")
  s = {k: s[k] for k in keys if k in s}
  if acc is None:
    return {**s, "batches": 1}
  out = {"batches": acc["batches"] + 1}
  for k, v in s.items():
    if k == "overflow":
      out[k] = bool(acc[k] or v)
    elif k == "kept_fraction_mean":
      out[k] = (acc[k] * acc["batches"] + v) / out["batches"]
    else:
      out[k] = max(acc[k], v)
  return out


def progress(it: Iterable, *, enabled: bool = True, **kw):
  """tqdm bar on stderr (off a terminal, as in nohup logs, it updates at most every 30 s)."""
  if not enabled:
    return it
  from tqdm import tqdm

  if not sys.stderr.isatty():
    kw.setdefault("mininterval", 30.0)
  return tqdm(it, dynamic_ncols=True, **kw)


def _check_ids(name: str, ids: np.ndarray, vocab: int) -> None:
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    raise ValueError(f"{name} token ids must be in [0, vocab_size={vocab}), got [{ids.min()}, {ids.max()}]")


# ------------------------------------------------------------------------------------------------
# Loss by position
# ------------------------------------------------------------------------------------------------


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
      stats = _merge_stats(stats, s)
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


# ------------------------------------------------------------------------------------------------
# Passkey retrieval
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _argmax_parallel(graphdef, state, tokens):
  return jnp.argmax(nnx.merge(graphdef, state)(tokens), axis=-1).astype(jnp.int32)


@jax.jit
def _argmax_logits(logits):
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def argmax_fn(model) -> Callable[[np.ndarray], jax.Array]:
  """tokens int [B, T] -> greedy next-token predictions int32 [B, T] (parallel model, jitted;
  compiles are shared by every model of the same structure and shape)."""
  graphdef, state = nnx.split(model)
  return lambda tokens: _argmax_parallel(graphdef, state, tokens)


def cached_argmax_fn(model, stats: list, **policy) -> Callable[[np.ndarray], jax.Array]:
  """Like `argmax_fn`, every token decoded through the cache under `policy` (`cached_logits`
  keyword arguments); each call appends its cache stats to `stats`."""

  def predict(tokens):
    logits, s = cached_logits(model, tokens, **policy)
    stats.append(s)
    return _argmax_logits(logits)

  return predict


def answer_span(ex: dict) -> tuple[int, int]:
  """(first answer token index, answer length) of a `make_prompt` example; tokens end with EOS."""
  return int(ex["answer_start"]), len(ex["tokens"]) - 1 - int(ex["answer_start"])


def eval_batch(length: int, n: int, eval_tokens: int = 16384) -> int:
  """Rows per eval forward pass: up to `eval_tokens` tokens, at most `n` (the prompts per cell)."""
  return max(1, min(n, eval_tokens // length))


def teacher_forced_exact_match(
  predict, examples: list[dict], length: int | None = None, batch_size: int = 8
) -> tuple[np.ndarray, list[np.ndarray]]:
  """Greedy exact match of each example's answer from one teacher-forced forward pass.

  `predict`: tokens int [B, T] -> argmax int [B, T] (e.g. `argmax_fn(model)`). Each example's
  prompt + answer (no EOS) is right-padded to `length` (default: the longest; causal, so padding
  never changes earlier positions). Greedy decoding emits answer token k iff the argmax after
  prompt + answer[:k] is answer[k]; by induction it reproduces the whole answer iff that holds
  for every k. Returns (correct bool [n], per-example predicted answer tokens int [n_answer]).
  """
  seqs = [np.asarray(ex["tokens"][:-1], np.int32) for ex in examples]  # drop EOS
  length = length or max(map(len, seqs))
  if max(map(len, seqs)) > length:
    raise ValueError(f"a prompt + answer of {max(map(len, seqs))} tokens does not fit length={length}")
  correct, preds = [], []
  for i in range(0, len(seqs), batch_size):
    chunk = seqs[i : i + batch_size]
    batch = np.zeros((batch_size, length), np.int32)  # fixed shape: one compile per length
    for r, s in enumerate(chunk):
      batch[r, : len(s)] = s
    am = np.asarray(predict(batch))
    for r, ex in enumerate(examples[i : i + batch_size]):
      a0, n = answer_span(ex)
      p = am[r, a0 - 1 : a0 - 1 + n]  # position t predicts token t + 1
      preds.append(p)
      correct.append(bool((p == np.asarray(ex["tokens"][a0 : a0 + n])).all()))
  return np.asarray(correct, bool), preds


def generated_exact_match(
  model, examples: list[dict], *, batch_size: int, prefill: str, **policy
) -> tuple[np.ndarray, list[np.ndarray], dict[str, Any]]:
  """Greedy generation of each example's answer after its prompt (`fpa_jax.inference.generate`).

  Batches of `batch_size` prompts (the last one filled with copies of its last prompt: one
  compile per cell). -> (correct bool [n], generated answer tokens per example, merged stats:
  `cache_fraction` max over batches, `overflow` any).
  """
  spans = [answer_span(ex) for ex in examples]
  n_new = max(n for _, n in spans)
  ok, preds, frac, overflow = [], [], 0.0, False
  for i in range(0, len(examples), batch_size):
    chunk = examples[i : i + batch_size]
    prompts = [np.asarray(ex["tokens"][:a0]) for ex, (a0, _) in zip(chunk, spans[i : i + batch_size])]
    while len(prompts) < batch_size:  # fixed batch: one compile per cell
      prompts.append(prompts[-1])
    out, stats = generate(model, prompts, n_new, prefill=prefill, **policy)
    for r, (ex, (a0, n)) in enumerate(zip(chunk, spans[i : i + batch_size])):
      preds.append(out[r, :n])
      ok.append(bool(np.array_equal(out[r, :n], np.asarray(ex["tokens"][a0 : a0 + n]))))
    frac, overflow = max(frac, stats["cache_fraction"]), overflow or stats["overflow"]
  return np.asarray(ok, bool), preds, {"cache_fraction": frac, "overflow": overflow}


@functools.lru_cache(maxsize=4096)
def _has_digit(tokenizer, token: int) -> bool:
  return any(c.isdigit() for c in tokenizer.decode([token]))


def digit_accuracy(examples: list[dict], preds: list[np.ndarray], tokenizer=None) -> float | None:
  """Mean over examples of the fraction of the answer's digit tokens predicted right (the leading
  space of " 12345" is not a digit); with teacher forcing each one given the true answer before it.
  None if no answer has a digit token."""
  tok = tokenizer or ByteTokenizer()
  fracs = []
  for ex, p in zip(examples, preds):
    a0, n = answer_span(ex)
    want = np.asarray(ex["tokens"][a0 : a0 + n])
    mask = np.asarray([_has_digit(tok, int(t)) for t in want], bool)
    if mask.any():
      fracs.append(float(np.mean(np.asarray(p)[mask] == want[mask])))
  return float(np.mean(fracs)) if fracs else None


def _summary(correct: int, n: int, digit: float | None = None) -> dict[str, Any]:
  lo, hi = wilson_interval(correct, n)
  out = {"n": n, "correct": correct, "accuracy": correct / n, "ci95": [lo, hi]}
  if digit is not None:
    out["digit_accuracy"] = digit
  return out


def passkey_cell(
  model,
  examples: list[dict],
  *,
  length: int | None = None,
  batch_size: int = 8,
  policy: str = "full",
  budget: float | int | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  prefill: str | None = None,
  tokenizer=None,
  cross_check: bool | None = None,
  **policy_kw,
) -> dict[str, Any]:
  """Greedy exact match of the answers of `examples` (`make_prompt` dicts) under a cache policy
  (`policy` with budget, tolerance, threshold or any other `make_policy` keyword).

  prefill None: teacher-forced, rows right-padded to `length` (default the longest prompt +
  answer), `full` on the parallel model, other policies through `cached_logits`. "parallel" /
  "decode": the answer generated by `generate` with that prefill.
  cross_check: for the full cache (`Policy.keeps_all`), also score the other way and record both,
  so that a scorer's bug cannot pass for a policy's effect (greedy generation through a full cache
  and the teacher-forced argmax are the same computation): a generated cell is also scored
  teacher-forced (one parallel pass: on by default, None), a teacher-forced one also generated
  with a parallel prefill (a decode per cell: off by default, True turns it on).
  -> {"n", "correct", "accuracy", "ci95" (Wilson 95%), "digit_accuracy", and for a cache path its
  stats: "cache_fraction" (peak keys held / sequence), "overflow", ...; cross-checked: "teacher_forced"
  and "generated" ({"correct", "accuracy"}, the latter with its "prefill") and "scorers_agree"
  (every example scored alike)}.
  """
  if not examples:
    raise ValueError("examples is empty: no passkey prompt to score")
  if prefill not in (None, "parallel", "decode"):
    raise ValueError(f"prefill must be None (teacher-forced), 'parallel' or 'decode', got {prefill!r}")
  pk = dict(budget=budget, tolerance=tolerance, threshold=threshold, **policy_kw)
  policy, pk = as_policy(policy, **pk), {}
  if prefill is not None:
    policy.kind.check_prefill(prefill)  # h2o: decode only; snapkv: parallel only
    ok, preds, stats = generated_exact_match(
      model, examples, batch_size=batch_size, prefill=prefill, policy=policy, **pk
    )
  else:
    longest = max(len(ex["tokens"]) - 1 for ex in examples)
    check_policy(policy, length or longest, **pk)
    if policy.kind.keeps_all:  # full: the parallel model
      ok, preds = teacher_forced_exact_match(argmax_fn(model), examples, length, batch_size)
      stats = {}
    else:
      got: list = []
      predict = cached_argmax_fn(model, got, policy=policy, **pk)
      ok, preds = teacher_forced_exact_match(predict, examples, length, batch_size)
      stats = None
      for s in got:
        stats = _merge_stats(stats, s)
      stats.pop("batches")
  out = {**_summary(int(ok.sum()), len(ok), digit_accuracy(examples, preds, tokenizer)), **stats}
  if policy.kind.keeps_all and (cross_check or (cross_check is None and prefill is not None)):
    if prefill is None:  # teacher-forced above: generate too
      gen_ok, tf_ok, how = (
        generated_exact_match(model, examples, batch_size=batch_size, prefill="parallel")[0],
        ok,
        "parallel",
      )
    else:
      gen_ok, tf_ok, how = ok, teacher_forced_exact_match(argmax_fn(model), examples, length, batch_size)[0], prefill
    score = lambda r: {"correct": int(r.sum()), "accuracy": float(r.mean())}  # noqa: E731
    out["teacher_forced"], out["generated"] = score(tf_ok), {**score(gen_ok), "prefill": how}
    out["scorers_agree"] = bool(np.array_equal(tf_ok, gen_ok))
  return out


def _pool(cells: list[dict]) -> dict[str, Any]:
  n, k = sum(c["n"] for c in cells), sum(c["correct"] for c in cells)
  digit = [c["digit_accuracy"] for c in cells if "digit_accuracy" in c]
  d = float(np.average(digit, weights=[c["n"] for c in cells])) if len(digit) == len(cells) else None
  return _summary(k, n, d)


def passkey_examples(train_len: int, multiple: int, depth: int, n: int, seed: int = 0, tokenizer=None) -> list[dict]:
  """`passkey_eval_examples` with an error that says which length is too short."""
  try:
    return passkey_eval_examples(train_len, multiple, depth, n=n, seed=seed, tokenizer=tokenizer)
  except ValueError as e:
    raise ValueError(
      f"passkey prompts of {multiple} x {train_len} = {multiple * train_len} tokens cannot be built ({e}): "
      "use a longer train length or larger multiples"
    ) from None


def passkey_eval(
  model,
  train_len: int,
  *,
  multiples=EVAL_MULTIPLES,
  depths=EVAL_DEPTHS,
  n: int = 20,
  seed: int = 0,
  policy: str = "full",
  budget: float | int | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  prefill: str | None = None,
  eval_tokens: int = 16384,
  batch_size: int | None = None,
  tokenizer=None,
  show_progress: bool = True,
  desc: str = "passkey",
  **policy_kw,
) -> dict[str, Any]:
  """Passkey retrieval by length and depth: `n` prompts per (multiple x `train_len`, depth %) cell
  (`passkey_eval_examples(train_len, multiple, depth, n, seed)`), scored by `passkey_cell`.

  batch_size: rows per pass (default: up to `eval_tokens` tokens, `eval_batch`). Prompts are
  built (and their lengths checked) before anything runs.
  -> {"cells": {multiple: {depth: cell}}, "by_length": {multiple: pooled}, "by_depth": {depth:
  pooled}, "overall", "train_length", "multiples", "depths", "n", "seed", "scoring", "cache"};
  every cell / pool: n, correct, accuracy, ci95 (95% Wilson), digit_accuracy (+ cache stats).
  """
  multiples, depths = [int(m) for m in multiples], [int(d) for d in depths]
  if int(train_len) != train_len or train_len < 1:
    raise ValueError(f"train_len must be a positive int, got {train_len!r}")
  if not multiples or any(m < 1 for m in multiples):
    raise ValueError(f"multiples must be positive ints, got {multiples}")
  if not depths or any(not 0 <= d <= 100 for d in depths):
    raise ValueError(f"depths are percentages in [0, 100], got {depths}")
  if int(n) != n or n < 1:
    raise ValueError(f"n (prompts per cell) must be a positive int, got {n!r}")
  if prefill not in (None, "parallel", "decode"):
    raise ValueError(f"prefill must be None (teacher-forced), 'parallel' or 'decode', got {prefill!r}")
  policy_kw = dict(budget=budget, tolerance=tolerance, threshold=threshold, **policy_kw)
  policy, policy_kw = as_policy(policy, **policy_kw), {}
  if prefill is not None:
    policy.kind.check_prefill(prefill)  # h2o: decode only; snapkv: parallel only
  tok = tokenizer or ByteTokenizer()
  if tok.vocab_size > (vocab := vocab_size(model)):
    raise ValueError(f"the tokenizer's vocabulary ({tok.vocab_size}) is larger than the model's ({vocab})")
  rec = check_policy(policy, max(multiples) * train_len, **policy_kw)
  for m in multiples:  # a budget may be fine at the longest length and not at the shortest
    check_policy(policy, m * train_len, **policy_kw)
  grid = [(m, d) for m in multiples for d in depths]
  exs = {(m, d): passkey_examples(train_len, m, d, n, seed, tok) for m, d in grid}
  cells: dict[str, dict[str, Any]] = {}
  for m, d in progress(grid, enabled=show_progress, desc=desc, leave=False):
    length = train_len * m
    bs = batch_size or eval_batch(length, n, eval_tokens)
    cells.setdefault(str(m), {})[str(d)] = passkey_cell(
      model,
      exs[m, d],
      length=length if prefill is None else None,
      batch_size=bs,
      prefill=prefill,
      tokenizer=tok,
      policy=policy,
      **policy_kw,
    )
  return {
    "task": "passkey",
    "train_length": train_len,
    "multiples": multiples,
    "depths": depths,
    "n": n,
    "seed": seed,
    "scoring": "teacher_forced" if prefill is None else f"generate (prefill {prefill})",
    "prefill": prefill,
    "cache": rec,
    "cells": cells,
    "by_length": {str(m): _pool([cells[str(m)][str(d)] for d in depths]) for m in multiples},
    "by_depth": {str(d): _pool([cells[str(m)][str(d)] for m in multiples]) for d in depths},
    "overall": _pool([c for m in multiples for c in cells[str(m)].values()]),
  }


# ------------------------------------------------------------------------------------------------
# Results files
# ------------------------------------------------------------------------------------------------


def _acc_ci(c: dict | None) -> str:
  if c is None:
    return "—"
  return f"{c['accuracy']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]"


def markdown(res: dict) -> str:
  """A small markdown table of a `loss_by_position` or `passkey_eval` result."""
  head = f"`{res['meta']['command']}`: " if res.get("meta", {}).get("command") else ""
  pol = policy_label(res["cache"])
  if res["task"] == "passkey":
    L, ms = res["train_length"], res["multiples"]
    text = (
      f"{head}passkey greedy exact match ({res['scoring']}), cache policy `{pol}`, {res['n']} prompts per "
      f"(length, depth) cell, seed {res['seed']}; [95% Wilson interval].\n\n"
    )
    rows = [[f"{d}%", *[_acc_ci(res["cells"][str(m)][str(d)]) for m in ms]] for d in res["depths"]]
    rows.append(["all depths", *[_acc_ci(res["by_length"][str(m)]) for m in ms]])
    table = _md_table(["depth", *[f"{m}x ({m * L})" for m in ms]], rows)
    o = res["overall"]
    return text + table + f"\nOverall: {_acc_ci(o)} ({o['correct']}/{o['n']}).\n"
  L = res.get("train_length")
  text = (
    f"{head}held-out loss by position, {res['rows']} rows of {res['seq_len']} tokens, cache policy `{pol}`; "
    f"mean {res['nll_mean']:.4f} nats/token over {res['tokens']} tokens"
    + (
      f"; the windows cover {res['coverage']['docs_covered']} of the split's {res['coverage']['docs_in_split']} "
      "documents"
      if res.get("coverage")
      else ""
    )
    + ".\n\n"
  )
  rows = []
  for (a, b), v, c in zip(res["buckets"], res["nll"], res["bucket_tokens"]):
    where = [f"{b / L:.2g}"] if L else []
    rows.append([f"{a}-{b}", *where, c, "—" if v is None else f"{v:.4f}", "—" if v is None else f"{v / LN2:.4f}"])
  cols = ["positions [a, b)", *(["end / L"] if L else []), "tokens", "nll (nats)", "bits"]
  return text + _md_table(cols, rows)


def _md_table(headers: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(headers) - 1)) + " |"]
  return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows]) + "\n"


def write_results(res: dict, path: str | os.PathLike) -> tuple[Path, Path]:
  """Write `res` to `path` (JSON, atomically) and its table to the same name with `.md`."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(res, indent=1) + "\n")
  os.replace(tmp, path)
  md = path.with_suffix(".md")
  md.write_text(markdown(res))
  return path, md


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _policy_args(items: list[str]) -> dict[str, Any]:
  """['recent=16', 'bound=params'] -> {'recent': 16, 'bound': 'params'} (int, then float, else str)."""
  out = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep or not key.isidentifier():
      raise ValueError(f"--policy-arg takes KEY=VALUE (a make_policy keyword), got {item!r}")
    if key in ("budget", "compression_ratio", "tolerance", "threshold"):
      raise ValueError(f"give {key} as --{key.replace('_', '-')}, not as --policy-arg")
    try:
      out[key] = parse_budget(raw)
    except ValueError:
      out[key] = raw
  return out


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(
    prog="python -m fpa_jax.eval",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--workdir", required=True, help="a training workdir (python -m fpa_jax.train --workdir ...)")
  ap.add_argument("--task", required=True, choices=TASKS)
  ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  add_policy_args(ap, of="each row / cell length")
  ap.add_argument(
    "--policy-arg",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="any other keyword of fpa_jax.inference.make_policy (e.g. obs_window=16); repeatable",
  )
  ap.add_argument("--batch-size", type=int, help="rows per pass (default: 8 / up to --eval-tokens tokens)")
  ap.add_argument("--out", help="results JSON (a .md table beside it); default WORKDIR/eval/<task>_<policy>.json")
  ap.add_argument("--no-progress", action="store_true")
  g = ap.add_argument_group("loss_by_position")
  g.add_argument("--multiple", type=int, default=4, help="rows of this many times the training length")
  g.add_argument("--length", type=int, help="row length in tokens (overrides --multiple)")
  g.add_argument("--rows", type=int, default=32, help="held-out windows (spread over every validation document)")
  g.add_argument("--bucket", type=int, help="positions per bucket (default: length / 16)")
  g.add_argument("--rows-npy", help="token rows int [N, T + 1] from a .npy file instead of the text pipeline")
  g.add_argument("--data-dir", help="fpa_text / tokenizer location (default: the run's data_dir)")
  g.add_argument("--text-source", default="stdlib", help="the text pipeline's source (stdlib, a directory, tfds:NAME)")
  g = ap.add_argument_group("passkey")
  g.add_argument("--train-len", type=int, help="the length prompts are multiples of (default: the run's seq_len)")
  g.add_argument("--multiples", type=int, nargs="+", default=list(EVAL_MULTIPLES))
  g.add_argument("--depths", type=int, nargs="+", default=list(EVAL_DEPTHS), help="needle depths in percent")
  g.add_argument("--n", type=int, default=20, help="prompts per (length, depth) cell")
  g.add_argument("--seed", type=int, default=0, help="0: the fpa_passkey eval splits' prompts")
  g.add_argument(
    "--prefill",
    choices=("parallel", "decode"),
    help="generate the answer with this prefill (default: teacher-forced exact match, one pass per prompt)",
  )
  g.add_argument("--eval-tokens", type=int, default=16384, help="tokens per pass when --batch-size is not given")
  return cli.parse(ap, argv)


def _text_rows(cfg, a, seq_len: int, batch: int):
  """The trainer's held-out set at `seq_len`: `--rows` windows spread over every validation
  document (`fpa_jax.data.make_heldout`, seed 0), not the first rows of the stream (one or two
  files). -> (pipeline, coverage) with coverage as `fpa_jax.data.windows.coverage`."""
  from fpa_jax.data import make_heldout

  h = make_heldout(
    "validation",
    data_dir=a.data_dir or cfg.data_dir,
    seq_len=seq_len,
    batch_size=batch,
    n_windows=a.rows,
    tokenizer=cfg.tokenizer,
    small=cfg.small_data,
    text_source=a.text_source,
    process_index=0,
    process_count=1,
  )
  return h, h.info["coverage"]


def default_out(workdir, task: str, rec: dict[str, Any], prefill: str | None = None) -> Path:
  """WORKDIR/eval/<task>_<policy>[_b<budget>][_cr<ratio>][_e<tol>][_t<tau>][_<key><value>...][_<prefill>].json"""
  tag = rec["policy"]
  short = {"budget": "b", "compression_ratio": "cr", "tolerance": "e", "threshold": "t"}
  for key, v in rec.items():
    if key != "policy" and v is not None and not key.startswith(("cache_", "kept_", "lost_", "overflow", "batches")):
      tag += f"_{short.get(key, key)}{v:g}" if isinstance(v, (int, float)) else f"_{key}{v}"
  return Path(workdir) / "eval" / f"{task}_{tag}{'_' + prefill if prefill else ''}.json"


def run(a: argparse.Namespace, argv=None) -> tuple[dict, Path]:
  """Evaluate as the parsed CLI arguments say; -> (results, results path). Raises ValueError /
  FileNotFoundError on bad arguments, before the model runs."""
  from fpa_jax.checkpoint import Checkpointer
  from fpa_jax.data.tokenizers import load_tokenizer
  from fpa_jax.inference import load_model

  pol = dict(policy=policy_from_args(a, **_policy_args(a.policy_arg)))
  for flag in ("batch_size", "rows", "bucket", "length", "multiple", "train_len", "n", "eval_tokens"):
    v = getattr(a, flag)
    if v is not None and v < 1:
      raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
  if a.task == "loss_by_position" and a.prefill is not None:
    raise ValueError("--prefill applies to --task passkey only")
  if a.task == "passkey" and any(v is not None for v in (a.rows_npy, a.length, a.bucket)):
    raise ValueError("--rows-npy, --length and --bucket apply to --task loss_by_position only")
  t0 = time.perf_counter()
  model, cfg = load_model(a.workdir, step=a.step)
  ck = Checkpointer(os.path.join(a.workdir, "checkpoints"), async_save=False)
  try:
    step = a.step if a.step is not None else ck.latest_step()
  finally:
    ck.close()
  show = not a.no_progress
  if a.task == "loss_by_position":
    if a.rows_npy:
      rows = np.load(a.rows_npy)
      if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"{a.rows_npy}: token rows must be int [N, T + 1], got shape {rows.shape}")
      seq_len = rows.shape[1] - 1
    else:
      seq_len = a.length or a.multiple * cfg.seq_len
    check_policy(seq_len=seq_len, **pol)  # before the pipeline is built
    batch = a.batch_size or 8
    coverage = None
    if not a.rows_npy:
      rows, coverage = _text_rows(cfg, a, seq_len, batch)
    res = loss_by_position(
      model,
      rows,
      bucket=a.bucket or max(1, seq_len // 16),
      batch_size=batch,
      max_rows=a.rows,
      train_len=cfg.seq_len,
      show_progress=show,
      **pol,
    )
    res["data"] = a.rows_npy or (
      f"fpa_text validation ({a.text_source}{', small' if cfg.small_data else ''}): {a.rows} held-out windows "
      "spread over every document"
    )
    if coverage is not None:
      res["coverage"] = coverage
  else:
    tok = load_tokenizer(cfg.tokenizer, a.data_dir or cfg.data_dir, small=cfg.small_data)
    res = passkey_eval(
      model,
      a.train_len or cfg.seq_len,
      multiples=a.multiples,
      depths=a.depths,
      n=a.n,
      seed=a.seed,
      prefill=a.prefill,
      eval_tokens=a.eval_tokens,
      batch_size=a.batch_size,
      tokenizer=tok,
      show_progress=show,
      **pol,
    )
  res["meta"] = {
    "command": " ".join(["python", "-m", "fpa_jax.eval", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
    "workdir": str(a.workdir),
    "step": step,
    "attention": cfg.attention,
    "train_seq_len": cfg.seq_len,
    "backend": jax.default_backend(),
    "wall_s": round(time.perf_counter() - t0, 1),
    "finished": datetime.datetime.now().isoformat(timespec="seconds"),
  }
  out = Path(a.out) if a.out else default_out(a.workdir, a.task, res["cache"], a.prefill)
  write_results(res, out)
  return res, out


def main(argv=None) -> int:
  a = parse_args(argv)
  try:
    res, out = run(a, argv)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(markdown(res))
  print(f"wrote {out} and {out.with_suffix('.md')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
