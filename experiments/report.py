"""Regenerate the README's and docs' results from the files the studies wrote: no hand-typed numbers.

    python -m experiments.report

1. Writes results/claims.md, the README's claims table: one line per claim, its verdict and a link
   to the evidence. From results/one_recipe/claims.json (`experiments.one_recipe`: every claim on
   the same checkpoints) when it exists and has judged a claim, else from the separate studies' results
   (results/{scopes,dips,passkey*,kv_compression*,perplexity*,bindings_lm,text_pareto,forget_speed}.json).
   A verdict holds only when it holds on every seed (paired with FoX of the same seed where the
   claim compares with FoX), else it says on how many: "k of n seeds", or "not met".
2. Writes results/claims_studies.md (the separate studies' table, for docs/results.md) and
   results/claims_detail.md (everything each study measured for each claim) and the tables collected across runs (dips_limits, passkey_pace, kv_lengths).
3. Copies tables into README.md and every docs/**/*.md, which mark each one as

    <!-- results/NAME.md -->
    ...replaced...
    <!-- end results/NAME.md -->

   replacing what lies between with the current contents of results/NAME.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from experiments._common import seed_verdict

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- (results/[\w./-]+\.md) -->\n)(.*?)(<!-- end \2 -->)", re.S)
FAMILIES = ("fpa", "stack", "fox", "softmax")


def render(readme: str, root: Path = ROOT) -> str:
  def fill(m):
    src = root / m.group(2)
    body = src.read_text() if src.exists() else f"(not yet generated: run the script that writes {m.group(2)})\n"
    return m.group(1) + body + m.group(4)

  return BLOCK.sub(fill, readme)


def _load(root: Path, name: str):
  p = root / "results" / f"{name}.json"
  return json.loads(p.read_text()) if p.exists() else None


def _methods(doc: dict) -> list[str]:
  return [k for k, v in doc.items() if isinstance(v, dict) and k not in ("meta", "cells")]


def _live_sets(doc, task: str) -> str:
  if doc is None:
    return f"not run yet (`python -m experiments.live_sets --task {task}`)"
  parts = [f"{m} {doc[m]['successes']}/{doc[m]['seeds']}" for m in _methods(doc) if "successes" in doc[m]]
  return "seeds succeeding (mass and coverage >= 0.95 at 1x and 2x): " + ", ".join(parts)


STALE_TEXT = " *(models trained before the text-pipeline fix: their fpa_text rows came one file at a time)*"


def _passkey(doc) -> str:
  if doc is None:
    return "not run yet (`python -m experiments.passkey`)"
  ms = [m for m in _methods(doc) if doc[m].get("8") is not None]
  mark = lambda m: "" if doc[m].get("text_rows") == "windows" else "*"  # noqa: E731
  ok = [
    f"{m}{mark(m)} {doc[m]['8']:.2f} (1x {doc[m]['1']:.2f}, {doc[m]['steps']} steps)"
    for m in ms
    if doc[m].get("competent_1x")
  ]
  no = [m + mark(m) for m in ms if not doc[m].get("competent_1x")]
  return (
    f"exact match at 8x L={doc['train_length']} of the models competent at 1x: "
    + ", ".join(ok)
    + (f"; not competent at 1x within their step budget (no retrieval to extrapolate): {', '.join(no)}" if no else "")
    + (f"; \\* {STALE_TEXT.strip(' *()')}" if any(mark(m) for m in ms) else "")
  )


SHARED_INIT = ", FPA's other weights drawn as FoX's (the read-outs' side stream)"


def _passkey_seed(doc, label: str = "") -> str:
  """Another seed's steps to competence (does the LM gate learn retrieval as fast as FoX?);
  `label` says what differs from the main study's runs besides the seed."""
  if doc is None or not _methods(doc):
    return ""
  seed = doc["meta"].get("seeds", ["?"])[0]
  parts = []
  for m in (m for m in _methods(doc) if "steps" in doc[m]):
    e = doc[m]
    hist = e.get("val_history") or {}
    last = hist[max(hist, key=int)]["exact"] if hist else None
    parts.append(
      f"{m} competent at {e['steps']} steps"
      if e.get("competent_1x")
      else f"{m} not competent in {e['steps']}" + ("" if last is None else f" ({last:.2f})")
    )
  return f". Seed {seed}{label} (competent: validation exact match >= 0.99): " + ", ".join(parts)


PACE_FOX = "fox_b5"  # FoX has no read-outs: its runs are the same model before and after the side stream


def _passkey_pace_docs(root: Path) -> list[tuple[int, bool, dict]]:
  """(seed, shared init, passkey.json) of every passkey run of the study's recipe: results/passkey
  and passkey_seed1 (FPA rows there predate the read-outs' side stream), passkey_shared_init*."""
  out = []
  for d in sorted((root / "results").glob("passkey*/passkey.json")) + [root / "results" / "passkey.json"]:
    doc = json.loads(d.read_text()) if d.exists() else None
    if doc and doc.get("recipe", {}).get("tag", "").startswith("L512_l2d128_b8p6_w100_pw1_lr0.002_m1_s"):
      out.append((int(doc["recipe"]["seed"]), "shared_init" in str(d.parent), doc))
  return out


