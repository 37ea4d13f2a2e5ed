"""Study 3 (issue 11): passkey retrieval at 8x the training length with a compressed KV cache.

    python -m experiments.kv_compression                          # every model in results/passkey.json
    python -m experiments.kv_compression --models fpa fox_b5      # a subset (results merge)
    python -m experiments.kv_compression --prefill parallel       # prompt through the chunked kernel
    python -m experiments.kv_compression --scale base110m         # print the accelerator recipe only

The models trained by `experiments.passkey` (their workdirs are in results/passkey.json) decode the
8x-length test prompts (`passkey_eval_examples`, the same as the passkey study's 8x cells; --n per
depth) greedily with each cache policy: `full`, `fpa` with a tolerance (its kept fraction is
measured, not set), and `fpa_budget`, `window`, `sink_window`, `h2o` at budgets 50%, 25%, 12.5% of
the sequence (100% of any budgeted policy is `full`). Default prefill is `decode`: the prompt is fed
token by token under the policy, so no query ever attends to more than the budget. A cell is the
fraction of prompts whose whole answer is generated exactly.
Writes results/kv_compression.{json,md,png}; reruns skip cells already in the JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U

MODULE = "experiments.kv_compression"
BUDGETED = ("fpa_budget", "window", "sink_window", "h2o")
BUDGETS = (0.5, 0.25, 0.125)
DECODE_ONLY = ("h2o",)  # ranks keys by accumulated attention: needs every prompt token decoded


def cells(tolerance: float, policies=("full", "fpa") + BUDGETED, budgets=BUDGETS) -> list[tuple[str, str, dict]]:
  """(policy, budget label, generate kwargs) of every evaluated cell."""
  out = [("full", "1", {})] if "full" in policies else []
  out += [("fpa", "tol", {"tolerance": tolerance})] if "fpa" in policies else []
  out += [(p, f"{b:g}", {"budget": b}) for b in budgets for p in BUDGETED if p in policies]
  return out


def passkey_accuracy(model, examples: list[dict], *, policy: str, prefill: str, batch: int, **kw) -> dict:
  """Greedy exact match of each example's answer under a cache policy (`fpa_jax.inference.generate`).

  -> {"accuracy", "cache_fraction" (peak keys held / sequence, max over batches), "overflow"}.
  """
  from fpa_jax.inference import generate

  spans = [(int(ex["answer_start"]), len(ex["tokens"]) - 1 - int(ex["answer_start"])) for ex in examples]
  n_new = max(n for _, n in spans)
  ok, frac, overflow = [], 0.0, False
  for i in range(0, len(examples), batch):
    chunk = examples[i : i + batch]
    prompts = [np.asarray(ex["tokens"][:a0]) for ex, (a0, _) in zip(chunk, spans[i : i + batch])]
    while len(prompts) < batch:  # fixed batch: one compile per cell
      prompts.append(prompts[-1])
    out, stats = generate(model, prompts, n_new, policy=policy, prefill=prefill, **kw)
    for r, (ex, (a0, n)) in enumerate(zip(chunk, spans[i : i + batch])):
      ok.append(bool(np.array_equal(out[r, :n], np.asarray(ex["tokens"][a0 : a0 + n]))))
    frac, overflow = max(frac, stats["cache_fraction"]), overflow or stats["overflow"]
  return {"accuracy": float(np.mean(ok)), "cache_fraction": frac, "overflow": overflow, "n": len(ok)}


def markdown(res: dict) -> str:
  meta = res["meta"]
  lines = [
    f"`{meta['command']}`: greedy passkey exact match at {res['multiple']}x the training length "
    f"({res['train_length']} -> {res['train_length'] * res['multiple']} tokens), {res['n_prompts']} prompts "
    f"per cell (depths {', '.join(map(str, res['depths']))}%), prefill `{res['prefill']}`; "
    "cache = peak keys held / sequence"
    + (
      ". Parallel prefill: the prompt goes through the chunked kernel with the whole prompt in view, "
      "then the policy cuts the cache to its budget before the answer is generated; h2o (which ranks keys by "
      "the attention each received while decoding) needs `--prefill decode`: —"
      if res["prefill"] == "parallel"
      else ". Decode prefill: the prompt is fed token by token under the policy, so no query ever sees more "
      "than the budget"
    )
    + ".\n"
  ]
  models = sorted({k.split("/")[0] for k in res["cells"]})
  head = ["model", "full", f"fpa ε={res['tolerance']:g} (cache)"] + [f"{p} {b:g}" for b in BUDGETS for p in BUDGETED]
  rows = []
  for m in models:
    c = res["cells"]
    get = lambda p, b: c.get(f"{m}/{p}", {}).get(b)
    row = [m, _acc(get("full", "1"))]
    tol = get("fpa", "tol")
    row.append("—" if tol is None else f"{tol['accuracy']:.2f} ({tol['cache_fraction']:.2f})")
    row += [_acc(get(p, f"{b:g}")) for b in BUDGETS for p in BUDGETED]
    rows.append(row)
  lines.append(U.md_table(head, rows))
  return "\n".join(lines)


def _acc(cell) -> str:
  return "—" if cell is None else f"{cell['accuracy']:.2f}"


def figure(res: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = sorted({k.split("/")[0] for k in res["cells"]})
  fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.2), squeeze=False, sharey=True)
  for ax, m in zip(axes[0], models):
    c = res["cells"]
    full = c.get(f"{m}/full", {}).get("1")
    for p in BUDGETED:
      xs = [1.0] + list(BUDGETS)
      ys = [full["accuracy"] if full else np.nan] + [
        c.get(f"{m}/{p}", {}).get(f"{b:g}", {}).get("accuracy", np.nan) for b in BUDGETS
      ]
      ax.plot(xs, ys, marker="o", label=p)
    tol = c.get(f"{m}/fpa", {}).get("tol")
    if tol:
      ax.scatter(
        [tol["cache_fraction"]],
        [tol["accuracy"]],
        marker="*",
        s=150,
        c="k",
        zorder=5,
        label=f"fpa ε={res['tolerance']:g}",
      )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache (fraction of the sequence)")
    ax.set_title(m)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
  axes[0, 0].set_ylabel(f"passkey exact match at {res['multiple']}x")
  axes[0, -1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
  ap.add_argument("--passkey-results", default=str(U.ROOT / "results" / "passkey.json"))
  ap.add_argument("--models", nargs="*", help="methods of the passkey study (default: all with a workdir)")
  ap.add_argument("--multiple", type=int, default=8)
  ap.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50, 75, 100])
  ap.add_argument("--n", type=int, default=4, help="prompts per depth (cells get n * len(depths) prompts)")
  ap.add_argument("--tolerance", type=float, default=1e-3)
  ap.add_argument("--policies", nargs="+", default=["full", "fpa", *BUDGETED], choices=["full", "fpa", *BUDGETED])
  ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
  ap.add_argument("--prefill", choices=("decode", "parallel"), default="decode")
  ap.add_argument("--batch", type=int, default=20)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out-dir", default=str(U.ROOT / "results"))
  ap.add_argument(
    "--scale", choices=["cpu", "base110m"], default="cpu", help="base110m: print the accelerator recipe and exit"
  )
  return ap.parse_args(argv)


def base110m_recipe() -> str:
  return f"""kv_compression at the paper's scale (NOT run here: it needs the base110m passkey models)

