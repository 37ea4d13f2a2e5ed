"""Why an FPA gate that contains FoX trained worse than FoX as a byte LM. One row per hypothesis.

    python -m experiments.lm_ablations                                  # every row, seed 0, 600 steps
    python -m experiments.lm_ablations --seeds 0 1 2                      # every row, 3 seeds

The perplexity study's recipe (byte LMs on `fpa_text`, 2 layers, d_model 128, 4 heads, L=256, batch
8, AdamW warmup + cosine; `experiments.perplexity.study_config`), trained on the fixed text pipeline
and scored on its held-out set (every validation document). Each row changes one thing against
`fpa_fox0` (FPA started at FoX's own init: FoX's log-sigmoid forget term plus step / absolute /
offset read-outs of size ~1e-3), so a row that closes the gap to `fox` names the cause:

  fpa_fox0_scale1   read-outs at scale 1 instead of 10 (Adam moves a scale-10 read-out 10x faster)
  fpa_fox0_glr0.1   the same read-outs at scale 10 with a tenth of the learning rate (gate_lr_scale)
  fox_step / fox_absolute / fox_offset   FoX's forget term plus one read-out alone: which one hurts
  fpa_fox0_init0    read-outs initialised at exactly 0 (relu's kink: no gradient reaches them at first)
  fpa / fpa_scale1  the single-head default gate (no forget term) at scale 10 and at scale 1

Every row pins the single-head gate (`configs.SINGLE_HEAD_GATE`) it changes from; the table led to
the LM gate (`experiments.recipes.LM_GATE` = `fpa_fox0_scale1`), whose long runs are in
`experiments.perplexity --methods fox fpa_lm --steps 3000 --out-name perplexity_T3000`. The gate
statistics of each trained model (`losses.gate_stats` on the first held-out batch, mean over
layers: field range, share of active pairs, of pairs past FORGOTTEN nats, mean penalty) are in the
table too: whether the read-outs learned to forget at all.

The held-out loss is also logged every `--eval-every` steps (the trainer's periodic eval on the same
held-out set), so "never worse than FoX at any logged step" can be read off the curves. Rerunning
resumes each run from its checkpoints and rescoring is cheap; results merge across invocations of
one recipe (another recipe, e.g. other --steps, starts the file afresh: give it its own --out-dir).
Writes results/lm_ablations.{json,md,png}.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments import perplexity as PPL
from experiments import recipes
from fpa_jax.losses import FORGOTTEN

MODULE = "experiments.lm_ablations"
# row -> (config overrides, the hypothesis it tests) (`experiments.recipes`)
ROWS: dict[str, tuple[dict, str]] = recipes.LM_ABLATIONS


def run_tag(args) -> str:
  return args.tag or f"L{args.train_len}_l{args.layers}d{args.d_model}_b{args.batch_size}_lr{args.lr:g}_T{args.steps}"


def final_gate_stats(model, batch: dict) -> dict[str, float]:
  """`losses.gate_stats` of the trained model on the first held-out batch ({} without a gate)."""
  from flax import nnx

  from fpa_jax import losses
  from fpa_jax.configs import GATED

  if model.cfg.attention not in GATED:
    return {}

  @nnx.jit
  def f(m, inputs, seg):
    return losses.gate_stats(m(inputs, seg, return_gates=True)[1], seg)

  return {k: float(v) for k, v in f(model, batch["inputs"], batch["segment_ids"]).items()}


def _layer_mean(stats: dict, name: str) -> float:
  vals = [v for k, v in stats.items() if k.startswith(f"gate_{name}_l")]
  return float(np.mean(vals)) if vals else float("nan")


def summarise(res: dict) -> dict:
  rows = [r for r in ROWS if r in res]
  out = {}
  for r in rows:
    bpb = res[r]["bpb"]
    out[r] = {"bpb_mean": float(np.mean(bpb)), "bpb_std": float(np.std(bpb, ddof=1)) if len(bpb) > 1 else 0.0}
    for ref in ("fox", "fpa_fox0"):
      if ref in res:
        base = dict(zip(res[ref]["seeds"], res[ref]["bpb"]))
        paired = [b / base[s] - 1.0 for s, b in zip(res[r]["seeds"], bpb) if s in base]
        out[r][f"vs_{ref}_paired"] = paired
        out[r][f"vs_{ref}"] = float(np.mean(paired)) if paired else None
  return out


def markdown(res: dict) -> str:
  s, r = res["summary"], res["recipe"]
  cov = res["heldout"]
  head = (
    f"`python -m {MODULE}` (commands per row in lm_ablations.json): byte LMs ({r['layers']} layers, d_model "
    f"{r['d_model']}, {r['heads']} heads), L={r['train_length']}, batch {r['batch_size']}, {r['steps']} steps, lr "
    f"{r['lr']} (cosine); held-out bits per byte on {cov['bytes_scored']} bytes of {cov['windows']} windows over "
    f"{cov['docs_covered']} of {cov['docs_in_split']} validation documents. \"vs\" columns: mean of the per-seed "
    "(paired) relative differences. Gate columns: each trained model's gate on the first held-out batch "
    f"(`fpa_jax.losses.gate_stats`), mean over layers and seeds: the field's range along a window (nats), the "
    f"share of (query, earlier key) pairs with a penalty > 0 and > {FORGOTTEN:g} nats, and the mean penalty.\n\n"
  )
  pct = lambda v: "—" if v is None else f"{100 * v:+.2f}%"
  rows = []
  for m in (m for m in ROWS if m in res):
    e = res[m]
    rows.append(
      [
        m,
        ROWS[m][1],
        len(e["bpb"]),
        U.mean_std(e["bpb"]),
        pct(s[m].get("vs_fox")),
        pct(s[m].get("vs_fpa_fox0")),
        f"{np.mean(e['train_wall_s']) / 60:.1f}",
        *(gate_cols(e.get("gate_stats", []))),
      ]
    )
  table = U.md_table(
    [
      "row", "hypothesis", "seeds", "bpb (mean ± std)", "vs fox", "vs fpa_fox0", "train min / run",
      "field range", "active pairs", f"pairs > {FORGOTTEN:g} nats", "mean penalty",
    ],
    rows,
    align="ll" + "r" * 9,
  )  # fmt: skip
  return head + table


def gate_cols(per_seed: list[dict]) -> list[str]:
  """The final gate statistics (mean over layers, then seeds): range, active, forgotten, penalty."""
  if not per_seed or not per_seed[0]:
    return ["—"] * 4
  m = lambda name: np.mean([_layer_mean(st, name) for st in per_seed])
  return [f"{m('field_range'):.2f}", f"{m('active'):.3f}", f"{m('forgotten'):.3f}", f"{m('penalty'):.2f}"]


def plot(res: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 3.8))
  for m in (m for m in ROWS if m in res):
    curves = [c for c in res[m]["curves"] if c]
    if not curves:
      continue
    steps = sorted(set.intersection(*[set(map(int, c)) for c in curves]))
    if not steps:
      continue
    ys = np.mean([[c[str(t)] for t in steps] for c in curves], axis=0) / np.log(2)
    ax.plot(steps, ys, label=m, lw=1.6 if m in ("fox", "fpa_fox0") else 1.0)
  ax.set_xlabel("step")
  ax.set_ylabel("held-out bits per token")
  ax.set_title("held-out loss over training (mean over seeds)", fontsize=9)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(res: dict, out_dir: Path) -> None:
  res["summary"] = summarise(res)
  U.write_study(out_dir, "lm_ablations", res, markdown, plot)


def parse_args(argv=None):
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
  ap.add_argument("--seeds", type=int, nargs="+", default=[0])
  PPL.add_recipe_args(ap, steps=600, runs_dir="runs/lm_ablations")
  ap.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (the curves)")
  return ap.parse_args(argv)


def main(argv=None) -> dict:
  from fpa_jax.inference import read_metrics

  args = parse_args(argv)
  log = lambda s: print(s, file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  out_dir, tag = Path(args.out_dir), run_tag(args)
  held, coverage = PPL.heldout_batches(args)
  recipe = PPL.recipe_of(args, tag)
  for row in args.rows:
    entry = {"bpb": [], "curves": [], "train_wall_s": [], "workdirs": [], "seeds": [], "gate_stats": []}
    for seed in args.seeds:
      workdir = os.path.join(args.runs_dir, tag, f"{row}_s{seed}")
      extra = {"eval_every": args.eval_every, "heldout_windows": args.heldout_windows}
      cfg = PPL.study_config(row, args, seed, overrides={**ROWS[row][0], **extra})
      tr = U.train_lm(cfg, workdir, None)
      entry["bpb"].append(PPL.bits_per_byte(PPL.nll_fn(tr["model"]), held))
      entry["gate_stats"].append(final_gate_stats(tr["model"], held[0]))
      entry["curves"].append(PPL.curve(read_metrics(workdir)))  # every session's, not only this one's
      entry["train_wall_s"].append(tr["train_wall_s"])
      entry["workdirs"].append(workdir)
      entry["seeds"].append(seed)
      log(f"[lm_ablations] {row} seed {seed}: bpb {entry['bpb'][-1]:.4f}, train wall {tr['train_wall_s']:.0f} s")
    entry.update(config=tr["init_config"], command=U.command(MODULE, argv), commit=U.git_commit())
    res = U.read_json(out_dir / "lm_ablations.json", {})
    if res.get("recipe", {}).get("tag") != tag:
      res = {}
    res.update(
      {
        row: entry,
        "recipe": recipe,
        "heldout": coverage,
        "text_rows": "windows",
        "meta": U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0, rows_this_run=args.rows),
      }
    )
    write_outputs(res, out_dir)
  return U.read_json(out_dir / "lm_ablations.json")


if __name__ == "__main__":
  main()
