"""Bits per byte on text against KV-cache size, on held-out Python source, for FPA byte LMs
trained with and without the evictability objective, FoX, and a sliding window.

    python -m experiments.text_pareto                                # fox, fpa_lm, fpa_lm_evict
    python -m experiments.text_pareto --methods fpa_lm fpa_lm_evict --seeds 0
    python -m experiments.text_pareto --report-only                  # re-render .md/.png from the JSON

The models are the long perplexity runs (`python -m experiments.perplexity --methods fox fpa_lm
fpa_lm_evict --steps 3000 --eval-every 300 --out-name perplexity_T3000`; their workdirs are read from
results/perplexity_T3000.json). Each is scored by `fpa_jax.eval`'s loss by position on the `fpa_text`
validation split at 1x and 4x its training length: the parallel model for the full cache, and every
token decoded through a cache of `--budgets` of the row length under `fpa_budget` (the learned rule:
largest penalty first; on FoX its own decay, i.e. FoX with its own threshold) and `window`. A cell
already in the results file is not recomputed (rerun = resume). Writes results/text_pareto.{json,md,png}.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments import perplexity

MODULE = "experiments.text_pareto"
BITS = 1.0 / np.log(2.0)
POLICIES = ("fpa_budget", "window")
LABELS = {"fox": "FoX", "fpa_lm": "FPA", "fpa_lm_evict": "FPA + objective"}


def cells_of(budgets: list[float]) -> list[tuple[str, str, float | None]]:
  """(label, policy, budget) of every cache setting, the full cache first."""
  return [("full", "full", None)] + [(f"{p} {100 * b:g}%", p, b) for b in budgets for p in POLICIES]


def score(workdir: str, multiple: int, rows: int, policy: str, budget: float | None) -> dict:
  """One `fpa_jax.eval` loss-by-position run -> {bpb, tokens, cache_fraction}."""
  from fpa_jax import eval as E

  argv = ["--workdir", workdir, "--task", "loss_by_position", "--multiple", str(multiple), "--rows", str(rows)]
  if budget is not None:
    argv += ["--policy", policy, "--budget", str(budget)]
  with tempfile.TemporaryDirectory() as tmp:  # the cell lives in this study's results file, not in eval's
    argv += ["--no-progress", "--out", os.path.join(tmp, "cell.json")]
    res, _ = E.run(E.parse_args(argv), argv)
  stats = res.get("cache") or {}
  return {"bpb": res["nll_mean"] * BITS, "tokens": res["tokens"], "cache_fraction": stats.get("cache_fraction", 1.0)}


def _mean(res: dict, method: str, mult: str, label: str) -> float | None:
  xs = [s[mult][label]["bpb"] for s in res["runs"].get(method, {}).values() if label in s.get(mult, {})]
  return float(np.mean(xs)) if xs else None


def summarise(res: dict) -> dict:
  """Per method and multiple, the mean bits per byte of every cache setting (`{method}/{multiple}/{label}`)."""
  s: dict = {"budgets": res["recipe"]["budgets"], "multiples": res["recipe"]["multiples"]}
  runs = res["runs"]
  for meth in runs:
    s[f"{meth}/seeds"] = len(runs[meth])
    for m in res["recipe"]["multiples"]:
      for label, _, _ in cells_of(res["recipe"]["budgets"]):
        v = _mean(res, meth, str(m), label)
        if v is not None:
          s[f"{meth}/{m}/{label}"] = v
  return s


def smallest_within(s: dict, meth: str, m: int, policy: str, tol: float = 0.01) -> float | None:
  """The smallest budget at which `policy` keeps `meth` within `tol` of its full cache (None: none)."""
  full = s.get(f"{meth}/{m}/full")
  ok = [
    b for b in s["budgets"] if (v := s.get(f"{meth}/{m}/{policy} {100 * b:g}%")) is not None and v <= full * (1 + tol)
  ]
  return min(ok) if ok and full is not None else None


def claims(s: dict) -> list[str]:
  out = []
  # The objective's cost at 1x with the full cache is claimed from the perplexity study's 512 held-out
  # windows (`perplexity.evict_cost_claim`, and its seed-by-seed row in `perplexity.claim_rows`; the
  # claim's detail below leads with it), not from these few rows.
  low = min(s["budgets"])
  pct = lambda b: f"{100 * b:g}%"  # noqa: E731
  for meth in ("fpa_lm_evict", "fpa_lm", "fox"):
    parts = []
    for k in s["multiples"]:
      full = s.get(f"{meth}/{k}/full")
      if full is None:
        continue
      rule, win = s.get(f"{meth}/{k}/fpa_budget {pct(low)}"), s.get(f"{meth}/{k}/window {pct(low)}")
      sr, sw = smallest_within(s, meth, k, "fpa_budget"), smallest_within(s, meth, k, "window")
      part = (
        f"at {k}x the smallest cache within 1% of the full cache's {full:.3f} bits/byte is "
        f"{pct(sr) if sr else 'none tried'} with the learned rule, {pct(sw) if sw else 'none tried'} with a window"
      )
      if rule is not None and win is not None:
        part += f" (at {pct(low)}: rule {100 * (rule / full - 1):+.1f}%, window {100 * (win / full - 1):+.1f}%)"
      parts.append(part)
    if parts:
      out.append(f"{LABELS.get(meth, meth)} ({s[f'{meth}/seeds']} seeds): " + "; ".join(parts) + ".")
  return out


def markdown(res: dict) -> str:
  r = res["recipe"]
  mults = [str(m) for m in r["multiples"]]
  head = (
    f"`python -m {MODULE}` (command in text_pareto.json): held-out bits per byte of the 2-layer byte LMs of "
    f"`{res.get('models', 'results/perplexity_T3000.json')}` on `fpa_text` validation rows ({r['rows']} rows at "
    "1x, the same tokens in fewer, longer rows at larger multiples), with the full cache (parallel model) and with "
    "the cache cut to a fraction of each row by `fpa_budget` (the learned rule; FoX's own decay on FoX) or "
    "`window`, decoded token by token. Mean over seeds; cache = peak keys held per (layer, head) / row length.\n\n"
  )
  rows = []
  for meth in res["runs"]:
    n = len(res["runs"][meth])
    for label, _, _ in cells_of(r["budgets"]):
      vals = [_mean(res, meth, m, label) for m in mults]
      if all(v is None for v in vals):
        continue
      rows.append([LABELS.get(meth, meth), label, n, *[f"{v:.4f}" if v is not None else "—" for v in vals]])
  table = U.md_table(["model", "cache", "seeds", *[f"bits/byte {m}x" for m in mults]], rows)
  return head + table + "\n\n" + "\n".join(f"- {c}" for c in claims(res["summary"])) + "\n"


def plot(res: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  r = res["recipe"]
  mults = [str(m) for m in r["multiples"]]
  fig, axes = plt.subplots(1, len(mults), figsize=(4.8 * len(mults), 3.6), squeeze=False)
  for ax, m in zip(axes[0], mults):
    for meth in res["runs"]:
      full = _mean(res, meth, m, "full")
      for p, style in zip(POLICIES, ("-", ":")):
        xs = [1.0] + list(r["budgets"])
        ys = [full] + [_mean(res, meth, m, f"{p} {100 * b:g}%") for b in r["budgets"]]
        ok = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if len(ok) > 1:
          ax.plot(*zip(*ok), style, marker="o", label=f"{LABELS.get(meth, meth)}, {p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache (fraction of the row)")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"{m}x the training length", fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Claims: this study's row of the README's claims table (`experiments.report` collects it)
# ------------------------------------------------------------------------------------------------


def _detail(doc, ppl) -> str:
  """Everything measured for the claim, led by the objective's text cost (`perplexity.evict_cost_claim`)."""
  cost = perplexity.evict_cost_claim(ppl).strip() if ppl is not None else ""
  if doc is None:
    return (cost + " " if cost else "") + "Pareto curves not run yet (`python -m experiments.text_pareto`)"
  return (cost + " " if cost else "") + (
    "Held-out bits per byte of those byte LMs under each cache (`text_pareto`): " + " ".join(claims(doc["summary"]))
  )


