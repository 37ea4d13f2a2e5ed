"""FPA against FoX on nested structure, as language models,
at several times the training length and with the KV cache cut by each policy.

    python -m experiments.bindings_lm                                   # fpa, fox, stack, softmax x 3 seeds
    python -m experiments.bindings_lm --methods fpa fox --seeds 0       # a subset (results merge)
    python -m experiments.bindings_lm --report-only                     # re-render .md/.png from the JSON

Task: `fpa_jax.data.bindings` (named bindings in nested scopes; a query's answer is its name's
innermost live binding; outer bindings are asked for after inner stretches that scale with the
length, so at every length about half of the answers lie further back than an eighth of the
sequence). 2-layer LMs trained at `--train-len` tokens with the library trainer (rerunning resumes
from `runs/bindings_lm/...`), then decoded token by token (`fpa_jax.inference.cached_logits`) on
`--n-eval` held-out programs per length at 1x..8x: answer accuracy on all queries and on the far
ones (answer more than length / 8 back), with the full cache and with 25% / 12.5% of it under
fpa_budget (the learned rule: largest penalty first; FoX's own decay for fox), window and h2o.
FPA is trained three ways (`FPA_ROWS`, an ablation of the training objectives): the LM loss
alone (`fpa`), plus the evictability hinge (`fpa_evict`), and with budget in the loop (`fpa_bloop`).
The evaluation of a trained run is kept in the results file and reused while its step is unchanged.
Writes results/bindings_lm.{json,md,png}.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments import recipes

MODULE = "experiments.bindings_lm"
# method -> config overrides (`experiments.recipes`: the LM gate for every gated method)
METHODS = recipes.BINDINGS_LM
POLICIES = ("fpa_budget", "window", "h2o")
GATED = ("fpa", "fox", "stack", "fpa_evict", "fpa_bloop", "fpa_recipe")


def policies(method: str, budgets: list[float]) -> list[tuple[str, dict]]:
  """(label, cached_logits kwargs) of every cache setting a method is scored under."""
  out = [("full", {"policy": "full"})]
  for b in budgets:
    for p in POLICIES:
      if p == "fpa_budget" and method not in GATED:
        continue
      out.append((f"{p} {100 * b:g}%", {"policy": p, "budget": b}))
  return out


def study_config(method: str, args, seed: int, vocab: int):
  """The trainer config of (`method`, `seed`) on the generator's programs (`vocab` tokens)."""
  run = {
    "task": "synthetic",
    "seq_len": args.train_len,
    "batch_size": args.batch_size,
    "steps": args.steps,
    "warmup_steps": min(50, args.steps),
    "lr": args.lr,
    "seed": seed,
    "log_every": 50,
    "ckpt_every": args.ckpt_every,
  }
  return U.study_config(U.study_model(args, vocab_size=vocab, block_size=32), run, METHODS[method])


def eval_programs(length: int, n: int, seed: int = 123) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """n held-out programs of `length` tokens -> tokens [n, length], is_query / is_far bool [n, length - 1]
  (over next-token pairs: the input is a queried NAME; far: its answer lies > length / 8 back)."""
  from fpa_jax.data import bindings as B

  rng = np.random.default_rng(seed)
  exs = [B.generate(rng, B.BindingsConfig(length=length)) for _ in range(n)]
  toks = np.stack([e["tokens"] for e in exs])
  is_q = np.zeros(toks.shape, bool)
  far = np.zeros(toks.shape, bool)
  for b, e in enumerate(exs):
    is_q[b, e["query_pos"]] = True
    far[b, e["query_pos"]] = e["query_pos"] - e["answer_pos"] > length // 8
  return toks, is_q[:, :-1], far[:, :-1]


