"""The retrieval suite (`fpa_jax.data.niah`, RULER's tasks at byte level) on any model under any
KV-cache policy, at multiples of the training length: a table per model (task x length, as RULER's)
and score against the fraction of keys removed (kvpress's figure), one resumable results file.

    cell = retrieval_cell(model, retrieval_eval_examples("niah_single", 1024, None, n=8), policy="window", budget=0.25)
    res = run_suite(model, train_len=256, multiples=(1, 2, 4, 8), policies=["full", "fpa_global:0.25"], n=50,
                    out_path="results/suite.json")   # again: scores only the cells the file lacks
    print(suite_table(res)); removal_plot(res, "results/suite.png")

    python -m fpa_jax.eval retrieval --workdir RUN --multiples 1 2 4 8 --policies full fpa_global:0.25 \
        window:0.125 --n 50 --out results/x.json       # + x.md (the tables) and x.png (the plot)
    (`python -m fpa_jax.eval.retrieval ...` runs the same, with runpy's warning that the package imported it first)

Scoring (`niah.score_answers`, teacher-forced by default): an answer is right iff greedy decoding
would emit every one of its bytes after the true prefix (one parallel pass, or every token through
the cache under a policy: `passkey.teacher_forced_predictor`); an example scores the share of its
answers right, a cell the mean over its examples ("score"), with the share of examples wholly
right ("exact") and its 95% Wilson interval. `prefill="parallel"|"decode"` generates the answer
text instead (`passkey.generated_exact_match`) and parses it (not bindings, whose answers are
interleaved with the program).

Task labels (`SUITE_TASKS`): the names of `niah.TASKS`, with niah_multikey as one row per k
("niah_multikey_k2", "_k4", "_k8"; "niah_multikey" stands for all three). Every example draws its
needles' depths uniformly (depth None) with each task's default options (digits, "repeat" haystack).
Policies: a spec "NAME[:BUDGET][:KEY=VALUE...]" ("full", "fpa_global:0.25", "fpa:tolerance=0.001",
"snapkv:0.25:recent=8"; a float budget is a fraction of each cell's length) or a (label, keywords)
pair of `as_policy` keywords.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import jax
import numpy as np
from flax import nnx

from fpa_jax.data import niah
from fpa_jax.data.niah import RetrievalExample
from fpa_jax.data.tokenizers import EOS_ID, ByteTokenizer
from fpa_jax.eval.passkey import (
  eval_batch,
  generated_exact_match,
  teacher_forced_argmax,
  teacher_forced_predictor,
)
from fpa_jax.eval.stats import check_policy, wilson_interval
from fpa_jax.eval.tables import md_table, progress
from fpa_jax.inference import CachePolicy, PolicyRule, as_policy, vocab_size
from fpa_jax.inference.policies import parse_budget

Prefill = Literal["parallel", "decode"]
SUITE_TASKS: tuple[str, ...] = (
  "niah_single",
  *(f"niah_multikey_k{k}" for k in niah.MULTIKEY_K),
  "niah_multivalue",
  "niah_multiquery",
  "variable_tracking",
  "passkey",
  "bindings",
)
SUITE_MULTIPLES = (1, 2, 4, 8)
FORMAT = 1  # the results file's layout; another one starts afresh
_MULTIKEY = re.compile(r"niah_multikey_k(\d+)$")


# --- tasks and policies --------------------------------------------------------------------------


def suite_task(label: str) -> tuple[str, dict[str, Any]]:
  """A task label -> (`niah.TASKS` name, its generator's options): "niah_multikey_k8" ->
  ("niah_multikey", {"k": 8}); any other label is a task name with no option."""
  if m := _MULTIKEY.match(label):
    return "niah_multikey", {"k": int(m.group(1))}
  return label, {}


def expand_tasks(tasks: Iterable[str] | str) -> list[str]:
  """Task labels, "niah_multikey" expanded to one label per k of `niah.MULTIKEY_K`; ValueError on an
  unknown name (listing the valid ones) or a repeated one."""
  tasks = [tasks] if isinstance(tasks, str) else list(tasks)
  out: list[str] = []
  for t in tasks:
    labels = [f"niah_multikey_k{k}" for k in niah.MULTIKEY_K] if t == "niah_multikey" else [t]
    for label in labels:
      task, kw = suite_task(label)
      if task not in niah.TASKS or task == label == "niah_multikey" or kw.get("k", 1) < 1:
        raise ValueError(
          f"unknown retrieval task {t!r}: use any of {SUITE_TASKS}, 'niah_multikey' (k = "
          f"{', '.join(map(str, niah.MULTIKEY_K))}) or 'niah_multikey_k<N>' (N >= 1)"
        )
      if label in out:
        raise ValueError(f"task {label!r} is given twice")
      out.append(label)
  if not out:
    raise ValueError(f"no task given: use any of {SUITE_TASKS}")
  return out


def parse_policy(spec: str) -> dict[str, Any]:
  """A policy spec "NAME[:BUDGET][:KEY=VALUE...]" -> `as_policy` keywords: "fpa_global:0.25" ->
  {"policy": "fpa_global", "budget": 0.25}; "fpa:tolerance=0.001"; "snapkv:128:recent=8" (a float
  budget is a fraction of the length, an int a key count; values: int, then float, else str)."""
  name, *parts = str(spec).split(":")
  kw: dict[str, Any] = {"policy": name}
  for i, part in enumerate(parts):
    key, sep, raw = part.partition("=")
    if not sep and i == 0:
      key, raw = "budget", part
    elif not sep or not key.isidentifier():
      raise ValueError(f"policy spec {spec!r}: give NAME[:BUDGET][:KEY=VALUE...], e.g. 'fpa_global:0.25'")
    try:
      kw[key] = parse_budget(raw)
    except ValueError:
      kw[key] = raw
  return kw


def suite_policies(policies: Iterable[str | tuple[str, dict[str, Any]]]) -> dict[str, CachePolicy | PolicyRule]:
  """label -> checked policy (lengths aside: `check_policy` at each cell's). An entry is a spec (its
  label) or a (label, keywords) pair: `as_policy` keywords, with "policy" defaulting to the label's
  spec (("window", {"budget": 0.125}) and ("w", {"policy": "window", "budget": 0.125}) alike)."""
  out: dict[str, CachePolicy | PolicyRule] = {}
  for p in [policies] if isinstance(policies, str) else policies:
    label, kw = (p, {}) if isinstance(p, str) else p
    label = str(label)
    kw = dict(kw)
    if "policy" not in kw:
      kw = {**parse_policy(label), **kw}
    if label in out:
      raise ValueError(f"policy label {label!r} is given twice: give each (label, keywords) its own label")
    try:
      out[label] = as_policy(**kw)
    except TypeError as e:  # an unknown keyword
      raise ValueError(f"policy {label!r}: {e}") from None
  if not out:
    raise ValueError("no policy given: e.g. policies=['full', 'fpa_global:0.25']")
  return out


def suite_cells(tasks: Sequence[str], multiples: Sequence[int], policies: Sequence[str]) -> list[tuple[str, int, str]]:
  """Every (task label, multiple, policy label), the policy innermost (a cell's examples serve every
  policy), the multiples in the order given."""
  return [(t, int(m), p) for t in tasks for m in multiples for p in policies]


def cell_key(task: str, multiple: int, policy: str) -> str:
  """The results file's key of a cell: "niah_single/8x/fpa_global:0.25"."""
  return f"{task}/{int(multiple)}x/{policy}"


def params_digest(model) -> str:
  """sha256 (hex, 16 chars) of a model's parameters, path by path (the digest `experiments` records):
  which model a results file scored."""
  h = hashlib.sha256()
  leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
  for path, x in sorted((jax.tree_util.keystr(p), x) for p, x in leaves):
    a = np.asarray(x)
    h.update(path.encode() + str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
  return h.hexdigest()[:16]


def suite_examples(
  label: str, length: int, n: int, seed: int = 0, vocab: niah.Vocab = "train"
) -> list[RetrievalExample]:
  """`n` examples of a task label at `length` tokens (depths drawn), the same for the same arguments;
  a task without a held-out vocabulary (passkey) keeps its own. ValueError saying which length to
  raise when the task does not fit."""
  task, kw = suite_task(label)
  spec = niah.TASKS[task]
  v = vocab if vocab in spec.vocabs else spec.vocabs[0]
  try:
    return niah.retrieval_eval_examples(task, length, None, n=n, seed=seed, vocab=v, **kw)
  except ValueError as e:
    if "too short" not in str(e):
      raise
    raise ValueError(
      f"{label} examples of {length} tokens cannot be built ({e}): raise train_len or the multiples"
    ) from None


# --- one cell ------------------------------------------------------------------------------------


def _check_bytes(model) -> None:
  if (v := vocab_size(model)) < ByteTokenizer.vocab_size:
    raise ValueError(
      f"the retrieval suite is byte-level ({ByteTokenizer.vocab_size} token ids); the model's vocabulary is {v}: "
      "evaluate a model trained with tokenizer 'bytes'"
    )


def _summary(right: list[np.ndarray]) -> dict[str, Any]:
  n, k = len(right), sum(bool(r.all()) for r in right)
  return {
    "n": n,
    "score": float(np.mean([r.mean() for r in right])),
    "exact": k / n,
    "correct": k,
    "ci95": list(wilson_interval(k, n)),
    "answers": int(sum(r.size for r in right)),
    "answers_correct": int(sum(r.sum() for r in right)),
  }


def retrieval_cell(
  model,
  examples: list[RetrievalExample],
  *,
  policy: str | CachePolicy | PolicyRule = "full",
  budget: float | int | None = None,
  tolerance: float | None = None,
  prefill: Prefill | None = None,
  length: int | None = None,
  batch_size: int = 8,
  **policy_kw,
) -> dict[str, Any]:
  """Exact match per answer of `examples` (`RetrievalExample`s, any tasks) under a cache policy
  (`policy` with budget, tolerance or any other `as_policy` keyword).

  prefill None: teacher-forced, one pass per batch of `batch_size` rows right-padded to `length`
  (default: the longest example; one compile per length), the parallel model for `full`, every
  token through the cache otherwise; "parallel" / "decode": each answer text generated after its
  prompt (`generate`) and parsed (`niah.answer_correct`).
  -> {"n", "score" (mean over examples of the share of their answers right), "exact" (share of
  examples with every answer right), "correct" (their count), "ci95" (Wilson 95% on exact),
  "answers", "answers_correct", "scores" ([n] per example), "scoring", "by_task" (the same per task,
  when the examples mix tasks), and for a cache path its stats: "cache_fraction", "kept_fraction_mean",
  "lost_mass_max" (teacher-forced), "overflow", ...}. Inputs are checked before anything is traced.
  """
  if not examples:
    raise ValueError("examples is empty: no retrieval example to score")
  if not all(isinstance(ex, RetrievalExample) for ex in examples):
    raise ValueError("examples must be fpa_jax.data.niah.RetrievalExample (retrieval_eval_examples, suite_examples)")
  if prefill not in (None, "parallel", "decode"):
    raise ValueError(f"prefill must be None (teacher-forced), 'parallel' or 'decode', got {prefill!r}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  pol = as_policy(policy, budget=budget, tolerance=tolerance, **policy_kw)
  _check_bytes(model)
  seqs = [np.asarray(ex.tokens[:-1], np.int32) for ex in examples]  # EOS is never an input
  longest = max(map(len, seqs))
  if length is not None and longest > length:
    raise ValueError(f"an example of {longest + 1} tokens (EOS included) does not fit length={length}: raise length")
  if prefill is None:
    check_policy(pol, length or longest)
    predict, cache_stats = teacher_forced_predictor(model, pol)
    am = teacher_forced_argmax(predict, seqs, length, batch_size)
    right = [niah.teacher_forced_correct(a, ex) for ex, a in zip(examples, am)]
    stats, scoring = cache_stats(), "teacher_forced"
  else:
    pol.kind.check_prefill(prefill)  # h2o: decode only; snapkv: parallel only
    if bad := sorted({ex.task for ex in examples if ex.answer_start < 0}):
      raise ValueError(f"{bad} answers are interleaved with the prompt: score them teacher-forced (prefill=None)")
    check_policy(pol, longest)
    dicts = [ex.as_passkey_dict() for ex in examples]
    _, preds, stats = generated_exact_match(model, dicts, batch_size=batch_size, prefill=prefill, policy=pol)
    tok = ByteTokenizer()
    cut = lambda p: p[: int(np.argmax(p == EOS_ID))] if (p == EOS_ID).any() else p  # noqa: E731
    right = [niah.answer_correct(tok.decode(cut(np.asarray(p))), ex) for ex, p in zip(examples, preds)]
    scoring = f"generate (prefill {prefill})"
  out = {**_summary(right), "scores": [float(r.mean()) for r in right], "scoring": scoring, **stats}
  tasks = list(dict.fromkeys(ex.task for ex in examples))
  if len(tasks) > 1:
    out["by_task"] = {t: _summary([r for r, ex in zip(right, examples) if ex.task == t]) for t in tasks}
  return out


# --- the suite -----------------------------------------------------------------------------------


def _count(what: str, v, lo: int = 1) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
    raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
  return int(v)


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def write_json(res: dict, path: str | os.PathLike) -> Path:
  """Write `res` to `path` atomically (a .tmp beside it, then os.replace: a killed run leaves the last
  whole file)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(res, indent=1, default=_jsonable) + "\n")
  os.replace(tmp, path)
  return path


def run_suite(
  model,
  *,
  train_len: int,
  tasks: Iterable[str] = SUITE_TASKS,
  multiples: Iterable[int] = SUITE_MULTIPLES,
  policies: Iterable[str | tuple[str, dict[str, Any]]] = ("full",),
  n: int = 50,
  out_path: str | os.PathLike,
  seed: int = 0,
  vocab: niah.Vocab = "train",
  prefill: Prefill | None = None,
  batch_size: int | None = None,
  eval_tokens: int = 16384,
  max_len: int | None = None,
  show_progress: bool = True,
  write_plot: bool = True,
  meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Score every (task, multiple x `train_len`, policy) cell the results file `out_path` (JSON) lacks,
  writing it after each cell, then its tables beside it (`.md`, `suite_table`) and, with
  `write_plot`, the removal plot (`.png`, `removal_plot`).

  A file written for another model (parameter digest) or another setup (train_len, n, seed, vocab,
  scoring) starts afresh (said on stderr); a cell whose policy label now names other arguments is
  scored again. `n` examples per cell (`suite_examples`, seed `seed`); `batch_size` rows per pass
  (default: up to `eval_tokens` tokens, `eval_batch`); `max_len`: the longest row the model may take
  (None: no limit). Every argument, policy and task is checked at every length before anything runs.
  -> the results: {"params", "train_len", "n", "seed", "vocab", "scoring", "policies" (label ->
  record), "cells" (`cell_key` -> {"task", "multiple", "length", "policy", "cache", **retrieval_cell})}.
  """
  train_len, n, seed = _count("train_len", train_len), _count("n (examples per cell)", n), _count("seed", seed, 0)
  multiples = [multiples] if isinstance(multiples, int) else list(multiples)
  if not multiples:
    raise ValueError("multiples is empty: give the lengths as multiples of train_len, e.g. (1, 2, 4, 8)")
  multiples = [_count("each multiple (of train_len)", m) for m in multiples]
  if len(set(multiples)) < len(multiples):
    raise ValueError(f"multiples repeat: {multiples}")
  niah._check_choice("vocab", vocab, niah.VOCABS)
  if prefill not in (None, "parallel", "decode"):
    raise ValueError(f"prefill must be None (teacher-forced), 'parallel' or 'decode', got {prefill!r}")
  if batch_size is not None:
    _count("batch_size", batch_size)
  labels, pols = expand_tasks(tasks), suite_policies(policies)
  _check_bytes(model)
  longest = max(multiples) * train_len
  if max_len is not None and longest > max_len:
    raise ValueError(
      f"the longest cell is {max(multiples)} x {train_len} = {longest} tokens, more than the model takes "
      f"(max_len={max_len}): drop the multiples above {max_len // train_len}"
    )
  if prefill is not None and "bindings" in labels:
    raise ValueError("bindings is scored teacher-forced only (its answers are interleaved): drop it or prefill")
  for label, pol in pols.items():
    if prefill is not None:
      pol.kind.check_prefill(prefill)
    for m in multiples:  # a budget may be fine at the longest length and not at the shortest
      try:
        check_policy(pol, m * train_len)
      except ValueError as e:
        raise ValueError(f"policy {label!r} at {m}x ({m * train_len} tokens): {e}") from None
  for label in labels:  # the shortest length fails first; one example is cheap
    suite_examples(label, min(multiples) * train_len, 1, seed, vocab)

  setup = {
    "format": FORMAT,
    "params": params_digest(model),
    "train_len": train_len,
    "n": n,
    "seed": seed,
    "vocab": vocab,
    "scoring": "teacher_forced" if prefill is None else f"generate (prefill {prefill})",
  }
  out_path = Path(out_path)
  res = json.loads(out_path.read_text()) if out_path.exists() else {}
  if res and (diff := {k: (res.get(k), v) for k, v in setup.items() if res.get(k) != v}):
    told = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items())
    print(
      f"[fpa_jax.eval.retrieval] {out_path} was written for another setup ({told}): starting afresh", file=sys.stderr
    )
    res = {}
  res = {**setup, "policies": res.get("policies", {}), "cells": res.get("cells", {}), "meta": res.get("meta", {})}
  records = {label: pol.record() for label, pol in pols.items()}
  res["policies"].update(records)
  res["meta"].update(meta or {})
  todo = [
    c
    for c in suite_cells(labels, multiples, list(pols))
    if res["cells"].get(cell_key(*c), {}).get("cache") != records[c[2]]
  ]
  cached: dict[tuple[str, int], list[RetrievalExample]] = {}
  for label, m, plabel in progress(todo, enabled=show_progress, desc="retrieval", leave=False):
    length = m * train_len
    if (label, m) not in cached:  # the policy is innermost: one (task, length) at a time
      cached = {(label, m): suite_examples(label, length, n, seed, vocab)}
    cell = retrieval_cell(
      model,
      cached[label, m],
      policy=pols[plabel],
      prefill=prefill,
      length=length if prefill is None else None,
      batch_size=batch_size or eval_batch(length, n, eval_tokens),
    )
    res["cells"][cell_key(label, m, plabel)] = {
      "task": label,
      "multiple": m,
      "length": length,
      "policy": plabel,
      "cache": records[plabel],
      **cell,
    }
    write_json(res, out_path)
  write_json(res, out_path)  # the policies' records and meta, when no cell was missing
  out_path.with_suffix(".md").write_text(suite_table(res))
  if write_plot:
    removal_plot(res, out_path.with_suffix(".png"))
  return res


# --- what a person reads -------------------------------------------------------------------------


def _order(res: dict) -> tuple[list[str], list[int], list[str]]:
  """The tasks (SUITE_TASKS order first), multiples (ascending) and policies (as recorded) of the cells."""
  cells = res["cells"].values()
  rank = {t: i for i, t in enumerate(SUITE_TASKS)}
  tasks = sorted(dict.fromkeys(c["task"] for c in cells), key=lambda t: (rank.get(t, len(rank)), t))
  multiples = sorted({int(c["multiple"]) for c in cells})
  seen = {c["policy"] for c in cells}
  policies = [p for p in res.get("policies", {}) if p in seen] + sorted(seen - set(res.get("policies", {})))
  return tasks, multiples, policies


def suite_table(res: dict) -> str:
  """Markdown: one table per policy, rows the task labels (multikey one row per k) and their mean,
  columns the multiples; each cell the mean score ("—": not scored), and for an evicting policy a row
  of `kept_fraction_mean` (kept / seen keys, averaged over every decode step: early steps keep all,
  so it sits above the budget)."""
  tasks, multiples, policies = _order(res)
  L, cells = res["train_len"], res["cells"]
  head = (
    f"Retrieval suite (`fpa_jax.eval.retrieval`): exact match per answer, averaged ({res['scoring']}); "
    f"{res['n']} examples per cell, seed {res['seed']}, vocab {res['vocab']}, params {res['params']}.\n"
  )
  parts = [head]
  for p in policies:
    cols = ["task", *[f"{m}x ({m * L})" for m in multiples]]
    get = lambda t, m: cells.get(cell_key(t, m, p))  # noqa: E731
    rows = [[t, *[None if (c := get(t, m)) is None else c["score"] for m in multiples]] for t in tasks]
    mean = [
      None if any(get(t, m) is None for t in tasks) else float(np.mean([get(t, m)["score"] for t in tasks]))
      for m in multiples
    ]
    rows.append(["mean", *mean])
    kept = [
      [c["kept_fraction_mean"] for t in tasks if (c := get(t, m)) and "kept_fraction_mean" in c] for m in multiples
    ]
    if any(kept):
      rows.append(["kept / seen (mean over steps)", *[float(np.mean(k)) if k else None for k in kept]])
    parts.append(f"\n### `{p}`\n\n" + md_table(cols, rows))
  return "".join(parts)


def removed_fraction(cell: dict) -> float:
  """The fraction of keys a cell's policy removed: 1 - budget (a fraction; a key count over the cell's
  length; kvpress's compression_ratio as it is), 0 for full, else (fpa's tolerance, a threshold) 1 - the measured `kept_fraction_mean`."""
  rec = cell["cache"]
  if rec["policy"] == "full":
    return 0.0
  if rec.get("compression_ratio") is not None:
    return float(rec["compression_ratio"])
  b = rec.get("budget")
  if isinstance(b, float):
    return 1.0 - b
  if isinstance(b, int):
    return max(0.0, 1.0 - b / cell["length"])
  return 1.0 - float(cell.get("kept_fraction_mean", 1.0))


def removal_plot(res: dict, path: str | os.PathLike, multiple: int | None = None) -> Path:
  """kvpress's figure: score against the fraction of keys removed, one panel per policy name (its
  budgets along x), one line per task and their mean (black), at `multiple` (default the longest);
  the full cache's score at 0 starts every line. Written with matplotlib (Agg) to `path`."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks, multiples, policies = _order(res)
  if not multiples:
    raise ValueError("the results hold no cell: nothing to plot")
  m = multiples[-1] if multiple is None else int(multiple)
  at = {(c["task"], c["policy"]): c for c in res["cells"].values() if int(c["multiple"]) == m}
  full = {
    t: at[t, p]["score"] for t in tasks for p in policies if (t, p) in at and at[t, p]["cache"]["policy"] == "full"
  }
  names = list(dict.fromkeys(res["policies"][p]["policy"] for p in policies if res["policies"][p]["policy"] != "full"))
  fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4.2 * max(1, len(names)), 3.6), sharey=True, squeeze=False)
  colors = plt.get_cmap("tab10")
  for ax, name in zip(axes[0], names or ["full"]):
    labels = [p for p in policies if res["policies"][p]["policy"] == name]
    lines = {}
    for i, t in enumerate(tasks):
      pts = [(0.0, full[t])] if t in full else []
      pts += sorted((removed_fraction(at[t, p]), at[t, p]["score"]) for p in labels if (t, p) in at and name != "full")
      if pts:
        lines[t] = pts
        ax.plot(*zip(*pts), marker="o", ms=3, lw=1, color=colors(i % 10), label=t)
    xs = sorted({x for pts in lines.values() for x, _ in pts})
    mean = [
      (x, np.mean(ys)) for x in xs if len(ys := [y for pts in lines.values() for x2, y in pts if x2 == x]) == len(lines)
    ]
    if mean:
      ax.plot(*zip(*mean), marker="o", ms=4, lw=2.2, color="black", label="mean")
    ax.set_title(f"{name} at {m}x ({m * res['train_len']} tokens)", fontsize=9)
    ax.set_xlabel("fraction of keys removed (1 - budget)")
    ax.set_xlim(-0.03, 1.0)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("score (exact match per answer)")
  axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
  fig.tight_layout()
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return path


# --- the command line ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
  from fpa_jax import cli as flags

  ap = argparse.ArgumentParser(
    prog="python -m fpa_jax.eval retrieval",
    description="The retrieval suite (RULER's tasks, byte level) at multiples of the training length under "
    "KV-cache policies: a resumable results JSON, its tables (.md) and score against the fraction removed (.png).",
  )
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a training workdir (python -m fpa_jax.train --workdir ...)")
  src.add_argument("--exported", help="an export_model folder (params.npz + config.json)")
  ap.add_argument("--step", type=int, help="--workdir: checkpoint step (default: the latest)")
  ap.add_argument("--train-len", type=int, help="the length cells are multiples of (default: the run's seq_len)")
  ap.add_argument(
    "--tasks", nargs="+", default=list(SUITE_TASKS), help=f"task labels (default: {' '.join(SUITE_TASKS)})"
  )
  ap.add_argument("--multiples", type=int, nargs="+", default=list(SUITE_MULTIPLES))
  ap.add_argument(
    "--policies",
    nargs="+",
    default=["full"],
    help="NAME[:BUDGET][:KEY=VALUE...], e.g. full fpa_global:0.25 window:0.125",
  )
  ap.add_argument("--n", type=int, default=50, help="examples per cell")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--vocab", choices=niah.VOCABS, default="train", help="heldout: disjoint keys and filler")
  ap.add_argument("--prefill", choices=("parallel", "decode"), help="generate the answers (default: teacher-forced)")
  ap.add_argument("--batch-size", type=int, help="rows per pass (default: up to --eval-tokens tokens)")
  ap.add_argument("--eval-tokens", type=int, default=16384)
  ap.add_argument("--out", help="results JSON (default: WORKDIR/eval/retrieval.json; required with --exported)")
  ap.add_argument("--no-plot", action="store_true")
  ap.add_argument("--no-progress", action="store_true")
  return flags.parse(ap, argv)


def run(a: argparse.Namespace, argv=None) -> tuple[dict, Path]:
  """Score the suite as the parsed arguments say; -> (results, results path). ValueError /
  FileNotFoundError on bad arguments, before the model runs."""
  from fpa_jax.inference import load_exported, load_model

  if a.exported and a.step is not None:
    raise ValueError("--step applies to --workdir only")
  if a.exported and not a.out:
    raise ValueError("give --out with --exported (an export folder is not a place for results)")
  for flag in ("train_len", "n", "batch_size", "eval_tokens"):
    if (v := getattr(a, flag)) is not None and v < 1:
      raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
  t0 = time.perf_counter()
  model, cfg = load_model(a.workdir, step=a.step) if a.workdir else load_exported(a.exported)[:2]
  if cfg.tokenizer != "bytes":
    raise ValueError(f"the retrieval suite is byte-level; this model's tokenizer is {cfg.tokenizer!r}")
  out = Path(a.out) if a.out else Path(a.workdir) / "eval" / "retrieval.json"
  cmd = " ".join(["python -m fpa_jax.eval retrieval", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
  res = run_suite(
    model,
    train_len=a.train_len or cfg.seq_len,
    tasks=a.tasks,
    multiples=a.multiples,
    policies=a.policies,
    n=a.n,
    out_path=out,
    seed=a.seed,
    vocab=a.vocab,
    prefill=a.prefill,
    batch_size=a.batch_size,
    eval_tokens=a.eval_tokens,
    show_progress=not a.no_progress,
    write_plot=not a.no_plot,
    meta={
      "command": cmd,
      "model": str(a.workdir or a.exported),
      "step": a.step,
      "backend": jax.default_backend(),
    },
  )
  res["meta"].update(
    finished=datetime.datetime.now().isoformat(timespec="seconds"), wall_s=round(time.perf_counter() - t0, 1)
  )
  write_json(res, out)
  return res, out


def main(argv=None) -> int:
  a = parse_args(argv)
  try:
    res, out = run(a, argv)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(suite_table(res))
  print(f"wrote {out}, {out.with_suffix('.md')}" + ("" if a.no_plot else f" and {out.with_suffix('.png')}"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