def _claim_row(root: Path, meth: str = "fpa_lm_evict") -> tuple[str, str]:
  doc = U.load_result(root, "text_pareto")
  if doc is None or meth not in doc.get("runs", {}):
    return "not run", f"`python -m {MODULE}`"
  budgets, ok, parts = doc["recipe"]["budgets"], [], []
  for seed, run in sorted(doc["runs"][meth].items()):
    s = {"budgets": budgets} | {f"{meth}/{k}/{p}": c["bpb"] for k, cells in run.items() for p, c in cells.items()}
    pair = [(smallest_within(s, meth, k, "fpa_budget"), smallest_within(s, meth, k, "window")) for k in run]
    ok.append(all(r is not None and (w is None or r < w) for r, w in pair))
    pct = lambda xs: "/".join(f"{100 * x:g}%" if x else "none" for x in xs)  # noqa: E731
    parts.append(f"{pct(r for r, _ in pair)} (window {pct(w for _, w in pair)})")
  return U.seed_verdict(ok), (
    f"`{meth}`: smallest cache within 1% of the full cache's bits per byte at {'x / '.join(run)}x, by seed: "
    + ", ".join(parts)
  )


def claim_rows(root: Path = U.ROOT) -> list[U.ClaimRow]:
  """The text-cache claim (the learned rule against a window, seed by seed), its detail led by the
  objective's text cost (results/perplexity_T3000.json)."""
  return [
    U.ClaimRow(
      "On text the learned rule needs a smaller cache than a window",
      *_claim_row(root),
      "docs/results/text_pareto.md",
      (
        "On text, a model trained to forget gives up little for it, and its rule cuts the cache",
        _detail(U.load_result(root, "text_pareto"), U.load_result(root, "perplexity_T3000")),
      ),
    )
  ]


