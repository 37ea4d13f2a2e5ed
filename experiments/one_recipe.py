"""One recipe, one model, every claim: the recommended FPA recipe and FoX trained from scratch seed by
seed on one data mix at one step budget, then the same checkpoints scored on every claim.

    python -m experiments.one_recipe --phase train --methods fox recipe --seeds 0 1 2   # resumable
    python -m experiments.one_recipe --phase report                                    # tables only

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

from experiments import _common as U
from experiments.recipes import ONE_RECIPE

MODULE = "experiments.one_recipe"
METHODS = ONE_RECIPE
PHASES = ("train", "report")


def study_config(method: str, args, steps: int):
  """The trainer config of `method` trained to `steps` of the `--steps` budget (one schedule whatever
  the stage: the cosine horizon is the budget)."""
  from fpa_jax.configs import get_config

  return get_config(
    "small",
    n_layers=args.layers,
    d_model=args.d_model,
    n_heads=args.heads,
    d_ff=0,
    seq_len=args.train_len,
    batch_size=args.batch_size,
    block_size=args.block_size,
    steps=steps,
    lr=args.lr,
    lr_decay_steps=args.steps,
    min_lr_ratio=args.min_lr_ratio,
    warmup_steps=args.warmup,
    task="passkey",
    data_dir=args.data_dir,
    seed=args.seed,
    log_every=10,
    ckpt_every=args.ckpt_every,
    small_data=args.small_data,
    tokenizer="bytes",
    vocab_size=259,
    **METHODS[method],
  )


def workdir(args, method: str, seed: int) -> Path:
  return Path(args.runs_dir) / f"{method}_s{seed}"


def train_path(args, method: str, seed: int) -> Path:
  return Path(args.out_dir) / "train" / f"{method}_s{seed}.json"


def train_one(method: str, seed: int, args, argv, log) -> dict:
  """Train (method, seed) in stages of `--stage-steps` to `--steps`, validating at 1x after each."""
  from experiments.passkey import DEPTHS, PasskeyTextMix, eval_batch
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
    data = PasskeyTextMix(
      data_dir=args.data_dir,
      seq_len=args.train_len,
      batch_size=args.batch_size,
      n_passkey=args.passkey_rows,
      answer_weight=args.answer_weight,
      seed=seed,
      small=args.small_data,
    )
    out = U.train_lm(study_config(method, args, steps), str(wd), data, progress_bar=False)
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


def report(out_dir: Path) -> str:
  runs = load_train(out_dir)
  md = "# One recipe, seed by seed\n\n`python -m experiments.one_recipe` (commands per run in `train/*.json`)\n\n"
  md += "## Passkey pace\n\n" + pace_markdown(runs)
  (out_dir / "one_recipe.md").write_text(md)
  if runs:
    pace_plot(runs, out_dir / "one_recipe_pace.png")
  return md


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
  ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
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
  md = report(out_dir)
  print(md)
  return md


if __name__ == "__main__":
  main()