def score(model, toks: np.ndarray, is_q: np.ndarray, far: np.ndarray, **policy) -> tuple[dict, dict]:
  """Decode `eval_programs` output under one cache policy (`cached_logits` kwargs) -> ({acc, far,
  near, n, n_far, cache_fraction}, the decode's stats)."""
  from fpa_jax.inference import cached_logits

  logits, st = cached_logits(model, toks, **policy)
  ok = np.argmax(np.asarray(logits)[:, :-1], -1) == toks[:, 1:]
  cell = {
    "acc": float(ok[is_q].mean()),
    "far": float(ok[far].mean()),
    "near": float(ok[is_q & ~far].mean()),
    "n": int(is_q.sum()),
    "n_far": int(far.sum()),
    "cache_fraction": float(st["cache_fraction"]),
  }
  return cell, st


def evaluate(model, method: str, args, log) -> dict:
  """{multiple: {label: {acc, far, near, n, n_far, cache_fraction}}} for one trained model."""
  out = {}
  for mult in args.multiples:
    toks, is_q, far = eval_programs(mult * args.train_len, args.n_eval)
    cells = {label: score(model, toks, is_q, far, **kw)[0] for label, kw in policies(method, args.budgets)}
    log(f"[bindings_lm] {method} {mult}x: " + ", ".join(f"{k} {v['acc']:.3f}" for k, v in cells.items()))
    out[str(mult)] = cells
  return out


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


def _stat(res: dict, method: str, mult: str, label: str, key: str = "acc") -> list[float]:
  return [e[mult][label][key] for e in res[method]["evals"] if label in e.get(mult, {})]


FPA_ROWS = ("fpa", "fpa_evict", "fpa_bloop", "fpa_recipe")  # the FPA models the compression targets are checked on


def summarise(res: dict) -> dict:
  """The compression targets at 4x (or the largest multiple under 4x), per FPA row (`FPA_ROWS`): its rule
  at 12.5% vs its full cache, window / h2o on the same models at 12.5%, FPA vs FoX with the full
  cache (means over seeds). Keys `{row}_full`, `{row}_rule`, `{row}_window`, `{row}_h2o`, `fox_full`."""
  mults = res["recipe"]["multiples"]
  m = "4" if 4 in mults else str(max(mults))

  def mean(meth: str, label: str) -> float | None:
    xs = _stat(res, meth, m, label) if meth in res else []
    return float(np.mean(xs)) if xs else None

  s = {"multiple": int(m)}
  for row in (r for r in FPA_ROWS if r in res):
    s.update(
      {
        f"{row}_full": mean(row, "full"),
        f"{row}_rule": mean(row, "fpa_budget 12.5%"),
        f"{row}_window": mean(row, "window 12.5%"),
        f"{row}_h2o": mean(row, "h2o 12.5%"),
        f"{row}_seeds": len(res[row]["evals"]),
      }
    )
  if "fox" in res:
    s["fox_full"] = mean("fox", "full")
  return s


def claims(s: dict) -> list[str]:
  pts = lambda x: f"{100 * x:.1f}"  # noqa: E731
  out = []
  k = s["multiple"]
  for row in FPA_ROWS:
    if s.get(f"{row}_rule") is None:
      continue
    name = f"`{row}` ({s[f'{row}_seeds']} seeds)"
    gap = s[f"{row}_full"] - s[f"{row}_rule"]
    line = (
      f"{name}: the learned rule at 12.5% of the cache, {k}x: {pts(s[f'{row}_rule'])} vs its full cache "
      f"{pts(s[f'{row}_full'])} ({pts(abs(gap))} points {'below' if gap > 0 else 'above'}; target: at most 1 below, "
      f"{'holds' if gap <= 0.01 else 'NOT met'})"
    )
    for p in ("window", "h2o"):
      d = s[f"{row}_rule"] - s[f"{row}_{p}"]
      line += f"; {p} {pts(s[f'{row}_{p}'])}, {pts(d)} points below the rule (target >= 10: {'holds' if d >= 0.10 else 'NOT met'})"
    if s.get("fox_full") is not None:
      d = s[f"{row}_full"] - s["fox_full"]
      line += f"; full cache vs FoX {pts(s['fox_full'])}: {'ahead' if d > 0 else 'NOT ahead'} by {pts(d)} points"
    out.append(line + ".")
  return out