def passkey_pace(root: Path = ROOT) -> dict | None:
  """Steps to passkey competence by seed (does the LM default learn retrieval as fast as FoX?): FoX
  from any of the study's runs, FPA methods from the shared-init runs only (their other weights are
  FoX's of the same seed). {method: {seed: (first competent stage step or None,
  [(step, validation exact match)])}}."""
  runs: dict[str, dict[int, tuple]] = {}
  for seed, shared, doc in _passkey_pace_docs(root):
    thr = doc["recipe"]["competence"]
    for m in _methods(doc):
      if m != PACE_FOX and not (shared and m.startswith("fpa_lm5")):
        continue
      if "val_history" in doc[m]:
        hist = sorted((int(k), v["exact"]) for k, v in doc[m]["val_history"].items())
        runs.setdefault(m, {})[seed] = (next((s for s, x in hist if x >= thr), None), hist)
  return runs if PACE_FOX in runs and len(runs) > 1 else None


def passkey_pace_table(root: Path = ROOT) -> str | None:
  """results/passkey_pace.md: the steps each method took to passkey competence, per seed, beside
  FoX's on the same seed (the curves: `pace_plot`)."""
  from experiments._common import md_table

  runs = passkey_pace(root)
  if runs is None:
    return None
  seeds = sorted({s for r in runs.values() for s in r})
  fox = runs[PACE_FOX]

  def cell(r):
    if r is None:
      return "—"
    best = max(r[1], key=lambda h: h[1])
    return f"{r[0]}" if r[0] is not None else f"not in {r[1][-1][0]} (best {best[1]:.3f} at {best[0]})"

  horizon, means = pace_means(runs)
  rows = []
  for m in [PACE_FOX] + sorted(m for m in runs if m != PACE_FOX):
    paired = [s for s in runs[m] if s in fox]
    if m == PACE_FOX:
      verdict, mean_x = "—", f"{means[m][0]:.3f}"
    else:  # a seed counts when FPA is competent no later than FoX on it (FoX not competent: FPA competent)
      ok = [s for s in paired if runs[m][s][0] is not None and (fox[s][0] is None or runs[m][s][0] <= fox[s][0])]
      verdict = f"{len(ok)}/{len(paired)}"
      mean_x = f"{means[m][0]:.3f} ({means[m][1]:+.3f})"
    rows.append([f"`{m}`"] + [cell(runs[m].get(s)) for s in seeds] + [verdict, mean_x])
  head = (
    "Passkey (`python -m experiments.passkey`, L=512): the first stage (every 300 steps) whose 1x validation "
    "exact match (40 prompts) reaches the study's competence (0.99), per seed; not in N (best x at s): never "
    "within the N steps trained (its best validation x at step s). FPA rows come from the shared-init runs "
    "(`results/passkey_shared_init*`, FPA's other weights are FoX's of the same seed); fox_b5 from every run "
    "of the recipe. \"<= FoX's steps\" counts the seeds where the method was competent no later than FoX. "
    f"The last column is a measure less noisy than one crossing: the 1x validation exact match averaged over "
    f"the stages up to step {horizon} (a run that stopped at competence keeps its last value), mean over the "
    "method's seeds, and in brackets its mean difference from FoX's on the same seeds. "
    "Validation curves: `results/passkey_pace.png`.\n\n"
  )
  heads = ["method"] + [f"seed {s}" for s in seeds] + ["<= FoX's steps", f"mean val. 1x to {horizon} (vs FoX)"]
  return head + md_table(heads, rows)


def pace_means(runs: dict) -> tuple[int, dict[str, tuple[float, float]]]:
  """(horizon, {method: (mean over its seeds of `pace_area`, mean paired difference from FoX's)}) of
  `passkey_pace`'s runs; the horizon is FoX's longest run, the stage its first validation step."""
  fox = runs[PACE_FOX]
  horizon = max(r[1][-1][0] for r in fox.values())
  stage = min(r[1][0][0] for r in fox.values())
  out = {}
  for m, r in runs.items():
    area = {s: pace_area(h, horizon, stage) for s, (_, h) in r.items()}
    paired = [area[s] - pace_area(fox[s][1], horizon, stage) for s in area if s in fox]
    out[m] = (float(np.mean(list(area.values()))), float(np.mean(paired)) if paired else float("nan"))
  return horizon, out


def pace_area(hist: list[tuple[int, float]], horizon: int, stage: int) -> float:
  """Mean validation exact match over the stages stage, 2 stage, ..., horizon of one run's [(step, x)];
  a stage past the run's last keeps its last value (a run stops at competence), one before its first is 0."""
  d, last, xs = dict(hist), 0.0, []
  for s in range(stage, horizon + 1, stage):
    last = d.get(s, last)
    xs.append(last)
  return float(np.mean(xs))


def _pace_claim(root: Path) -> str:
  """The claim's part from `passkey_pace`: steps to 1x competence by seed, FoX beside each FPA recipe."""
  runs = passkey_pace(root)
  if runs is None:
    return ""
  seeds = sorted({s for r in runs.values() for s in r})
  step = lambda m, s: "—" if s not in runs[m] else str(runs[m][s][0] or "no")  # noqa: E731
  horizon, means = pace_means(runs)
  parts = []
  for m in [PACE_FOX] + sorted(set(runs) - {PACE_FOX}):
    gap = "" if m == PACE_FOX else f", {means[m][1]:+.3f} vs FoX"
    parts.append(f"{m} {'/'.join(step(m, s) for s in seeds)} ({means[m][0]:.3f}{gap})")
  return (
    f". Steps to 1x competence by seed {'/'.join(map(str, seeds))}{SHARED_INIT} (no: not within the steps trained; "
    f"in brackets the 1x validation exact match averaged over the stages to step {horizon} and seeds, and its "
    f"paired difference from FoX's; `results/passkey_pace.md`): " + ", ".join(parts)
  )


