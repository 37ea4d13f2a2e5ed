"""One recipe, one model, every claim: the recommended FPA recipe and FoX trained from scratch seed by
seed on one data mix at one step budget, then the same checkpoints scored on every claim.

    python -m experiments.one_recipe --phase train --methods fox recipe_late_fh0 --seeds 0 1 2   # resumable
    python -m experiments.one_recipe --phase eval --methods fox recipe_late_fh0 --seeds 0 1 2    # per cell
    python -m experiments.one_recipe --phase report                                             # tables

The methods are `experiments.recipes.ONE_RECIPE` (the candidates and their ablations); the verdicts
judge `--claims-method` (the recipe) against `fox`, and the recipe with the evictability objective
(`--objective-methods`, each setting) against the recipe.

Training: small byte LMs (2 layers, d_model 128, 4 heads) at L=512 on the passkey study's mix
(`experiments.passkey.PasskeyTextMix`: 6 passkey prompts + 2 `fpa_text` rows per batch of 8, answer
tokens weighted 100), lr 2e-3 after a 50-step warmup, cosine to a tenth over the whole budget (the
passkey study's constant lr left FoX wavering below competence on 3 of 5 seeds). Every method trains
the full budget (no early stop: the claims are scored on same-step checkpoints); the 1x validation
exact match after each stage gives the pace (first stage >= `--competence`), paired with FoX by seed.
Each (method, seed) writes `<out-dir>/train/<method>_s<seed>.json` when a stage ends, so parallel
invocations on other (method, seed) pairs never write the same file; the trainer resumes from
`<runs-dir>/<method>_s<seed>/checkpoints`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments.recipes import NO_OBJECTIVE, OBJECTIVE_METHODS, ONE_RECIPE, PRETRAIN

MODULE = "experiments.one_recipe"
METHODS = ONE_RECIPE
PHASES = ("train", "eval", "report")
# The cache cells: every policy at each kept fraction, in each prefill mode it supports (h2o ranks
# keys by the attention they received while decoding; snapkv ranks a prompt's keys by its last
# window's attention, so it needs the whole prompt at once).
BUDGETED = ("fpa_budget", "fpa_global", "window", "sink_window", "h2o", "snapkv")
HEURISTICS = ("window", "sink_window", "h2o", "snapkv")
NOT_IN = {"parallel": ("h2o",), "decode": ("snapkv",)}


def study_config(method: str, args, steps: int):
  """The trainer config of `method` trained to `steps` of the `--steps` budget (one schedule whatever
  the stage: the cosine horizon is the budget)."""
  run = U.study_run(
    args, task="passkey", steps=steps, seed=args.seed, lr_decay_steps=args.steps, min_lr_ratio=args.min_lr_ratio
  )
  return U.study_config(U.study_model(args), run, METHODS[method])


def workdir(args, method: str, seed: int) -> Path:
  return Path(args.runs_dir) / f"{method}_s{seed}"


def train_path(args, method: str, seed: int) -> Path:
  return Path(args.out_dir) / "train" / f"{method}_s{seed}.json"


def train_one(method: str, seed: int, args, argv, log) -> dict:
  """Train (method, seed) in stages of `--stage-steps` to `--steps`, validating at 1x after each."""
  from experiments.passkey import DEPTHS, eval_batch
  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.eval import passkey_cell

  args = argparse.Namespace(**{**vars(args), "seed": seed})
  wd = workdir(args, method, seed)
  val_path = wd / "study_val.json"
  val = U.read_json(val_path, {})  # step -> {"exact", "digit"}, kept across sessions
  per = max(1, args.n_val // len(DEPTHS))  # validation keys: not the test prompts' (seed 0)
  val_exs = [e for d in DEPTHS for e in passkey_eval_examples(args.train_len, 1, d, n=per, seed=1000 + seed)]
  out, steps = None, 0
  while steps < args.steps:
    steps = min(steps + args.stage_steps, args.steps)
    if str(steps) in val and steps < args.steps and (wd / "checkpoints").exists():
      continue  # scored by an earlier session: the trainer resumes from the last checkpoint
    out = U.train_lm(study_config(method, args, steps), str(wd), train_data(args, seed), progress_bar=False)
    if str(steps) not in val:
      c = passkey_cell(out["model"], val_exs, length=args.train_len, batch_size=eval_batch(args.train_len, args.n_val))
      val[str(steps)] = {"exact": float(c["accuracy"]), "digit": float(c["digit_accuracy"])}
      U.write_json(val_path, val)
    hist = out["history"]
    log(
      f"[one_recipe] {method} seed {seed}: step {steps}/{args.steps}, val 1x exact "
      f"{val[str(steps)]['exact']:.3f}, train wall {out['train_wall_s']:.0f} s"
      + (f", loss {hist[-1]['loss']:.3f}" if hist else "")
    )
    rec = {
      "method": method,
      "seed": seed,
      "steps": steps,
      "budget": args.steps,
      "val_history": {k: val[k] for k in sorted(val, key=int) if int(k) <= steps},
      "first_competent": first_competent(val, args.competence),
      "competence": args.competence,
      "train_wall_s": out["train_wall_s"],
      "sessions": out["sessions"],
      "workdir": str(wd),
      "config": out["init_config"],
      "recipe": recipe(args),
      "command": U.command(MODULE, argv),
      "commit": U.git_commit(),
      "machine": U.machine(),
    }
    U.write_json(train_path(args, method, seed), rec)
  return U.read_json(train_path(args, method, seed))


def train_data(args, seed: int):
  """The study's training mix (passkey rows + text rows, answer tokens weighted) for `seed`."""
  from experiments.passkey import PasskeyTextMix

  return PasskeyTextMix(
    data_dir=args.data_dir,
    seq_len=args.train_len,
    batch_size=args.batch_size,
    n_passkey=args.passkey_rows,
    answer_weight=args.answer_weight,
    seed=seed,
    small=args.small_data,
  )


