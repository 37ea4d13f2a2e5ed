"""Does an FPA model whose read-outs stay still train as FoX does? Only with `gate_clip_apart`.

    python -m experiments.clip_coupling             # a few minutes on 2 CPU cores: results/clip_coupling.md

Three byte LMs of the passkey study's recipe (`experiments.passkey`: 2 layers, d_model 128, L=512,
passkey prompts with answers weighted x100 beside text; the same seed and batches), trained for
`--steps` steps: fox_b5, and FPA at its init (`experiments.recipes.LM_WARM` at bias 5: zero read-outs, every other
weight FoX's through the read-outs' side stream) with its read-outs held still (their lr ramp is 10^9
steps long: the multiplier stays below 10^-6), once under one global-norm clip and once with the
read-outs clipped by their own norm. Such an FPA model computes FoX's function; the question
is whether it also takes FoX's steps. Per run: the gradient norm at step 1, the training loss gap to
FoX over the steps, and the largest relative difference of any shared weight from FoX's at the end.
Each run resumes from runs/clip_coupling/<run>.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments import passkey as PK
from experiments import recipes
from fpa_jax import configs as C

MODULE = "experiments.clip_coupling"
RUNS = recipes.CLIP_COUPLING  # run -> overrides of passkey's fox_b5 config (`experiments.recipes`)


def parse_args(argv=None):
  """(this study's flags, the passkey study's args): any flag this study lacks (--train-len,
  --d-model, --data-dir, --small-data, ...) sets the passkey recipe, whose defaults it takes."""
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--runs-dir", default="runs/clip_coupling")
  ap.add_argument("--out-dir", default="results")
  args, rest = ap.parse_known_args(argv)
  return args, PK.parse_args(["--seed", str(args.seed), *rest])


def _metrics(workdir: Path) -> dict[int, dict]:
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  return {r["step"]: r for r in rows if "loss" in r}


def _flat_params(model) -> dict[str, np.ndarray]:
  from flax import nnx

  return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def main(argv=None) -> dict:
  args, pk = parse_args(argv)
  t0 = time.perf_counter()
  res: dict = {"steps": args.steps, "seed": args.seed, "recipe": PK.run_tag(pk), "runs": {}}
  params, metrics = {}, {}
  for name, over in U.progress(RUNS.items(), desc="clip_coupling", total=len(RUNS)):
    base = PK.study_config("fox_b5", pk, args.steps)
    cfg = C.replace(base, **over, log_every=1, ckpt_every=args.steps, warmup_steps=min(pk.warmup, args.steps))
    data = PK.PasskeyTextMix(
      data_dir=pk.data_dir,
      seq_len=pk.train_len,
      batch_size=pk.batch_size,
      n_passkey=pk.passkey_rows,
      answer_weight=pk.answer_weight,
      prompt_weight=pk.prompt_weight,
      seed=pk.seed,
      small=pk.small_data,
    )
    workdir = Path(args.runs_dir) / f"{name}_s{args.seed}"
    tr = U.train_lm(cfg, str(workdir), data, progress_bar=False)
    params[name], metrics[name] = _flat_params(tr["model"]), _metrics(workdir)
  fox_p, fox_m = params["fox_b5"], metrics["fox_b5"]
  for name in RUNS:
    m = metrics[name]
    steps = sorted(s for s in m if s in fox_m)
    gap = [m[s]["loss"] - fox_m[s]["loss"] for s in steps]
    rel = max(np.max(np.abs(params[name][k] - v)) / (np.max(np.abs(v)) + 1e-30) for k, v in fox_p.items())
    res["runs"][name] = {
      "config": RUNS[name],
      "grad_norm_step1": m[1]["grad_norm"],
      "loss_gap": dict(zip(map(str, steps), gap)),
      "max_abs_loss_gap": float(np.max(np.abs(gap))),
      "final_loss_gap": gap[-1],
      "max_rel_weight_diff": float(rel),
      "extra_params": sorted(set(params[name]) - set(fox_p)),
    }
  res["meta"] = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0, seeds=[args.seed])
  U.write_study(args.out_dir, "clip_coupling", res, markdown, plot)
  print(markdown(res))
  return res


def markdown(res: dict) -> str:
  rows = [
    [
      f"`{n}`",
      f"{r['grad_norm_step1']:.3f}",
      f"{r['max_abs_loss_gap']:.2e}",
      f"{r['final_loss_gap']:+.2e}",
      f"{r['max_rel_weight_diff']:.2e}",
    ]
    for n, r in res["runs"].items()
  ]
  head = (
    f"`{res['meta']['command']}`: byte LMs of the passkey study's recipe ({res['recipe']}), {res['steps']} steps "
    "on the same batches. FPA starts at fox_b5's init with its read-outs held still (lr ramp of 10^9 steps). "
    "Loss gap: training loss minus FoX's at the same step (every step logged). Weight difference: the "
    "largest max|w - w_FoX| / max|w_FoX| over FoX's weights after the last step.\n\n"
  )
  return head + U.md_table(
    ["run", "grad norm at step 1", "max abs loss gap", "loss gap at the end", "max relative weight difference"], rows
  )


def plot(res: dict, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5.5, 3.0))
  for n, r in res["runs"].items():
    if n == "fox_b5":
      continue
    steps = [int(s) for s in r["loss_gap"]]
    ax.plot(steps, [abs(g) + 1e-9 for g in r["loss_gap"].values()], label=n, lw=1.2)
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("|training loss - FoX's|")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main(sys.argv[1:])