def parse_args(argv=None):
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--methods", nargs="+", default=["fox", "fpa_lm", "fpa_lm_evict"])
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--multiples", type=int, nargs="+", default=[1, 4])
  ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.125, 0.0625, 0.03125, 0.015625])
  ap.add_argument("--rows", type=int, default=32, help="held-out rows at 1x (rows / multiple at larger multiples)")
  ap.add_argument("--models", default=str(U.ROOT / "results" / "perplexity_T3000.json"))
  ap.add_argument("--out-dir", default=str(U.ROOT / "results"))
  ap.add_argument("--report-only", action="store_true", help="re-render the .md/.png from the JSON, score nothing")
  return ap.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  out_dir = Path(args.out_dir)
  path = out_dir / "text_pareto.json"
  recipe = {"multiples": args.multiples, "budgets": args.budgets, "rows": args.rows}
  res = U.read_json(path, {})
  if args.report_only:
    if not res:
      raise SystemExit(f"{path} not found: run python -m {MODULE} first")
    res["summary"] = summarise(res)
    U.write_study(out_dir, "text_pareto", res, markdown, plot)
    return res
  if res.get("recipe") != recipe:
    res = {"recipe": recipe, "runs": {}}
  models = U.read_json(args.models)
  res["models"] = os.path.relpath(Path(args.models).resolve(), U.ROOT)  # whose checkpoints: the header names them
  if models is None:
    raise SystemExit(f"{args.models} not found: train the models first (see `python -m {MODULE} --help`)")
  t0 = time.perf_counter()
  log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
  for meth in args.methods:
    entry = models.get(meth)
    if entry is None:
      log(f"[text_pareto] {meth}: not in {args.models}, skipped")
      continue
    for seed, workdir in zip(entry["seeds"], entry["workdirs"]):
      if seed not in args.seeds:
        continue
      run = res["runs"].setdefault(meth, {}).setdefault(str(seed), {})
      for m in args.multiples:
        cells = run.setdefault(str(m), {})
        for label, policy, budget in U.progress(cells_of(args.budgets), desc=f"{meth} s{seed} {m}x", leave=False):
          if label not in cells:
            cells[label] = score(str(U.ROOT / workdir), m, max(1, args.rows // m), policy, budget)
            res["summary"] = summarise(res)
            res["meta"] = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0)
            U.write_json(path, res)  # after every cell: a rerun resumes
        log(f"[text_pareto] {meth} s{seed} {m}x: " + ", ".join(f"{k} {v['bpb']:.3f}" for k, v in cells.items()))
  res["summary"] = summarise(res)
  res["meta"] = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0)
  U.write_study(out_dir, "text_pareto", res, markdown, plot)
  return res


if __name__ == "__main__":
  main()
