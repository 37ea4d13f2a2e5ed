"""Passkey retrieval: greedy exact match of each prompt's answer, teacher-forced or generated,
under any cache policy, by length and depth with Wilson intervals."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fpa_jax.data.passkey import EVAL_DEPTHS, EVAL_MULTIPLES, passkey_eval_examples
from fpa_jax.data.tokenizers import ByteTokenizer
from fpa_jax.eval.stats import check_policy, merge_stats, pool_cells, summary
from fpa_jax.eval.tables import progress
from fpa_jax.inference import as_policy, cached_logits, generate, vocab_size


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
  correct, preds = [], []
  for ex, am in zip(examples, teacher_forced_argmax(predict, seqs, length, batch_size)):
    a0, n = answer_span(ex)
    p = am[a0 - 1 : a0 - 1 + n]  # position t predicts token t + 1
    preds.append(p)
    correct.append(bool((p == np.asarray(ex["tokens"][a0 : a0 + n])).all()))
  return np.asarray(correct, bool), preds


def teacher_forced_argmax(
  predict, seqs: list[np.ndarray], length: int | None = None, batch_size: int = 8
) -> Iterator[np.ndarray]:
  """Each sequence's greedy predictions from one teacher-forced pass, in order: int [length] per
  sequence (position t predicts token t + 1). `seqs` int [T_i] are right-padded to `length`
  (default: the longest) in batches of `batch_size` rows (the last filled with zeros: one compile
  per length), each batch one call of `predict` (tokens int [B, T] -> argmax int [B, T])."""
  longest = max(map(len, seqs))
  length = length or longest
  if longest > length:
    raise ValueError(f"a prompt + answer of {longest} tokens does not fit length={length}")
  for i in range(0, len(seqs), batch_size):
    chunk = seqs[i : i + batch_size]
    batch = np.zeros((batch_size, length), np.int32)  # fixed shape: one compile per length
    for r, s in enumerate(chunk):
      batch[r, : len(s)] = s
    am = np.asarray(predict(batch))
    yield from am[: len(chunk)]


def teacher_forced_predictor(model, policy) -> tuple[Callable[[np.ndarray], Any], Callable[[], dict[str, Any]]]:
  """(predict, stats) for teacher-forced scoring under a checked `policy` (a `CachePolicy` / rule):
  `predict` tokens int [B, T] -> argmax int [B, T], the parallel model for a policy that keeps every
  key (`argmax_fn`, as the package holds it), else every token through the cache; `stats()` the
  cache stats of the calls so far, merged over batches ({} for the parallel model)."""
  if policy.kind.keeps_all:
    return _argmax_fn(model), dict
  got: list = []

  def stats() -> dict[str, Any]:
    out = None
    for s in got:
      out = merge_stats(out, s)
    out.pop("batches")
    return out

  return cached_argmax_fn(model, got, policy=policy), stats


def generated_exact_match(
  model, examples: list[dict], *, batch_size: int, prefill: str, **policy
) -> tuple[np.ndarray, list[np.ndarray], dict[str, Any]]:
  """Greedy generation of each example's answer after its prompt (`fpa_jax.inference.generate`).

  Batches of `batch_size` prompts (the last one filled with copies of its last prompt: one
  compile per cell). -> (correct bool [n], generated answer tokens per example, merged stats:
  `cache_fraction` max over batches (the fullest head's peak), `kept_fraction_mean` the mean over
  batches, layers, kv heads and rows of the keys held at the end / keys seen (the share of the
  cache a policy keeps on average, where a threshold's peak head may keep it all),
  `kept_fraction_per_layer` [L] the same mean per layer (which layer a threshold keeps), `overflow` any).
  """
  spans = [answer_span(ex) for ex in examples]
  n_new = max(n for _, n in spans)
  ok, preds, frac, overflow, kept, layers = [], [], 0.0, False, [], []
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
    kept.append(float(np.mean(stats["kept_fraction_per_head"])))
    layers.append([float(np.mean(h)) for h in stats["kept_fraction_per_head"]])
  stats = {
    "cache_fraction": frac,
    "kept_fraction_mean": float(np.mean(kept)),
    "kept_fraction_per_layer": [float(x) for x in np.mean(layers, axis=0)],
    "overflow": overflow,
  }
  return np.asarray(ok, bool), preds, stats


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


def _argmax_fn(model):
  """`argmax_fn` as the package `fpa_jax.eval` holds it: a stub set there (tests) scores the cells."""
  return sys.modules[__package__].argmax_fn(model)


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
  cross_check: for the full cache (`PolicyRule.keeps_all`), also score the other way and record both,
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
    predict, cache_stats = teacher_forced_predictor(model, policy)  # full: the parallel model
    ok, preds = teacher_forced_exact_match(predict, examples, length, batch_size)
    stats = cache_stats()
  out = {**summary(int(ok.sum()), len(ok), digit_accuracy(examples, preds, tokenizer)), **stats}
  if policy.kind.keeps_all and (cross_check or (cross_check is None and prefill is not None)):
    if prefill is None:  # teacher-forced above: generate too
      gen_ok, tf_ok, how = (
        generated_exact_match(model, examples, batch_size=batch_size, prefill="parallel")[0],
        ok,
        "parallel",
      )
    else:
      gen_ok, tf_ok, how = ok, teacher_forced_exact_match(_argmax_fn(model), examples, length, batch_size)[0], prefill
    score = lambda r: {"correct": int(r.sum()), "accuracy": float(r.mean())}  # noqa: E731
    out["teacher_forced"], out["generated"] = score(tf_ok), {**score(gen_ok), "prefill": how}
    out["scorers_agree"] = bool(np.array_equal(tf_ok, gen_ok))
  return out


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
    "by_length": {str(m): pool_cells([cells[str(m)][str(d)] for d in depths]) for m in multiples},
    "by_depth": {str(d): pool_cells([cells[str(m)][str(d)] for m in multiples]) for d in depths},
    "overall": pool_cells([c for m in multiples for c in cells[str(m)].values()]),
  }
