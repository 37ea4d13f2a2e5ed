"""What a person reads: a progress bar, markdown tables of the results, and the results files."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable


LN2 = math.log(2.0)


def progress(it: Iterable, *, enabled: bool = True, **kw):
  """tqdm bar on stderr (off a terminal, as in nohup logs, it updates at most every 30 s)."""
  if not enabled:
    return it
  from tqdm import tqdm

  if not sys.stderr.isatty():
    kw.setdefault("mininterval", 30.0)
  return tqdm(it, dynamic_ncols=True, **kw)


def policy_label(rec: dict[str, Any]) -> str:
  """'full', 'fpa_budget 0.25', 'fpa tolerance=0.001', 'snapkv 0.25 recent=8' (tables)."""
  parts = [rec["policy"]] + ([f"{rec['budget']:g}"] if rec.get("budget") is not None else [])
  fmt = lambda v: f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)  # noqa: E731
  known = ("policy", "budget", "cache_fraction", "kept_fraction_mean", "lost_mass_max", "overflow", "batches")
  parts += [f"{k}={fmt(v)}" for k, v in rec.items() if k not in known and v is not None]
  return " ".join(parts)


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
    table = md_table(["depth", *[f"{m}x ({m * L})" for m in ms]], rows)
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
  return text + md_table(cols, rows)


def md_table(headers: list[str], rows: Iterable[Iterable[Any]], align: str | None = None) -> str:
  """A GitHub markdown table; `align` one char per column ('l' or 'r', default: the first l, the rest
  r). Cells: None -> '—', a float to 3 decimals (3 significant digits from 1000), else str."""
  align = align or "l" + "r" * (len(headers) - 1)
  sep = ["---" if a == "l" else "---:" for a in align]
  lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
  lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
  return "\n".join(lines) + "\n"


def _cell(c: Any) -> str:
  if c is None:
    return "—"
  if isinstance(c, float):
    return f"{c:.3g}" if abs(c) >= 1e3 else f"{c:.3f}"
  return str(c)


_md_table = md_table  # the name of fpa_jax/eval.py


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