def markdown(res: dict) -> str:
  r = res["recipe"]
  mults = [str(m) for m in r["multiples"]]
  head = (
    f"`python -m {MODULE}` (commands in bindings_lm.json): 2-layer LMs (d_model {r['d_model']}, {r['heads']} heads) "
    f"trained {r['steps']} steps at L={r['train_length']} on `fpa_jax.data.bindings`; decoded token by token on "
    f"{r['n_eval']} held-out programs per length. Accuracy on every query (mean ± std over seeds; far: answer more "
    "than length / 8 back, which a window of 12.5% cannot hold). Budgets are fractions of each sequence's keys, "
    "per layer and head.\n\n"
  )
  rows = []
  for meth in (m for m in METHODS if m in res):
    for label, _ in policies(meth, r["budgets"]):
      cells = []
      for m in mults:
        xs = _stat(res, meth, m, label)
        cells.append(f"{np.mean(xs):.3f} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0:.3f}" if xs else "—")
      far = _stat(res, meth, "4" if "4" in mults else mults[-1], label, "far")
      rows.append([meth, label, len(res[meth]["evals"]), *cells, f"{np.mean(far):.3f}" if far else "—"])
  far_col = f"far queries @ {'4' if '4' in mults else mults[-1]}x"
  table = U.md_table(
    ["method", "cache", "seeds", *[f"{m}x" for m in mults], far_col], rows, align="ll" + "r" * (len(mults) + 2)
  )
  return head + table + "\n\n" + "\n".join(f"- {c}" for c in claims(res["summary"])) + "\n"


def plot(res: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  mults = res["recipe"]["multiples"]
  fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
  for meth in (m for m in METHODS if m in res):
    ys = [np.mean(_stat(res, meth, str(m), "full")) for m in mults]
    axes[0].plot(mults, ys, marker="o", label=meth)
  axes[0].set_title("full cache", fontsize=9)
  for row, style in zip((r for r in FPA_ROWS if r in res), ("-", "--", ":")):
    for n, label in enumerate(
      lab for lab, _ in policies(row, res["recipe"]["budgets"]) if "12.5" in lab or lab == "full"
    ):
      ys = [np.mean(_stat(res, row, str(m), label)) for m in mults]
      axes[1].plot(mults, ys, style, color=f"C{n}", marker="o", label=f"{row}: {label}")
  axes[1].set_title("FPA models, 12.5% of the cache", fontsize=9)
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(mults, [f"{m}x" for m in mults])
    ax.set_xlabel("length / training length")
    ax.set_ylabel("query accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(res: dict, out_dir: Path) -> None:
  res["summary"] = summarise(res)
  U.write_study(out_dir, "bindings_lm", res, markdown, plot)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Claims: this study's rows of the README's claims table (`experiments.report` collects them)
# ------------------------------------------------------------------------------------------------


def _bindings(doc) -> str:
  if doc is None:
    return "not run yet (`python -m experiments.bindings_lm`)"
  seeds = {m: len(doc[m]["evals"]) for m in U.result_methods(doc) if "evals" in doc[m]}
  return (
    "query accuracy on nested bindings (seeds: "
    + ", ".join(f"{m} {n}" for m, n in seeds.items())
    + "): "
    + " ".join(claims(doc["summary"]))
  )


BINDINGS_RECIPE = "fpa_evict"  # the recipe the quickstart and notebook 03 train


def _bindings_row(root: Path) -> tuple[str, str]:
  doc = U.load_result(root, "bindings_lm")
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
  return U.seed_verdict(ok), (
    f"`{BINDINGS_RECIPE}` at {k}x, learned rule at 12.5% of the cache, by seed: {pts(g for g, _ in gaps)} "
    f"points vs the full cache, {pts(h for _, h in gaps)} over h2o (target: within 1; >= 10 over window and h2o)"
  )


def claim_rows(root: Path = U.ROOT) -> list[U.ClaimRow]:
  """The nested-bindings claim on `BINDINGS_RECIPE`, judged seed by seed, with every method's summary."""
  return [
    U.ClaimRow(
      "Nested bindings beyond the training length, kept by the learned rule at 12.5% of the cache",
      *_bindings_row(root),
      "docs/results/bindings_lm.md",
      (
        "FPA LMs keep nested structure beyond the training length, and a cache cut by the learned rule keeps it",
        _bindings(U.load_result(root, "bindings_lm")),
      ),
    )
  ]


def parse_args(argv=None):
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--train-len", type=int, default=128)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--batch-size", type=int, default=16)
  ap.add_argument("--steps", type=int, default=3000)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--ckpt-every", type=int, default=500)
  ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.125])
  ap.add_argument("--n-eval", type=int, default=16, help="held-out programs per length")
  ap.add_argument("--runs-dir", default="runs/bindings_lm")
  ap.add_argument("--out-dir", default="results")
  ap.add_argument("--report-only", action="store_true", help="re-render the .md/.png from the JSON, train nothing")
  return ap.parse_args(argv)