def pace_plot(path: Path, root: Path = ROOT) -> None:
  """results/passkey_pace.png: 1x validation exact match by stage, one panel per seed."""
  runs = passkey_pace(root)
  if runs is None:
    return
  seeds = sorted({s for r in runs.values() for s in r})
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(seeds), figsize=(3.2 * len(seeds) + 1.6, 2.8), sharey=True, squeeze=False)
  methods = [PACE_FOX] + sorted(m for m in runs if m != PACE_FOX)
  colors = {m: "k" if m == PACE_FOX else plt.cm.tab10(i % 10) for i, m in enumerate(methods)}  # one per method
  for ax, s in zip(axes[0], seeds):
    for m in (m for m in methods if s in runs[m]):
      hist = runs[m][s][1]
      lw = 2.2 if m == PACE_FOX else 1.2
      ax.plot([h[0] for h in hist], [h[1] for h in hist], marker=".", color=colors[m], lw=lw, label=m)
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.set_title(f"seed {s}", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
  axes[0][0].set_ylabel("1x validation exact match", fontsize=8)
  handles = [plt.Line2D([], [], color=colors[m], lw=2.2 if m == PACE_FOX else 1.2, marker=".") for m in methods]
  fig.legend(handles, methods, fontsize=7, loc="center right")
  fig.tight_layout(rect=(0, 0, 1 - 1.6 / (3.2 * len(seeds) + 1.6), 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _kv(doc, decode=None, more=None, decode_more=None) -> str:
  if doc is None:
    return "not run yet (`python -m experiments.kv_compression`)"
  text = _kv_cells(doc) + _kv_stale(doc)
  if more is not None and more.get("cells"):
    text += (
      f"; with {more['n_prompts']} prompts per cell (95% intervals): " + _kv_cells(more, ci=True) + _kv_stale(more)
    )
  if decode is not None and decode.get("cells"):
    text += f"; with every prompt token decoded under the policy ({decode['n_prompts']} prompts per cell): "
    text += _kv_cells(decode) + _kv_stale(decode)
  if decode_more is not None and decode_more.get("cells"):
    text += f"; decoded so, with {decode_more['n_prompts']} prompts per cell (95% intervals): "
    text += _kv_cells(decode_more, ci=True) + _kv_stale(decode_more)
  return text


def _kv_stale(doc) -> str:
  """The pre-fix label for a KV study whose models' text rows predate the text-pipeline fix
  (rows drawn one file at a time): its `model_steps`
  entries are (steps, text_rows, commit) since the fix, a bare step count before it."""
  steps = doc.get("model_steps", {}).values()
  return "" if steps and all(isinstance(s, list) and "windows" in s for s in steps) else STALE_TEXT


KV_POLICIES = ("fpa_budget", "fpa_global", "window", "sink_window", "h2o", "snapkv")
KV_BUDGETS = ("0.25", "0.125")


def _kv_cells(doc, policies=KV_POLICIES, ci=False) -> str:
  """Per model: the tolerance policy, then each budgeted policy at 25% / 12.5% of the cache."""
  fmt = lambda c: (
    f"{c['accuracy']:.2f}"
    + (  # noqa: E731
      f" [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if ci and c.get("ci95") else ""
    )
  )
  models = {}
  for key, cell in sorted(doc["cells"].items()):
    model, policy = key.split("/")
    out = models.setdefault(model, [])
    if policy == "fpa" and "tol" in cell:
      out.insert(
        0, f"fpa ε={doc['tolerance']:g} {fmt(cell['tol'])} at {cell['tol']['cache_fraction']:.2f} of the cache"
      )
    if policy in policies and any(b in cell for b in KV_BUDGETS):
      out.append(f"{policy} " + " / ".join(fmt(cell[b]) if b in cell else "—" for b in KV_BUDGETS))
  parts = [f"**{m}**: " + ", ".join(cells) for m, cells in models.items() if cells]
  return f"exact match at {doc['multiple']}x (prefill {doc['prefill']}; budgets 25% / 12.5%): " + "; ".join(parts)


def _ppl(doc, long=None, old=(None, None)) -> str:
  """The perplexity claim; `old` = the (short, long) runs trained on correlated batches (each batch
  from one file, before the text-pipeline fix), kept beside the current runs and labelled."""
  text = "not run yet on the fixed pipeline (`python -m experiments.perplexity`)" if doc is None else _ppl_one(doc)
  if long is not None:
    text += "; trained longer: " + _ppl_one(long)
  stale = [_ppl_one(d) for d in old if d is not None]
  if stale:
    text += "; *trained on correlated batches (before the text-pipeline fix)*: " + "; ".join(stale)
  return text


def _ppl_one(doc) -> str:
  bpb = {m: float(np.mean(doc[m]["bpb"])) for m in _methods(doc) if "bpb" in doc[m]}
  n = {m: len(doc[m]["bpb"]) for m in bpb}
  parts = [f"{m} {v:.3f} ({n[m]} seed{'s' * (n[m] != 1)})" for m, v in bpb.items()]
  ratios = [f"{m} / fox = {bpb[m] / bpb['fox']:.3f}" for m in bpb if m.startswith("fpa") and "fox" in bpb]
  return (
    f"held-out bits per byte after {doc['recipe']['steps']} steps: "
    + ", ".join(parts)
    + (f" ({', '.join(ratios)})" if ratios else "")
  )


def _bindings(doc) -> str:
  if doc is None:
    return "not run yet (`python -m experiments.bindings_lm`)"
  from experiments.bindings_lm import claims

  seeds = {m: len(doc[m]["evals"]) for m in _methods(doc) if "evals" in doc[m]}
  return (
    "query accuracy on nested bindings (seeds: "
    + ", ".join(f"{m} {n}" for m, n in seeds.items())
    + "): "
    + " ".join(claims(doc["summary"]))
  )


def _text_pareto(doc, ppl) -> str:
  from experiments.perplexity import _evict_cost

  cost = _evict_cost(ppl).strip() if ppl is not None else ""
  if doc is None:
    return (cost + " " if cost else "") + "Pareto curves not run yet (`python -m experiments.text_pareto`)"
  from experiments.text_pareto import claims

  return (cost + " " if cost else "") + (
    "Held-out bits per byte of those byte LMs under each cache (`text_pareto`): " + " ".join(claims(doc["summary"]))
  )


KV_LENGTHS = (1, 2, 4, 8)


def _kv_length_docs(root: Path) -> list[tuple[int, str, dict]]:
  """(multiple, prefill, doc) of the 100-prompt passkey cache studies: results/kv_compression_n100 (8x)
  and its _x<m> siblings, parallel and decode prefill."""
  out = []
  for m in KV_LENGTHS:
    tail = "" if m == 8 else f"_x{m}"
    for prefill, name in (("parallel", "kv_compression_n100"), ("decode", "kv_compression_decode_n100")):
      doc = _load(root, f"{name}{tail}/kv_compression")
      if doc is not None and doc.get("cells"):
        out.append((m, prefill, doc))
  return out


def kv_lengths_table(root: Path = ROOT) -> str | None:
  """Passkey exact match [95% interval] by length (columns) for every (model, policy, budget) of the
  100-prompt cache studies, both prefill modes (decode rows say so): results/kv_lengths.md."""
  from experiments._common import md_table

  docs = _kv_length_docs(root)
  if not docs:
    return None
  lengths = sorted({m for m, _, _ in docs})
  cells: dict[tuple, dict] = {}
  for m, prefill, doc in docs:
    for key, cell in doc["cells"].items():
      model, policy = key.split("/")
      for budget, c in cell.items():
        if policy == "full" or budget in KV_BUDGETS:
          name = policy if policy == "full" else f"{policy} {float(budget):.1%}".replace(".0%", "%")
          if prefill == "decode":
            name += " (decode)"
          cells.setdefault((model, name, policy, budget, prefill), {})[m] = c
  fmt = lambda c: f"{c['accuracy']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if c else "—"
  rank = {p: i for i, p in enumerate(("full",) + KV_POLICIES)}
  order = lambda k: (k[0], -float(k[3]), rank.get(k[2], len(rank)), k[4] == "decode")  # model, budget, policy
  rows = [[k[0], k[1]] + [fmt(cells[k].get(m)) for m in lengths] for k in sorted(cells, key=order)]
  cmds = sorted({f"`{d['meta']['command']}`" for _, _, d in docs})
  head = (
    "Passkey exact match by length (training length 512), 100 prompts per cell (depths 0-100%), with the "
    "cache cut to 25% / 12.5% of the sequence by each policy at equal cache bytes [95% Wilson interval]; "
    "parallel prefill unless marked decode (every prompt token decoded under the policy). Commands: "
    + ", ".join(cmds)
    + ".\n\n"
  )
  return head + md_table(["model", "cache"] + [f"{m}x" for m in lengths], rows)


def _kv_by_length(root: Path, model: str = "fpa_fox5_evict") -> str:
  """The claim's part from the shorter lengths: `model`'s learned rule (parallel prefill) at 25% / 12.5%."""
  parts = []
  for m, prefill, doc in _kv_length_docs(root):
    cell = doc["cells"].get(f"{model}/fpa_budget", {})
    if m != 8 and prefill == "parallel" and all(b in cell for b in KV_BUDGETS):
      parts.append(f"{m}x " + " / ".join(f"{cell[b]['accuracy']:.2f}" for b in KV_BUDGETS))
  if not parts:
    return ""
  return f"; shorter prompts (100 per cell, `results/kv_lengths.md`): {model} fpa_budget 25% / 12.5% at " + ", ".join(
    parts
  )


def _speed(doc) -> str:
  """The speed target (>= 2x attention on a model trained with the objective: forgetting made useful), per passkey model
  at the smallest tolerance: key skipping's attention and prefill speed-ups, tile skipping's on the
  forward and backward pass (training), and the answers with keys skipped."""
  if doc is None:
    return "not run yet (`python -m experiments.forget_speed`)"
  parts = []
  for m, r in doc["rows"].items():
    eps = min(r["tolerances"], key=float)
    c = r["tolerances"][eps]
    parts.append(
      f"**{m}** (ε={eps}): keys read {c['keys_read']:.2f}, attention {r['attention_s'] / c['attention_s_keys']:.2f}x, "
      f"prefill {r['prefill_s'] / c['prefill_s_keys']:.2f}x, exact match {c['exact_match_keys']:.2f}; "
      f"tile skipping forward + backward {r['attention_grad_s'] / c['attention_grad_s_tiles']:.2f}x"
    )
  return (
    f"skip='keys' at {doc['multiple']}x (L={doc['train_length']}), against the exact kernel on the same prompts: "
    + "; ".join(parts)
    + ". Tile skipping was what these runs trained with (key skipping has a backward pass since), so the speed-up is prefill's, not training's"
  )


def _dips_variant_runs(root: Path) -> list[tuple[str, dict]]:
  """(variant, its dips.json) of every run under results/dips_limits/ that holds an FPA head."""
  docs = [
    (d.name, _load(root, f"dips_limits/{d.name}/dips")) for d in sorted((root / "results" / "dips_limits").glob("*"))
  ]
  return [(name, doc) for name, doc in docs if doc is not None and "fpa" in doc]


def _head_dim_steps(doc: dict, method: str) -> tuple[int, int]:
  cfg = doc[method]["config"]
  return cfg["d_model"] // cfg["n_heads"], doc["meta"]["settings"]["steps"]


def _dips_variants(root: Path) -> str:
  """The `dips` variants run with every method (results/dips_limits/<variant>), as the claim's row."""
  out = []
  for name, doc in _dips_variant_runs(root):
    ms = [m for m in FAMILIES if m in doc]
    if len(ms) < 2:
      continue
    hd, steps = _head_dim_steps(doc, "fpa")
    out.append(
      f"with head dim {hd} and {steps} steps (`{name}`): "
      + ", ".join(f"{m} {doc[m]['successes']}/{doc[m]['seeds']}" for m in ms)
    )
  return "".join(f"; {o}" for o in out)


def dips_limits_table(root: Path = ROOT) -> str | None:
  """results/dips_limits.md: FPA's coverage on `dips` (what limits it: head dim, steps, ...) under each variant run into
  results/dips_limits/<variant>/dips.json (`python -m experiments.live_sets --task dips --methods fpa
  --seeds 5 ... --out-dir results/dips_limits/<variant>`), beside the study's default row."""
  default, variants = _load(root, "dips"), _dips_variant_runs(root)
  if default is None or "fpa" not in default or not variants:
    return None
  rows = []
  for name, doc in [("default (study 1)", default)] + variants:
    cmd = doc["meta"]["command"].replace("python -m experiments.live_sets ", "")
    # FPA first; the other methods of a variant run too (heads of the same dimension) follow it
    for m in ["fpa"] + [m for m in FAMILIES if m != "fpa" and m in doc and doc is not default]:
      e = doc[m]
      cov = lambda k: f"{np.mean(e[k]):.3f} ± {np.std(e[k]):.3f}"  # noqa: E731  (as live_sets reports it)
      hd, steps = _head_dim_steps(doc, m)
      rows.append(
        f"| {name} | {m} | `{cmd}` | {hd} | {steps} | {cov('coverage_1x')} | {cov('coverage_2x')} | "
        f"{e['successes_coverage']}/{e['seeds']} |"
      )
  head = (
    "FPA's coverage head on `dips` (1 - TV to uniform over the live set; a seed succeeds at >= 0.95 at both "
    "1x and 2x), single head, d_model = head dim:\n\n"
    "| variant | method | command | head dim | steps | coverage 1x | coverage 2x | seeds >= 0.95 |\n"
    "|---|---|---|---:|---:|---:|---:|---:|\n"
  )
  return head + "\n".join(rows) + "\n"


def claims_detail(root: Path = ROOT) -> str:
  """results/claims_detail.md: each claim beside everything the studies measured for it (long cells;
  docs/results.md shows it, the README's table has one short line per claim)."""
  rows = [
    (
      "Single-layer FPA heads converge to target live-key sets where softmax and FoX fail on every seed "
      "(nested scopes)",
      _live_sets(_load(root, "scopes"), "scopes"),
    ),
    (
      "... and on the general case (levels set per key, dips per token)",
      _live_sets(_load(root, "dips"), "dips") + _dips_variants(root),
    ),
    (
      "A 110M model retrieves a passkey perfectly at 8x its training length, the only one of the methods",
      _passkey(_load(root, "passkey")) + _passkey_seed(_load(root, "passkey_seed1/passkey")) + _pace_claim(root),
    ),
    (
      "... and keeps that with the KV cache compressed to ~25%",
      _kv(
        _load(root, "kv_compression"),
        _load(root, "kv_compression_decode/kv_compression"),
        _load(root, "kv_compression_n100/kv_compression"),
        _load(root, "kv_compression_decode_n100/kv_compression"),
      )
      + _kv_by_length(root),
    ),
    (
      "Perplexity on par with FoX (within 2%)",
      _ppl(
        _load(root, "perplexity"),
        _load(root, "perplexity_T3000"),
        (_load(root, "correlated_batches/perplexity"), _load(root, "correlated_batches/perplexity_long/perplexity")),
      ),
    ),
    (
      "FPA LMs keep nested structure beyond the training length, and a cache cut by the learned rule keeps it",
      _bindings(_load(root, "bindings_lm")),
    ),
    (
      "On text, a model trained to forget gives up little for it, and its rule cuts the cache",
      _text_pareto(_load(root, "text_pareto"), _load(root, "perplexity_T3000")),
    ),
    (
      "Forgetting turned into speed: >= 2x attention speed-up on a model trained to forget",
      _speed(_load(root, "forget_speed")),
    ),
  ]
  lines = ["| claim (paper) | measured here (CPU scale; see each study's table) |", "|---|---|"]
  lines += [f"| {c} | {m} |" for c, m in rows]
  return "\n".join(lines) + "\n"


# ---- the README's claims table: one line per claim, a verdict judged seed by seed ----------------


LIVE_KEYS = ("target_mass_1x", "target_mass_2x", "coverage_1x", "coverage_2x")


def live_set_seeds(doc: dict, method: str, thr: float = 0.95) -> dict[int, bool]:
  """{seed: the method's heads reach mass and coverage >= thr at 1x and 2x} of a live-set study."""
  e = doc[method]
  ids = e.get("seed_ids", list(range(e["seeds"])))
  return {s: all(e[k][i] >= thr for k in LIVE_KEYS if k in e) for i, s in enumerate(ids)}


def _live_row(doc, task: str, variants: str = "") -> tuple[str, str]:
  if doc is None or "fpa" not in doc:
    return "not run", f"`python -m experiments.live_sets --task {task}`"
  fpa = live_set_seeds(doc, "fpa")
  rivals = [live_set_seeds(doc, m) for m in ("fox", "softmax") if m in doc]
  ok = [fpa[s] and not any(r.get(s) for r in rivals) for s in fpa]
  counts = ", ".join(f"{m} {sum(live_set_seeds(doc, m).values())}/{doc[m]['seeds']}" for m in FAMILIES if m in doc)
  return seed_verdict(ok), f"seeds succeeding: {counts}{variants}"


def _dips_variant_short(root: Path) -> str:
  out = []
  for name, doc in _dips_variant_runs(root):
    if "fox" in doc:
      hd, steps = _head_dim_steps(doc, "fpa")
      out.append(f"; head dim {hd}, {steps} steps: fpa {doc['fpa']['successes']}/{doc['fpa']['seeds']}")
  return "".join(out)


def passkey_seeds(root: Path = ROOT, method: str | None = None) -> dict[int, bool]:
  """{seed: the LM default competent at 1x (validation >= the study's bar) no later than FoX of the
  same seed (or within FoX's steps where FoX never got there), and >= 0.99 at 8x on the test prompts}."""
  if method is None:
    from experiments.passkey import DEFAULT_METHOD as method
  runs = passkey_pace(root)
  if runs is None or method not in runs:
    return {}
  x8 = {s: doc[method].get("8") for s, shared, doc in _passkey_pace_docs(root) if shared and method in doc}
  fox, out = runs[PACE_FOX], {}
  for s, (first, _) in sorted(runs[method].items()):
    if s in fox:
      budget = fox[s][0] if fox[s][0] is not None else fox[s][1][-1][0]
      out[s] = first is not None and first <= budget and (x8.get(s) or 0) >= 0.99
  return out


def _passkey_row(root: Path) -> tuple[str, str]:
  from experiments.passkey import DEFAULT_METHOD as method

  runs, ok = passkey_pace(root), passkey_seeds(root, method)
  if not ok:
    return "not run", "`python -m experiments.passkey`"
  step = lambda m, s: str(runs[m][s][0] or "no")  # noqa: E731
  seeds = sorted(ok)
  return seed_verdict(list(ok.values())), (
    f"steps to 1x competence by seed {'/'.join(map(str, seeds))}: `{method}` (the LM default) "
    f"{'/'.join(step(method, s) for s in seeds)}, FoX {'/'.join(step(PACE_FOX, s) for s in seeds)}"
  )


def _kv_row(root: Path) -> tuple[str, str]:
  doc = _load(root, "kv_compression_n100/kv_compression") or _load(root, "kv_compression")
  if doc is None or not doc.get("cells"):
    return "not run", "`python -m experiments.kv_compression`"
  acc = lambda m, p, b: doc["cells"].get(f"{m}/{p}", {}).get(b, {}).get("accuracy")  # noqa: E731
  models = sorted({k.split("/")[0] for k in doc["cells"]})
  fpa = [m for m in models if not m.startswith("fox") and acc(m, "fpa_budget", "0.25") is not None]
  if not fpa:
    return "not run", "no FPA model under `fpa_budget` yet"
  best = max(fpa, key=lambda m: (acc(m, "fpa_budget", "0.25"), acc(m, "fpa_budget", "0.125") or 0))
  a25, a12 = acc(best, "fpa_budget", "0.25"), acc(best, "fpa_budget", "0.125")
  fox = [acc(m, p, "0.25") for m in models if m.startswith("fox") for p in KV_POLICIES]
  fox = [x for x in fox if x is not None]
  return seed_verdict([a25 >= 0.99]), (
    f"`{best}` (one seed) at {doc['multiple']}x, {doc['n_prompts']} prompts: {a25:.2f} at 25% of the cache, "
    + (f"{a12:.2f} at 12.5%" if a12 is not None else "12.5% not run")
    + (f"; FoX's best policy at 25%: {max(fox):.2f}" if fox else "")
  )


PPL_DEFAULT = ("fpa_lm_warmc10_fh1", "fpa_lm", "fpa")  # the LM default's row, else the earliest FPA row


def _paired(doc: dict, m: str, base: str) -> list[float]:
  """bpb(m) / bpb(base) - 1 per seed both ran."""
  b = dict(zip(doc[base].get("seeds", range(len(doc[base]["bpb"]))), doc[base]["bpb"]))
  mine = zip(doc[m].get("seeds", range(len(doc[m]["bpb"]))), doc[m]["bpb"])
  return [x / b[s] - 1 for s, x in mine if s in b]


def _ppl_row(root: Path) -> tuple[str, str]:
  doc = _load(root, "perplexity_T3000") or _load(root, "perplexity")
  m = next((m for m in PPL_DEFAULT if doc is not None and "bpb" in doc.get(m, {})), None)
  if doc is None or m is None or "fox" not in doc:
    return "not run", "`python -m experiments.perplexity`"
  pair = _paired(doc, m, "fox")
  return seed_verdict([x <= 0.02 for x in pair]), (
    f"`{m}` / FoX bits per byte after {doc['recipe']['steps']} steps, by seed: "
    + ", ".join(f"{100 * x:+.1f}%" for x in pair)
  )


BINDINGS_RECIPE = "fpa_evict"  # the recipe the quickstart and notebook 03 train


def _bindings_row(root: Path) -> tuple[str, str]:
  doc = _load(root, "bindings_lm")
  if doc is None or not doc.get(BINDINGS_RECIPE, {}).get("evals"):
    return "not run", "`python -m experiments.bindings_lm`"
  k = str(doc.get("summary", {}).get("multiple", 4))
  ok, gaps = [], []
  for ev in doc[BINDINGS_RECIPE]["evals"]:
    c = ev.get(k, {})
    a = {p: c.get(p, {}).get("acc") for p in ("full", "fpa_budget 12.5%", "window 12.5%", "h2o 12.5%")}
    if None in a.values():
      continue
    rule = a["fpa_budget 12.5%"]
    ok.append(a["full"] - rule <= 0.01 and rule - a["window 12.5%"] >= 0.10 and rule - a["h2o 12.5%"] >= 0.10)
    gaps.append((100 * (rule - a["full"]), 100 * (rule - a["h2o 12.5%"])))
  pts = lambda xs: "/".join(f"{x:+.1f}" for x in xs)  # noqa: E731
  return seed_verdict(ok), (
    f"`{BINDINGS_RECIPE}` at {k}x, learned rule at 12.5% of the cache, by seed: {pts(g for g, _ in gaps)} "
    f"points vs the full cache, {pts(h for _, h in gaps)} over h2o (target: within 1; >= 10 over window and h2o)"
  )


def _evict_cost_row(root: Path) -> tuple[str, str]:
  doc = _load(root, "perplexity_T3000")
  if doc is None or not all("bpb" in doc.get(m, {}) for m in ("fpa_lm", "fpa_lm_evict")):
    return "not run", "`python -m experiments.perplexity --methods fpa_lm fpa_lm_evict --steps 3000`"
  pair = _paired(doc, "fpa_lm_evict", "fpa_lm")
  return seed_verdict([x <= 0.01 for x in pair]), (
    "`fpa_lm_evict` / `fpa_lm` bits per byte, by seed: " + ", ".join(f"{100 * x:+.2f}%" for x in pair)
  )


def _text_cache_row(root: Path, meth: str = "fpa_lm_evict") -> tuple[str, str]:
  doc = _load(root, "text_pareto")
  if doc is None or meth not in doc.get("runs", {}):
    return "not run", "`python -m experiments.text_pareto`"
  from experiments.text_pareto import smallest_within

  budgets, ok, parts = doc["recipe"]["budgets"], [], []
  for seed, run in sorted(doc["runs"][meth].items()):
    s = {"budgets": budgets} | {f"{meth}/{k}/{p}": c["bpb"] for k, cells in run.items() for p, c in cells.items()}
    pair = [(smallest_within(s, meth, k, "fpa_budget"), smallest_within(s, meth, k, "window")) for k in run]
    ok.append(all(r is not None and (w is None or r < w) for r, w in pair))
    pct = lambda xs: "/".join(f"{100 * x:g}%" if x else "none" for x in xs)  # noqa: E731
    parts.append(f"{pct(r for r, _ in pair)} (window {pct(w for _, w in pair)})")
  return seed_verdict(ok), (
    f"`{meth}`: smallest cache within 1% of the full cache's bits per byte at {'x / '.join(run)}x, by seed: "
    + ", ".join(parts)
  )


def _speed_row(root: Path) -> tuple[str, str]:
  doc = _load(root, "forget_speed")
  if doc is None or not doc.get("rows"):
    return "not run", "`python -m experiments.forget_speed`"

  def gain(r):
    c = r["tolerances"][min(r["tolerances"], key=float)]
    return r["attention_s"] / c["attention_s_keys"], r["attention_grad_s"] / c["attention_grad_s_tiles"]

  m = max(doc["rows"], key=lambda m: gain(doc["rows"][m])[0])
  att, train = gain(doc["rows"][m])
  return seed_verdict([att >= 2.0]), (
    f"`{m}` (one seed), skip='keys' at {doc['multiple']}x: attention {att:.2f}x; training (tile skipping) {train:.2f}x"
  )


def _train_speed_row(root: Path) -> tuple[str, str]:
  """Key-sparse training against exact on the same batches (`experiments.forget_train`): once the
  objective's ramp has ended, every step window >= 1.3x, every attention probe >= 2x, and the paired
  loss gap below the loss's own step-to-step noise."""
  doc = _load(root, "forget_train")
  if doc is None:
    return "not run", "`python -m experiments.forget_train`"
  cfg, s = doc["config"], doc["summary"]
  ramped = cfg["evict_ramp_start"] + cfg["evict_ramp_steps"]
  steps = [w["step_speedup"] for w in s["windows"] if int(w["steps"].split("-")[0]) > ramped]
  att = [p["attention_speedup"] for p in s["probes"] if p["step"] > ramped]
  if not steps or not att:
    return "not run", f"the run ended before its objective's ramp (step {ramped})"
  ok = min(steps) >= 1.3 and min(att) >= 2.0 and s["loss_gap_max_abs"] < s["loss_step_noise"]
  return seed_verdict([ok]), (
    f"T={cfg['seq_len']}, one run, after the ramp (step {ramped}): whole step {min(steps):.2f}-{max(steps):.2f}x, "
    f"attention fwd+bwd {min(att):.2f}-{max(att):.2f}x; loss gap <= {s['loss_gap_max_abs']:.4f} "
    f"(step-to-step noise {s['loss_step_noise']:.3f})"
  )


def claims_rows(root: Path = ROOT) -> list[tuple[str, str, str, str]]:
  """(claim, verdict, evidence, link) of every claim, from the studies' results files."""
  dips = _dips_variant_short(root)
  rows = [
    ("Single-layer FPA heads learn nested-scope live-key sets where softmax and FoX fail",
     *_live_row(_load(root, "scopes"), "scopes"), "docs/results/live_sets.md"),
    ("... and the general case (levels per key, dips per token)",
     *_live_row(_load(root, "dips"), "dips", dips), "docs/results/live_sets.md"),
    ("The LM default learns passkey retrieval as fast as FoX and keeps it at 8x the training length",
     *_passkey_row(root), "docs/results/passkey.md"),
    ("... and keeps it with the KV cache cut to 25% by the learned rule",
     *_kv_row(root), "docs/results/kv_compression.md"),
    ("Perplexity on par with FoX (within 2%)", *_ppl_row(root), "docs/results/perplexity.md"),
    ("Nested bindings beyond the training length, kept by the learned rule at 12.5% of the cache",
     *_bindings_row(root), "docs/results/bindings_lm.md"),
    ("Training to forget costs <= 1% bits per byte on text",
     *_evict_cost_row(root), "docs/results/perplexity.md"),
    ("On text the learned rule needs a smaller cache than a window",
     *_text_cache_row(root), "docs/results/text_pareto.md"),
    (">= 2x attention speed-up on a model trained to forget",
     *_speed_row(root), "docs/results/kv_compression.md"),
    ("Training gets faster as the model forgets (>= 1.3x step, >= 2x attention, the same loss)",
     *_train_speed_row(root), "docs/results/kv_compression.md"),
  ]  # fmt: skip
  return rows


ONE_RECIPE_CLAIMS = "results/one_recipe/claims.json"


def _cell(text: str) -> str:
  return " ".join(str(text).split()).replace("|", "\\|")


def claims_table(root: Path = ROOT, studies: bool = False, base: str = "") -> str:
  """results/claims.md, the README's claims table: one line per claim, its verdict and a link to the
  evidence. From `experiments.one_recipe`'s claims.json (one recipe, every claim on the same
  checkpoints) when it exists and judges at least one claim, else (or with `studies`) from the separate studies' results files, its
  links relative to `base` (the folder of the page that shows it; the repository root by default)."""
  path = root / ONE_RECIPE_CLAIMS
  recipe = json.loads(path.read_text()) if path.exists() and not studies else []
  rel = lambda link: os.path.relpath(link, base or ".")  # noqa: E731  (links from the page that shows it)
  if any(not str(c.get("verdict", "not run")).startswith("not run") for c in recipe):
    lines = [
      "The live-set claims are single attention heads (`experiments.live_sets`); every other claim is judged on the "
      "same checkpoints of one LM recipe, paired with FoX by seed (`python -m experiments.one_recipe`):",
      "",
      "| claim | verdict | evidence |",
      "|---|---|---|",
    ]
    lines += [f"| {c} | {v} | [{_cell(e)}]({rel(link)}) |" for c, v, e, link in claims_rows(root)[:2]]
    for c in recipe:
      text = _cell(c.get("evidence") or "evidence")
      link = f"[{text}]({rel(c['link'])})" if c.get("link") else text
      lines.append(f"| LM recipe: {_cell(c['claim'])} | {_cell(c['verdict'])} | {link} |")
    return "\n".join(lines) + "\n"
  lines = [
    "Each claim judged on every seed its study ran (paired with FoX of the same seed where it compares with FoX):",
    "",
    "| claim | verdict | evidence |",
    "|---|---|---|",
  ]
  lines += [f"| {c} | {v} | [{_cell(e)}]({rel(link)}) |" for c, v, e, link in claims_rows(root)]
  return "\n".join(lines) + "\n"


def pages(root: Path = ROOT) -> list[Path]:
  """The markdown files whose results blocks `render` fills: README.md and every docs/**/*.md."""
  return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def main(argv=None) -> int:
  (ROOT / "results").mkdir(exist_ok=True)
  (ROOT / "results" / "claims.md").write_text(claims_table())
  (ROOT / "results" / "claims_studies.md").write_text(claims_table(studies=True, base="docs"))
  (ROOT / "results" / "claims_detail.md").write_text(claims_detail())
  dips = dips_limits_table()
  if dips is not None:
    (ROOT / "results" / "dips_limits.md").write_text(dips)
  pace = passkey_pace_table()
  if pace is not None:
    (ROOT / "results" / "passkey_pace.md").write_text(pace)
    pace_plot(ROOT / "results" / "passkey_pace.png")
  lengths = kv_lengths_table()
  if lengths is not None:
    (ROOT / "results" / "kv_lengths.md").write_text(lengths + "\n")
  for path in pages():
    if not path.exists():
      continue
    old = path.read_text()
    new = render(old)
    if new != old:
      path.write_text(new)
    name = path.relative_to(ROOT)
    print(f"{name}: {len(BLOCK.findall(new))} results blocks, {'updated' if new != old else 'unchanged'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