def first_competent(val: dict, competence: float) -> int | None:
  """The first validated step whose 1x exact match reaches `competence`, or None."""
  hits = [int(k) for k, v in val.items() if v["exact"] >= competence]
  return min(hits) if hits else None


def recipe(args) -> dict:
  keys = (
    "train_len", "layers", "d_model", "heads", "batch_size", "passkey_rows", "answer_weight",
    "lr", "min_lr_ratio", "warmup", "steps", "stage_steps", "competence", "n_val",
  )  # fmt: skip
  return {k: getattr(args, k) for k in keys}


# ------------------------------------------------------------------------------------------------
# Evaluation: the same final checkpoints on every claim
# ------------------------------------------------------------------------------------------------


def eval_path(args, method: str, seed: int) -> Path:
  return Path(args.out_dir) / "eval" / f"{method}_s{seed}.json"


def cache_cells(args) -> list[tuple[str, str, str, dict]]:
  """(prefill, policy, budget label, policy keywords) of every cache cell at `--cache-multiple`."""
  out = []
  for pre in args.prefills:
    out.append((pre, "full", "1", {}))
    out.append((pre, "fpa", "tol", {"tolerance": args.tolerance}))
    out += [(pre, p, f"{b:g}", {"budget": b}) for b in args.budgets for p in args.policies if p not in NOT_IN[pre]]
  return out