def recipe_of(args) -> dict:
  keys = ("train_len", "layers", "d_model", "heads", "batch_size", "steps", "lr", "multiples", "budgets", "n_eval")
  rec = {k: getattr(args, k) for k in keys}
  rec["train_length"] = rec.pop("train_len")
  return rec


def main(argv=None) -> dict:
  from fpa_jax.data.bindings import BindingsLM

  args = parse_args(argv)
  out_dir = Path(args.out_dir)
  if args.report_only:
    res = U.read_json(out_dir / "bindings_lm.json")
    if res is None:
      raise SystemExit(f"{out_dir}/bindings_lm.json not found: run python -m {MODULE} first")
    write_outputs(res, out_dir)
    return res
  log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
  t0 = time.perf_counter()
  recipe = recipe_of(args)
  tag = f"L{args.train_len}_l{args.layers}d{args.d_model}h{args.heads}_b{args.batch_size}_lr{args.lr:g}_T{args.steps}"
  for method in args.methods:
    res = U.read_json(out_dir / "bindings_lm.json", {})
    if res.get("recipe") != recipe:
      res = {}
    entry = res.get(method, {"seeds": [], "evals": [], "steps": [], "train_wall_s": [], "workdirs": []})
    for seed in args.seeds:
      data = BindingsLM(seq_len=args.train_len, batch_size=args.batch_size, seed=seed)
      workdir = os.path.join(args.runs_dir, tag, f"{method}_s{seed}")
      tr = U.train_lm(study_config(method, args, seed, data.vocab_size), workdir, data)
      i = entry["seeds"].index(seed) if seed in entry["seeds"] else None
      if i is not None and entry["steps"][i] == tr["step"]:
        continue  # scored at this step already
      ev = evaluate(tr["model"], method, args, log)
      vals = {"seeds": seed, "evals": ev, "steps": tr["step"], "train_wall_s": tr["train_wall_s"], "workdirs": workdir}
      for k, v in vals.items():
        if i is None:
          entry[k].append(v)
        else:
          entry[k][i] = v
    entry.update(config=tr["init_config"], command=U.command(MODULE, argv), commit=U.git_commit())
    res = U.read_json(out_dir / "bindings_lm.json", {})  # merge with methods other invocations wrote
    if res.get("recipe") != recipe:
      res = {}
    res.update({method: entry, "recipe": recipe, "meta": U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0)})
    write_outputs(res, out_dir)
  return U.read_json(out_dir / "bindings_lm.json")


if __name__ == "__main__":
  main()