models   : the passkey study's base110m runs (python -m experiments.passkey --scale base110m prints that recipe),
           trained at L = 2048 and decoded here at 8 x L = 16384 tokens
command  : python -m experiments.kv_compression --passkey-results results/passkey.json --n 20 --batch 20
           (the passkey.json written by the base110m passkey runs; --prefill decode keeps every query within budget)
cells    : full, fpa (tolerance 1e-3), and {", ".join(BUDGETED)} at {", ".join(f"{b:.1%}" for b in BUDGETS)} of 16384
cost     : one device per model suffices; 100 prompts x 16k tokens x 14 cells = 23M token steps per model
           (1.1M batched decode calls at batch 20); wall time not measured (no accelerator was available)
"""


def main(argv=None) -> dict:
  a = parse_args(argv)
  if a.scale == "base110m":
    print(base110m_recipe())
    return {}
  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.inference import load_model

  pk = U.read_json(a.passkey_results)
  if pk is None:
    raise SystemExit(f"{a.passkey_results} not found: run python -m experiments.passkey first")
  train_len = pk["train_length"]
  models = a.models or [m for m, v in pk.items() if isinstance(v, dict) and v.get("workdir")]
  out_json = Path(a.out_dir) / "kv_compression.json"
  res = U.read_json(out_json, None) or {}
  same = (
    res.get("train_length") == train_len
    and res.get("multiple") == a.multiple
    and res.get("prefill") == a.prefill
    and res.get("tolerance") == a.tolerance
    and res.get("n_prompts") == a.n * len(a.depths)
  )
  if not same:
    res = {"cells": {}}
  res.update(
    train_length=train_len,
    multiple=a.multiple,
    prefill=a.prefill,
    tolerance=a.tolerance,
    n_prompts=a.n * len(a.depths),
    depths=a.depths,
  )
  # A model retrained since (more passkey stages) invalidates its cells.
  steps = res.setdefault("model_steps", {})
  for m in models:
    if steps.get(m) != pk[m].get("steps"):
      res["cells"] = {k: v for k, v in res["cells"].items() if k.split("/")[0] != m}
      steps[m] = pk[m].get("steps")
  examples = [ex for d in a.depths for ex in passkey_eval_examples(train_len, a.multiple, d, n=a.n, seed=a.seed)]
  t0 = time.perf_counter()
  policies = [p for p in a.policies if not (p in DECODE_ONLY and a.prefill == "parallel")]
  if len(policies) < len(a.policies):
    print(
      f"[kv_compression] skipping {sorted(set(a.policies) - set(policies))}: they rank keys by the attention "
      "each received, which a parallel prefill does not record (use --prefill decode)",
      file=sys.stderr,
    )
  todo = [
    (m, p, b, kw)
    for m in models
    for p, b, kw in cells(a.tolerance, policies, a.budgets)
    if b not in res["cells"].get(f"{m}/{p}", {})
  ]
  loaded = {}
  for m, p, b, kw in U.progress(todo, desc="kv_compression"):
    if m not in loaded:
      workdir = pk[m]["workdir"]
      loaded = {m: load_model(U.ROOT / workdir)[0]}  # an absolute workdir stays as it is
    cell = passkey_accuracy(loaded[m], examples, policy=p, prefill=a.prefill, batch=min(a.batch, len(examples)), **kw)
    res["cells"].setdefault(f"{m}/{p}", {})[b] = cell
    res["meta"] = U.run_meta(
      MODULE,
      argv,
      wall_s=time.perf_counter() - t0,
      seed=a.seed,
      models=models,
      passkey_meta=pk.get("meta", {}).get("commit"),
    )
    U.write_json(out_json, res)  # after every cell: a killed run resumes where it stopped
  if "meta" not in res:
    res["meta"] = U.run_meta(MODULE, argv, wall_s=0.0, seed=a.seed, models=models)
  md = markdown(res)
  (Path(a.out_dir) / "kv_compression.md").write_text(md)
  figure(res, Path(a.out_dir) / "kv_compression.png")
  print(md)
  return res


if __name__ == "__main__":
  main()
  sys.exit(0)