def eval_one(method: str, seed: int, args, argv, log) -> dict | None:
  """Score (method, seed)'s final checkpoint on each claim; resumable cell by cell (a part already in
  `eval/<method>_s<seed>.json` for this checkpoint's step is not recomputed)."""
  from experiments import perplexity
  from experiments.forget_speed import prefill_seconds, with_skip
  from experiments.passkey import DEPTHS
  from fpa_jax import eval as ev
  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.inference import load_model

  tr = U.read_json(train_path(args, method, seed))
  if not tr or tr["steps"] < tr["budget"]:
    log(f"[one_recipe] {method} seed {seed}: not trained to its budget yet, not evaluated")
    return None
  path = eval_path(args, method, seed)
  fresh = lambda: {"method": method, "seed": seed, "step": tr["steps"]}
  res = U.read_json(path, {})
  if res.get("step") != tr["steps"]:
    res = fresh()  # a new checkpoint: score it afresh
  model, _ = load_model(tr["workdir"])
  L = args.train_len
  ns = argparse.Namespace(**{**vars(args), "eval_batch": 16})

  def save(part: str, value) -> None:
    res[part] = value
    res.update(command=U.command(MODULE, argv), commit=U.git_commit(), machine=U.machine())
    U.write_json(path, res)

  def held_out() -> dict:  # bits per byte over the trainer's windows of every validation document
    held, coverage = perplexity.heldout_batches(ns)
    return {"bpb": perplexity.bits_per_byte(perplexity.nll_fn(model), held), "heldout": coverage}

  # Cells are kept only for the parameters that scored them (a rerun after runs/ was lost retrains
  # the checkpoint: kept if bit-identical). Files from before the digest adopt the checkpoint only
  # if it reproduces their held-out bits per byte.
  digest = U.params_digest(model)
  if res.get("params", digest) != digest:
    log(f"[one_recipe] {method} seed {seed}: another checkpoint at step {tr['steps']}, scored afresh")
    res = fresh()
  if "params" not in res and "text" in res:
    text = held_out()
    bpb = text["bpb"]
    same = abs(bpb - res["text"]["bpb"]) <= 1e-5 * abs(res["text"]["bpb"])
    log(
      f"[one_recipe] {method} seed {seed}: held-out bpb {bpb:.6f} vs the file's {res['text']['bpb']:.6f}: "
      + ("its cells kept" if same else "another checkpoint, scored afresh")
    )
    if not same:
      res = fresh() | {"text": text}
  if res.get("params") != digest:
    save("params", digest)
  if "text" not in res:
    save("text", held_out())
    log(f"[one_recipe] {method} seed {seed}: held-out bpb {res['text']['bpb']:.4f}")
  if "positions" not in res:  # loss by position out to 8L on the long validation documents
    docs = perplexity.long_documents(ns)
    lp = ev.loss_by_position(model, docs, bucket=args.pos_bucket, batch_size=4, show_progress=False)
    save("positions", {k: lp[k] for k in ("buckets", "nll", "bucket_tokens", "rows")})
  pk = res.get("passkey", {})
  for m in args.multiples:  # full cache, teacher-forced (= greedy decoding), n prompts over 5 depths
    if str(m) not in pk:
      exs = [e for d in DEPTHS for e in passkey_eval_examples(L, m, d, n=args.n // len(DEPTHS), seed=0)]
      c = ev.passkey_cell(model, exs, length=m * L, batch_size=ev.eval_batch(m * L, len(exs)))
      pk[str(m)] = {k: c[k] for k in ("n", "correct", "accuracy", "ci95")}
      save("passkey", pk)
      log(f"[one_recipe] {method} seed {seed}: passkey {m}x {c['accuracy']:.3f}")
  M = args.cache_multiple
  needle = res.get("needle", {})
  for m in sorted({1, M}):  # why retrieval holds or fails at length: the gate's penalty on the needle, per head
    if args.needle_prompts and not all("passkey_rank" in r for r in needle.get(str(m), [{}])):
      from experiments.needle_penalty import needle_stats

      per = max(1, args.needle_prompts // len(DEPTHS))
      needle[str(m)] = needle_stats(model, [e for d in DEPTHS for e in passkey_eval_examples(L, m, d, n=per, seed=0)])
      save("needle", needle)
  exs = [e for d in DEPTHS for e in passkey_eval_examples(L, M, d, n=args.n // len(DEPTHS), seed=0)]
  cache = res.get("cache", {})
  for pre, pol, lab, kw in cache_cells(args):
    key = f"{pre}/{pol}/{lab}"
    # the tolerance policy's mean share kept (not only its fullest head's peak): a parallel-prefill
    # cell from before it was recorded is scored again (~1 min; the decode one would take ~10)
    if key not in cache or (key == "parallel/fpa/tol" and "kept_fraction_mean" not in cache[key]):
      t = time.perf_counter()
      c = ev.passkey_cell(model, exs, policy=pol, prefill=pre, batch_size=args.cache_batch, **kw)
      keep = ("n", "correct", "accuracy", "ci95", "cache_fraction", "overflow")
      keep += ("kept_fraction_mean", "kept_fraction_per_layer") * (pol == "fpa" and pre == "parallel")
      cache[key] = {k: c.get(k) for k in keep}
      cache[key]["wall_s"] = round(time.perf_counter() - t, 1)
      save("cache", cache)
      log(f"[one_recipe] {method} seed {seed}: {M}x {key} {c['accuracy']:.3f} ({cache[key]['wall_s']:.0f} s)")
  if args.speed and "prefill_speed" not in res:  # skip="keys" at the learned rule's bound, 8x prompts
    import jax.numpy as jnp

    four = [exs[i * len(exs) // 4] for i in range(4)]  # needles at spread depths
    cut = min(len(e["tokens"]) for e in four)
    toks = jnp.asarray(np.stack([e["tokens"][:cut] for e in four]).astype(np.int32))
    exact = prefill_seconds(with_skip(model, None), toks, 3)
    keys = prefill_seconds(with_skip(model, args.skip_eps, "keys"), toks, 3)
    save("prefill_speed", {"eps": args.skip_eps, "tokens": int(cut), "exact_s": exact, "keys_s": keys})
  return res


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def load_train(out_dir: Path) -> dict[tuple[str, int], dict]:
  runs = {}
  for p in sorted((out_dir / "train").glob("*.json")):
    r = U.read_json(p)
    runs[(r["method"], int(r["seed"]))] = r
  return runs


def pace_markdown(runs: dict[tuple[str, int], dict]) -> str:
  """Steps to 1x competence per (method, seed), paired with FoX by seed."""
  if not runs:
    return "No run has finished a stage yet (`python -m experiments.one_recipe --phase train`).\n"
  seeds = sorted({s for _, s in runs})
  methods = [m for m in METHODS if any(k[0] == m for k in runs)]

  def cell(r):
    if r is None:
      return "not run"
    done = r["steps"] >= r["budget"]
    at = "" if done else f" (at {r['steps']} of {r['budget']})"
    if r["first_competent"] is not None:
      return f"{r['first_competent']}{at}"
    best_k = max(r["val_history"], key=lambda k: r["val_history"][k]["exact"])
    best = f"best {r['val_history'][best_k]['exact']:.3f} at {best_k}"
    return f"not in {r['budget']} ({best})" if done else f"not yet{at}, {best}"

  rows = []
  for m in methods:
    paired, n = 0, 0
    for s in seeds:
      r, f = runs.get((m, s)), runs.get(("fox", s))
      if m != "fox" and r and f and r["steps"] >= r["budget"] and f["steps"] >= f["budget"]:
        n += 1
        fc, rc = f["first_competent"], r["first_competent"]
        paired += rc is not None and (fc is None or rc <= fc)
    rows.append([f"`{m}`", *[cell(runs.get((m, s))) for s in seeds], "—" if m == "fox" else f"{paired} of {n}"])
  comp = next(iter(runs.values()))["competence"]
  head = (
    f"Steps to 1x validation exact match >= {comp} (first 300-step stage), each run to its full budget; "
    "'<= FoX' counts the finished seeds where the method is competent no later than FoX of the same seed.\n\n"
  )
  return head + U.md_table(["method", *[f"seed {s}" for s in seeds], "<= FoX (paired)"], rows) + "\n"


def pace_plot(runs: dict[tuple[str, int], dict], path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.6))
  colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
  for (m, s), r in sorted(runs.items()):
    ks = sorted(r["val_history"], key=int)
    ax.plot([int(k) for k in ks], [r["val_history"][k]["exact"] for k in ks], color=colors[m], alpha=0.8,
            label=m if s == min(ss for mm, ss in runs if mm == m) else None)  # fmt: skip
  ax.axhline(next(iter(runs.values()))["competence"], color="k", lw=0.6, ls=":")
  ax.set_xlabel("step")
  ax.set_ylabel("1x validation exact match")
  ax.set_title("passkey pace, one line per seed", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def load_eval(out_dir: Path) -> dict[tuple[str, int], dict]:
  return {(r["method"], int(r["seed"])): r for r in map(U.read_json, sorted((out_dir / "eval").glob("*.json")))}


def _acc(c: dict | None) -> str:
  return "—" if c is None else f"{c['accuracy']:.2f}"


def _cell(e: dict, key: str) -> dict | None:
  return e.get("cache", {}).get(key)


def results_table(runs: dict, evals: dict, budgets: list[str]) -> str:
  """One row per (method, seed): pace, held-out bpb (and vs FoX of the seed), passkey with the full
  cache, and the learned rule against the best heuristic at each budget (parallel prefill)."""
  rows = []
  for (m, s), e in sorted(evals.items(), key=lambda kv: (list(METHODS).index(kv[0][0]), kv[0][1])):
    fox = evals.get(("fox", s))
    bpb = e.get("text", {}).get("bpb")
    rel = f"{100 * (bpb / fox['text']['bpb'] - 1):+.2f}%" if bpb and fox and fox.get("text") and m != "fox" else "—"
    r = runs.get((m, s), {})
    row = [f"`{m}`", s, r.get("first_competent") or "no", f"{bpb:.4f}" if bpb else "—", rel]
    row += [_acc(e.get("passkey", {}).get(str(k))) for k in (1, 2, 4, 8)]
    for b in budgets:
      learned = _cell(e, f"parallel/fpa_budget/{b}")
      heur = [c for h in HEURISTICS if (c := _cell(e, f"parallel/{h}/{b}"))]
      row += [_acc(learned), "—" if not heur else f"{max(c['accuracy'] for c in heur):.2f}"]
    rows.append(row)
  heads = ["method", "seed", "competent at", "bpb", "vs FoX", "1x", "2x", "4x", "8x"]
  for b in budgets:
    heads += [f"8x fpa_budget {float(b):.1%}", "best heuristic"]
  return U.md_table(heads, rows)


def speed_table(evals: dict) -> str:
  """Per (method, seed): the jitted prefill of 8x prompts with `skip="keys"` at the learned rule's
  bound (each row loses <= eps of its attention) against the exact kernel, medians of 3."""
  rows = [
    [f"`{m}`", s, p["tokens"], f"{p['eps']:g}", f"{p['exact_s']:.3f}", f"{p['keys_s']:.3f}", f"{p['exact_s'] / p['keys_s']:.2f}x"]
    for (m, s), e in sorted(evals.items())
    if (p := e.get("prefill_speed"))
  ]  # fmt: skip
  return U.md_table(["method", "seed", "tokens", "eps", "exact s", "keys s", "speed-up"], rows) + "\n"


def compression_table(evals: dict, prefill: str = "parallel") -> str:
  """kvpress's axis: each policy's 8x score (mean over seeds) by fraction *removed*, and the smallest
  kept fraction whose score is within 1 point of the full cache's on every seed."""
  rows = []
  for m in METHODS:
    es = [e for (mm, _), e in sorted(evals.items()) if mm == m and e.get("cache")]
    if not es:
      continue
    buds = sorted({float(k.split("/")[2]) for e in es for k in e["cache"] if k.split("/")[2] not in ("1", "tol")})
    for pol in BUDGETED:
      if pol in NOT_IN[prefill]:
        continue
      cells = {b: [_cell(e, f"{prefill}/{pol}/{b:g}") for e in es] for b in buds}
      if not any(c for cs in cells.values() for c in cs):
        continue
      fulls = [_cell(e, f"{prefill}/full/1") for e in es]
      ok = [
        b for b in buds
        if all(c and f and c["accuracy"] >= f["accuracy"] - 0.01 for c, f in zip(cells[b], fulls))
      ]  # fmt: skip
      row = [f"`{m}`", pol, len(es)]
      for b in sorted(buds, reverse=True):  # mean over the seeds scored so far (their count if not all)
        got = [c["accuracy"] for c in cells[b] if c]
        row.append("—" if not got else f"{np.mean(got):.2f}" + ("" if len(got) == len(es) else f" ({len(got)} seeds)"))
      rows.append(row + [f"{min(ok):g}" if ok else "none evaluated"])
  if not rows:
    return "No cache cell evaluated yet.\n"
  buds = sorted({float(k.split("/")[2]) for e in evals.values() for k in e.get("cache", {}) if k.split("/")[2] not in ("1", "tol")}, reverse=True)  # fmt: skip
  heads = ["method", "policy", "seeds", *[f"removed {1 - b:g}" for b in buds], "smallest kept within 1 pt of full"]
  return U.md_table(heads, rows) + "\n"


def bindings_verdict(res: dict) -> dict:
  """The nested-bindings claim from `experiments.bindings_lm`'s results (its `fpa_recipe` row: the
  recommended recipe, unchanged): per seed at 4x, fpa_budget at 12.5% within 1 point of the full
  cache and >= 10 points above h2o at 12.5%."""
  claim = {
    "claim": "nested bindings at 4x with the same recipe",
    "target": "the rule at 12.5% within 1 point of full and >= 10 above h2o, every seed",
    "link": "results/bindings_lm.md",
  }
  row = res.get("fpa_recipe")
  if not row or not row.get("evals"):
    return {**claim, "verdict": "not run", "evidence": "python -m experiments.bindings_lm --methods fpa_recipe"}
  ok, ev = [], []
  for seed, e in zip(row["seeds"], row["evals"]):
    c = e.get("4", {})
    if not all(k in c for k in ("full", "fpa_budget 12.5%", "h2o 12.5%")):
      continue
    full, rule, h2o = (c[k]["acc"] for k in ("full", "fpa_budget 12.5%", "h2o 12.5%"))
    ok.append(full - rule <= 0.01 and rule - h2o >= 0.10)
    ev.append(f"seed {seed}: rule {100 * rule:.1f} vs full {100 * full:.1f}, h2o {100 * h2o:.1f}")
  return {**claim, "verdict": U.seed_verdict(ok), "evidence": ", ".join(ev)}


def objective_verdict(evals: dict, recipe_m: str, objective_ms: tuple[str, ...]) -> dict:
  """The evictability objective's text cost: each setting in `objective_ms` (the recipe plus the
  objective) against the recipe by seed. Holds when one setting costs <= +0.5% bits per byte on
  every seed the recipe was scored on (a setting run on fewer seeds cannot hold); the evidence also
  gives each run's passkey at 8x (what the objective did to retrieval beyond the training length)."""
  claim = {
    "claim": "the objective's text cost",
    "target": f"bpb <= +0.5% against `{recipe_m}` (the recipe without it), by seed",
    "link": "results/one_recipe/one_recipe.md",
  }
  ok: dict[str, list[bool]] = {}
  ev = []
  for om in objective_ms:
    for (m, s), e in sorted(evals.items()):
      a, b = e.get("text"), evals.get((recipe_m, s), {}).get("text")
      if m != om or om == recipe_m or not (a and b):
        continue
      c = a["bpb"] / b["bpb"] - 1
      ok.setdefault(om, []).append(c <= 0.005)
      p8 = e.get("passkey", {}).get("8", {}).get("accuracy")
      ev.append(f"`{om}` seed {s}: {100 * c:+.2f}%" + ("" if p8 is None else f" (8x {p8:.2f})"))
  if not ok:
    return {**claim, "verdict": "not run", "evidence": ""}
  need = len({s for m, s in evals if m == recipe_m})
  good = [om for om, v in ok.items() if all(v) and len(v) >= need]
  n = sum(map(len, ok.values()))
  verdict = f"holds (`{good[0]}`)" if good else f"not met (0 of {len(ok)} settings, {n} runs)"
  return {**claim, "verdict": verdict, "evidence": ", ".join(ev)}


def verdicts(
  runs: dict,
  evals: dict,
  recipe_m: str,
  objective_ms: tuple[str, ...] = (),
  bindings: dict | None = None,
  baseline_m: str | None = None,
) -> list[dict]:
  """The targets as written, every seed paired with FoX: holds / k of n seeds / not run. The
  objective's cost: each of `objective_ms` against `baseline_m` (the recipe without the objective;
  default `recipe_m`)."""
  link = "results/one_recipe/one_recipe.md"
  seeds = sorted(s for (m, s) in evals if m == recipe_m and ("fox", s) in evals)
  out = []

  def claim(name: str, target: str, per_seed: dict[int, bool | None], evidence: str) -> None:
    verdict = U.seed_verdict([v for v in per_seed.values() if v is not None])
    out.append({"claim": name, "target": target, "verdict": verdict, "evidence": evidence, "link": link})

  ev = {s: (evals[(recipe_m, s)], evals[("fox", s)]) for s in seeds}
  tr = {s: (runs.get((recipe_m, s), {}), runs.get(("fox", s), {})) for s in seeds}
  foxes = {s: r for (m, s), r in sorted(runs.items()) if m == "fox" and r["steps"] >= r["budget"]}
  claim(
    "FoX baseline competent at 1x on every seed",
    "FoX >= 0.99 1x validation within the budget",
    {s: r.get("first_competent") is not None for s, r in foxes.items()},
    ", ".join(f"seed {s}: {r.get('first_competent') or 'no'}" for s, r in foxes.items()),
  )
  pace = {
    s: r.get("first_competent") is not None and (f.get("first_competent") is None or r["first_competent"] <= f["first_competent"])
    for s, (r, f) in tr.items()
  }  # fmt: skip
  claim(
    "passkey pace: competent no later than FoX",
    "the recipe's first competent stage <= FoX's, by seed",
    pace,
    ", ".join(
      f"seed {s}: {tr[s][0].get('first_competent') or 'no'} vs {tr[s][1].get('first_competent') or 'no'}" for s in seeds
    ),
  )
  bpb = {
    s: (r["text"]["bpb"] <= f["text"]["bpb"]) if r.get("text") and f.get("text") else None for s, (r, f) in ev.items()
  }
  claim(
    "perplexity on par with FoX",
    "held-out bpb <= 1.00x FoX's, by seed",
    bpb,
    ", ".join(
      f"seed {s}: {100 * (r['text']['bpb'] / f['text']['bpb'] - 1):+.2f}%"
      for s, (r, f) in ev.items()
      if r.get("text") and f.get("text")
    ),
  )
  pos = [(s, r, f) for s, (r, f) in ev.items() if r.get("positions") and f.get("positions")]
  if len(pos) >= 2:  # paired relative gap per bucket: mean and s.e. over seeds
    rel = np.asarray(
      [np.asarray(r["positions"]["nll"], float) / np.asarray(f["positions"]["nll"], float) - 1 for _, r, f in pos]
    )
    mean, se = rel.mean(0), rel.std(0, ddof=1) / np.sqrt(len(rel))
    bad = [i for i in range(len(mean)) if mean[i] - 2 * se[i] > 0]
    bk = pos[0][1]["positions"]["buckets"]
    out.append({
      "claim": "perplexity by position to 8x",
      "target": "no position bucket worse than FoX by > 2 s.e. (paired over seeds)",
      "verdict": "holds" if not bad else f"not met ({len(bad)} of {len(mean)} buckets)",
      "evidence": "worst bucket " + f"{bk[int(np.argmax(mean))][0]}-{bk[int(np.argmax(mean))][1]}: {100 * mean.max():+.2f}% ± {100 * se[int(np.argmax(mean))]:.2f}% s.e., {len(pos)} seeds",
      "link": link,
    })  # fmt: skip
  else:
    out.append({"claim": "perplexity by position to 8x", "target": "no bucket worse by > 2 s.e.", "verdict": "not run (needs >= 2 seeds)", "evidence": "", "link": link})  # fmt: skip
  full8 = {
    s: r["passkey"]["8"]["accuracy"] >= 0.99 if "8" in r.get("passkey", {}) else None for s, (r, _) in ev.items()
  }
  claim(
    "passkey at 8x the training length",
    ">= 0.99 at 8x, full cache, by seed",
    full8,
    ", ".join(
      f"seed {s}: {r['passkey']['8']['accuracy']:.2f}" for s, (r, _) in ev.items() if "8" in r.get("passkey", {})
    ),
  )

  claim(
    "the only method with perfect passkey at 8x (the paper's word)",
    "the recipe >= 0.99 at 8x with the full cache and FoX below, by seed",
    {
      s: full8[s] and f["passkey"]["8"]["accuracy"] < 0.99 if full8[s] is not None and "8" in f.get("passkey", {}) else None
      for s, (_, f) in ev.items()
    },
    ", ".join(
      f"seed {s}: FoX {f['passkey']['8']['accuracy']:.2f}" for s, (_, f) in ev.items() if "8" in f.get("passkey", {})
    ),
  )  # fmt: skip

  def cache_ok(r: dict, f: dict) -> bool | None:
    mine = {b: _best_rule(r, "parallel", b) for b in ("0.25", "0.125")}
    if None in mine.values():
      return None
    others = [
      c["accuracy"] for pre in ("parallel", "decode") for h in HEURISTICS if (c := _cell(r, f"{pre}/{h}/0.125"))
    ]
    if (fox := _best_rule(f, "parallel", "0.125")) is not None:
      others.append(fox[1])
    return (
      mine["0.25"][1] >= 0.99 and mine["0.125"][1] >= 0.95 and bool(others) and mine["0.125"][1] - max(others) >= 0.1
    )

  claim(
    "passkey kept with the KV cache cut to 25% / 12.5%",
    ">= 0.99 at 25%, >= 0.95 at 12.5% under the learned rule (fpa_budget or fpa_global); every heuristic and "
    "FoX's best rule >= 0.1 below at 12.5%",
    {s: cache_ok(r, f) for s, (r, f) in ev.items()},
    ", ".join(
      f"seed {s}: {_rule_cells(r)}" + _tolerance_kept(r) + f"; FoX {_best_words(f)}" for s, (r, f) in ev.items()
    ),
  )
  out.append(objective_verdict(evals, baseline_m or recipe_m, objective_ms))
  out.append(bindings_verdict(bindings or {}))
  return out


def _rule_cells(e: dict) -> str:
  """fpa_budget at 25% / 12.5% (parallel prefill; the decode prefill's beside it once scored), then
  fpa_global's where scored."""
  pair = lambda pre, p: f"{_acc(_cell(e, f'{pre}/{p}/0.25'))} / {_acc(_cell(e, f'{pre}/{p}/0.125'))}"
  dec = _cell(e, "decode/fpa_budget/0.25") or _cell(e, "decode/fpa_budget/0.125")
  words = (
    "fpa_budget "
    + pair("parallel", "fpa_budget")
    + (f" (decode prefill {pair('decode', 'fpa_budget')})" if dec else "")
  )
  glob = _cell(e, "parallel/fpa_global/0.25") or _cell(e, "parallel/fpa_global/0.125")
  return words + (f", fpa_global {pair('parallel', 'fpa_global')}" if glob else "")


def shares_by_layer(per: list[float]) -> str:
  """ "0.30 / 0.76": a share kept per layer (lower first), as the studies' tables write it."""
  return " / ".join(f"{x:.2f}" for x in per)


def _tolerance_kept(e: dict) -> str:
  """Why a cut cache may fail: what the sound tolerance policy keeps: its mean share of the keys where
  recorded, else its fullest head's peak (near 1: the penalties rule out almost no key in that head,
  so a budget must evict keys the rule cannot tell apart)."""
  c = _cell(e, "parallel/fpa/tol")
  if c and c.get("kept_fraction_mean") is not None:
    per = c.get("kept_fraction_per_layer")
    layers = "" if not per else f": {shares_by_layer(per)} by layer"
    return f" (tolerance policy keeps {c['kept_fraction_mean']:.3f} of the keys on average{layers})"
  return (
    ""
    if not c or "cache_fraction" not in c
    else f" (tolerance policy: its fullest head keeps {c['cache_fraction']:.4f})"
  )


def _best_rule(e: dict, pre: str, b: str) -> tuple[str, float] | None:
  """The learned rule (fpa_budget or fpa_global) that keeps most passkeys at budget b: (name, accuracy)."""
  cells = [(p, c["accuracy"]) for p in ("fpa_budget", "fpa_global") if (c := _cell(e, f"{pre}/{p}/{b}"))]
  return max(cells, key=lambda x: x[1]) if cells else None


def _best_words(e: dict) -> str:
  """'best rule 1.00 / 0.60 (fpa_global)' at 25% / 12.5%, parallel prefill."""
  hi, lo = _best_rule(e, "parallel", "0.25"), _best_rule(e, "parallel", "0.125")
  if not (hi and lo):
    return "not scored"
  names = hi[0] if hi[0] == lo[0] else f"{hi[0]} / {lo[0]}"
  return f"best rule {hi[1]:.2f} / {lo[1]:.2f} ({names})"


def report(
  out_dir: Path,
  recipe_m: str = PRETRAIN,
  objective_ms: tuple[str, ...] = OBJECTIVE_METHODS,
  bindings_path: str = "results/bindings_lm.json",
  baseline_m: str = NO_OBJECTIVE,
) -> str:
  runs, evals = load_train(out_dir), load_eval(out_dir)
  md = (
    "# One recipe, seed by seed\n\n`python -m experiments.one_recipe` trains and scores every (method, seed); "
    "each run's command and commit are in `train/*.json` and `eval/*.json`.\n\n"
  )
  md += "## Passkey pace\n\n" + pace_markdown(runs)
  if evals:
    buds = sorted({k.split("/")[2] for e in evals.values() for k in e.get("cache", {})} - {"1", "tol"}, key=float, reverse=True)  # fmt: skip
    cov = next((e["text"].get("heldout") for e in evals.values() if e.get("text")), None)
    md += "\n## Every claim on the same checkpoints\n\n" + results_table(runs, evals, buds) + "\n"
    if cov:
      md += f"Held-out set: {json_words(cov)}.\n"
    md += "\n## Compression axis (kvpress: fraction removed), 8x, parallel prefill\n\n" + compression_table(evals)
    if any(k.startswith("decode/") for e in evals.values() for k in e.get("cache", {})):
      md += "\n### Decode prefill\n\n" + compression_table(evals, "decode")
    if any(e.get("prefill_speed") for e in evals.values()):
      md += "\n## Prefill with key skipping (`skip='keys'`), 8x prompts\n\n" + speed_table(evals)
    if any(e.get("needle") for e in evals.values()):
      md += "\n## Per head: the gate's penalty on the needle at the question\n\n" + needle_table(evals)
    v = verdicts(runs, evals, recipe_m, tuple(objective_ms), U.read_json(Path(bindings_path), {}), baseline_m)
    if any(m == recipe_m for m, _ in evals):  # the README's claims come from here once the recipe is scored
      U.write_json(out_dir / "claims.json", v)
    md += f"\n## Verdicts (`{recipe_m}` against `fox`, paired by seed)\n\n" + U.md_table(
      ["claim", "target", "verdict", "evidence"], [[c["claim"], c["target"], c["verdict"], c["evidence"]] for c in v]
    )
  (out_dir / "one_recipe.md").write_text(md)
  if runs:
    pace_plot(runs, out_dir / "one_recipe_pace.png")
    U.write_json(out_dir / "models.json", models_index(runs))
  return md


def models_index(runs: dict[tuple[str, int], dict]) -> dict:
  """The finished checkpoints in the forms the other studies read: `{method: {seeds, workdirs}}` (as
  `text_pareto --models` reads the perplexity study's file) and `{method_s<seed>: {workdir, steps}}`
  (as `evict_cost --passkey-results` reads the passkey study's), so both score these same models."""
  out: dict[str, dict] = {}
  for (m, s), r in sorted(runs.items()):
    if r["steps"] < r["budget"] or "workdir" not in r:
      continue
    e = out.setdefault(m, {"seeds": [], "workdirs": []})
    e["seeds"].append(s)
    e["workdirs"].append(r["workdir"])
    out[f"{m}_s{s}"] = {"workdir": r["workdir"], "steps": r["steps"]}
  return out


def needle_table(evals: dict) -> str:
  """Per (method, seed, layer, head): the needle's penalty and the question's attention mass on it at
  1x and at the cache multiple (`experiments.needle_penalty.needle_stats`, means over the prompts)."""
  rows = []
  for (m, s), e in sorted(evals.items()):
    nd = e.get("needle") or {}
    mults = sorted(nd, key=int)
    if len(mults) < 2:
      continue
    lo, hi = mults[0], mults[-1]
    for a, b in zip(nd[lo], nd[hi]):
      rank = "—" if "passkey_rank" not in b else f"{b['passkey_rank']:.3f}"
      rows.append([f"`{m}`", s, a["layer"], a["head"]] + [f"{x:.2f}" for x in (a["needle_penalty"], b["needle_penalty"], a["median_penalty"], b["median_penalty"], a["needle_mass"], b["needle_mass"])] + [rank])  # fmt: skip
  if not rows:
    return ""
  x = f"{hi}x"
  head = ["method", "seed", "layer", "kv head", "needle penalty 1x", f"... {x}", "median penalty 1x", f"... {x}"]
  return (
    U.md_table(head + ["needle mass 1x", f"... {x}", f"passkey kept at {x} from"], rows)
    + "\nneedle penalty: the least penalty over the needle sentence's tokens at the question (0 = live); "
    "needle mass: the attention the question's first query head of the group gives the needle (its penalty "
    "included). A head that retrieves at 1x and not at 8x shows where: a penalty grown with length, or the "
    "mass spread over more keys at the same penalty. passkey kept from: the smallest share of the prompt's "
    "keys that fpa_budget, cutting this head at the question, keeps with a whole copy of the passkey in it "
    "(smallest penalties first, ties the newer); a per-head cut below it loses a digit there.\n"
  )


def json_words(cov: dict) -> str:
  return ", ".join(f"{k} {v}" for k, v in cov.items())


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--phase", choices=PHASES, nargs="+", default=list(PHASES))
  ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--steps", type=int, default=3000, help="the step budget of every run (and the cosine horizon)")
  ap.add_argument("--stage-steps", type=int, default=300, help="validation cadence (1x exact match)")
  ap.add_argument("--competence", type=float, default=0.99)
  ap.add_argument("--train-len", type=int, default=512)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--block-size", type=int, default=64)
  ap.add_argument("--batch-size", type=int, default=8)
  ap.add_argument("--passkey-rows", type=int, default=6)
  ap.add_argument("--answer-weight", type=float, default=100.0)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--min-lr-ratio", type=float, default=0.1)
  ap.add_argument("--warmup", type=int, default=50)
  ap.add_argument("--ckpt-every", type=int, default=100)
  ap.add_argument("--n-val", type=int, default=40, help="1x validation prompts (spread over depths)")
  ap.add_argument("--data-dir", default="data")
  ap.add_argument("--small-data", action="store_true", help="small fpa_text build (smoke tests)")
  ap.add_argument("--n", type=int, default=100, help="passkey prompts per length / cache cell (5 depths)")
  ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--cache-multiple", type=int, default=8, help="prompt length of the cache cells, x L")
  ap.add_argument("--policies", nargs="+", choices=BUDGETED, default=list(BUDGETED))
  ap.add_argument(
    "--budgets", type=float, nargs="+", default=[0.25, 0.125], help="kept fractions (kvpress removes 1 - b)"
  )
  ap.add_argument("--prefills", nargs="+", choices=("parallel", "decode"), default=["parallel"])
  ap.add_argument("--tolerance", type=float, default=1e-3, help="the `fpa` policy's per-row bound")
  ap.add_argument("--cache-batch", type=int, default=10)
  ap.add_argument("--pos-bucket", type=int, default=256)
  ap.add_argument("--pos-multiple", type=int, default=8, help="loss by position out to this multiple of L")
  ap.add_argument("--pos-docs", type=int, default=32, help="validation documents >= 8L long, for loss by position")
  ap.add_argument("--heldout-windows", type=int, default=512)
  ap.add_argument(
    "--needle-prompts",
    type=int,
    default=10,
    help="prompts at 1x and the cache multiple for the per-head needle penalty",
  )
  ap.add_argument("--speed", action="store_true", help="also time prefill with skip='keys' against exact")
  ap.add_argument("--skip-eps", type=float, default=1e-3)
  ap.add_argument("--claims-method", choices=list(METHODS), default=PRETRAIN, help="the row the verdicts judge")
  ap.add_argument(
    "--objective-methods",
    nargs="+",
    choices=list(METHODS),
    default=list(OBJECTIVE_METHODS),
    help="the recipe with the evictability objective, each setting judged against it (the objective's cost)",
  )
  ap.add_argument(
    "--objective-baseline", choices=list(METHODS), default=NO_OBJECTIVE, help="the recipe without the objective"
  )
  ap.add_argument("--bindings-results", default="results/bindings_lm.json", help="the nested-bindings claim's source")
  ap.add_argument("--runs-dir", default="runs/one_recipe")
  ap.add_argument("--out-dir", default="results/one_recipe")
  return ap.parse_args(argv)


def main(argv=None) -> str:
  args = parse_args(argv)
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  log = lambda s: print(s, file=sys.stderr, flush=True)
  if "train" in args.phase:
    t0 = time.perf_counter()
    for seed in args.seeds:
      for method in args.methods:
        train_one(method, seed, args, argv, log)
    log(f"[one_recipe] trained {args.methods} x seeds {args.seeds} in {time.perf_counter() - t0:.0f} s")
  if "eval" in args.phase:
    for seed in args.seeds:
      for method in args.methods:
        eval_one(method, seed, args, argv, log)
  md = report(out_dir, args.claims_method, args.objective_methods, args.bindings_results, args.objective_baseline)
  print(md)
  return md


if __name__ == "__main__":
  main()
