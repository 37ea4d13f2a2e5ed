"""The README's first command: what First Passage Attention is for, in a few minutes on a CPU.

    bash run.sh quickstart          # = python -m experiments.quickstart [--workdir runs/quickstart]

1. The operator: on a bracket walk (field = level = depth) the live keys form a stack.
2. Study 1, reduced: one attention head per method (fpa, stack, fox, softmax+RoPE) trained to put
   its attention on the live keys of nested scopes; mean attention mass on the target set at 1x and
   2x the training length (2 seeds; the full study is `python -m experiments.live_sets`).
3. The learned KV-cache rule: an FPA language model (`experiments.bindings_lm`'s `fpa_evict` recipe,
   seed 0: the LM loss plus the evictability objective) trained on nested named bindings
   (`fpa_jax.data.bindings`), then decoded token by token at 2x and 4x its training length with the
   cache under each policy: how many keys each keeps and how often it still answers the queries
   right, the far ones (a binding made before long closed inner scopes) apart. The model ships with
   the repository (`experiments/assets/quickstart_lm/`: written by `--train`, which trains it with the
   project's own trainer, about 10 min on 2 cores; its command and a check loss are in its
   config.json, and tests/studies/test_quickstart.py checks both). The full study with FoX, stack and softmax
   and 3 seeds is `python -m experiments.bindings_lm`.
Writes results/quickstart/{summary.json, live_sets.md, decode.md}; ends with the full study commands.
Output is line-buffered, so a log file or CI shows each step as it happens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments.bindings_lm import FPA_ROWS

ROOT = Path(__file__).resolve().parents[1]
DEMO = "x(a(bc)d(e)f)y"
LM_LEN = 128  # step 3's training length
# step 3's recipe: the bindings study's FPA row that met the KV-compression targets over its 3 seeds
# (results/bindings_lm.md): the evictability objective on top of the LM loss
LM_METHOD = "fpa_evict"
# step 3's model as `--train` exports it (`fpa_jax.inference.export_model`)
ASSET = ROOT / "experiments" / "assets" / "quickstart_lm"

MODULE = "experiments.quickstart"


def check_loss(model) -> float:
  """Mean next-token loss of `model` on a fixed bindings batch: the number an exported model must
  reproduce after loading (recorded at export, checked by the tests)."""
  import jax.numpy as jnp
  import optax

  from fpa_jax.data.bindings import BindingsLM

  b = next(BindingsLM(seq_len=LM_LEN, batch_size=4, seed=777))
  logits = model(jnp.asarray(b["inputs"]))
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.asarray(b["targets"]))
  return float(nll.mean())


def live_keys_demo(text: str = DEMO) -> list[str]:
  """Shared walk on brackets: field = level = nesting depth. Returns one line per query."""
  import jax.numpy as jnp

  from fpa_jax.ops import first_passage_penalty

  depth = np.cumsum([1 if c == "(" else -1 if c == ")" else 0 for c in text]).astype(np.float32)
  # A ")" is written at the depth it closes into, so its own scope is already gone.
  pen = np.asarray(first_passage_penalty(jnp.asarray(depth), jnp.asarray(depth)))
  lines = []
  for i, c in enumerate(text):
    live = "".join(text[j] if pen[i, j] == 0 else "." for j in range(i + 1))
    lines.append(f"  query {i:2d} {c!r}: live keys {live}")
  return lines


def cached_decode_table(model, seq_len: int, n: int = 16, seed: int = 123) -> tuple[list[dict], str]:
  """Decode held-out `bindings` programs of `seq_len` tokens under each cache policy: answer accuracy
  on all queries and on the far ones (answer > seq_len / 8 back), keys held and (where measurable)
  the attention mass lost to eviction. Rows carry `multiple` = seq_len / LM_LEN."""
  from experiments._common import md_table
  from experiments.bindings_lm import eval_programs, score

  toks, is_q, far = eval_programs(seq_len, n, seed)
  rows = []
  for name, kw in [
    ("full", dict(policy="full")),
    ("fpa ε=0.01", dict(policy="fpa", tolerance=1e-2)),
    ("fpa_budget 25%", dict(policy="fpa_budget", budget=0.25)),
    ("window 25%", dict(policy="window", budget=0.25)),
    ("h2o 25%", dict(policy="h2o", budget=0.25)),
    ("fpa_budget 12.5%", dict(policy="fpa_budget", budget=0.125)),
    ("window 12.5%", dict(policy="window", budget=0.125)),
    ("h2o 12.5%", dict(policy="h2o", budget=0.125)),
  ]:
    cell, st = score(model, toks, is_q, far, **kw)
    rows.append(
      {
        "multiple": seq_len / LM_LEN,
        "policy": name,
        "query_accuracy": cell["acc"],
        "far_accuracy": cell["far"],
        "cache_fraction": st["cache_fraction"],
        "kept_fraction_mean": st["kept_fraction_mean"],
        "lost_mass_max": st["lost_mass_max"],
      }
    )
  md = md_table(
    ["policy", "query accuracy", "far queries", "peak keys held / seq", "mean kept / seen", "max lost mass"],
    [
      [
        r["policy"],
        f"{r['query_accuracy']:.3f}",
        f"{r['far_accuracy']:.3f}",
        f"{r['cache_fraction']:.3f}",
        f"{r['kept_fraction_mean']:.3f}",
        f"{r['lost_mass_max']:.2g}" if r["lost_mass_max"] is not None else "—",
      ]
      for r in rows
    ],
  )
  acc = {r["policy"]: r["query_accuracy"] for r in rows}
  md += (
    f"\n\nAt {seq_len // LM_LEN}x ({seq_len} tokens) and 12.5% of the cache the learned rule keeps {100 * acc['fpa_budget 12.5%']:.1f}% of the queries right "
    f"(full cache {100 * acc['full']:.1f}%), window {100 * acc['window 12.5%']:.1f}%, h2o {100 * acc['h2o 12.5%']:.1f}%: "
    + ", ".join(
      f"{100 * (acc['fpa_budget 12.5%'] - acc[f'{p} 12.5%']):+.1f} points over {p}" for p in ("window", "h2o")
    )
    + " (the target: >= 5 points over each).\n"
  )
  return rows, md


def train_step3(a, argv) -> tuple[object, object, dict]:
  """Train step 3's LM with the project's trainer (resumes from a.workdir) -> (model, its Config,
  meta for export)."""
  from experiments import bindings_lm
  from fpa_jax.data.bindings import BindingsLM

  data = BindingsLM(seq_len=LM_LEN, batch_size=16)
  study = bindings_lm.parse_args(["--steps", str(a.lm_steps), "--train-len", str(LM_LEN)])
  if a.small:
    study.d_model, study.heads = 32, 2
  cfg = bindings_lm.study_config(a.lm_method, study, 0, data.vocab_size)
  run = U.train_lm(cfg, os.path.join(a.workdir, f"{a.lm_method}_bindings_lm"), data)
  model = run["model"]
  meta = {
    "command": U.command("experiments.quickstart", argv),
    "commit": U.git_commit(),
    "method": a.lm_method,
    "steps": int(run["step"]),
    "train_wall_s": run["train_wall_s"],
    "cpus": os.cpu_count(),
    "check_loss": check_loss(model),
  }
  return model, cfg, meta


def main(argv=None) -> int:
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--workdir", default="runs/quickstart", help="checkpoints of the step-3 model (resumes)")
  ap.add_argument("--out", default=str(ROOT / "results" / "quickstart"))
  ap.add_argument("--seeds", type=int, default=2)
  ap.add_argument("--head-steps", type=int, default=400, help="step 2: training steps per head")
  ap.add_argument("--lm-steps", type=int, default=3000, help="step 3: training steps of the FPA LM")
  ap.add_argument(
    "--lm-method",
    default=LM_METHOD,
    choices=FPA_ROWS,
    help="step 3: the bindings study's FPA recipe (fpa: the LM loss alone; fpa_evict: + the evictability "
    "objective; fpa_bloop: budget in the loop)",
  )
  ap.add_argument(
    "--train",
    action="store_true",
    help="step 3: train the LM (resumes from --workdir) and export it to --asset, instead of loading the shipped one",
  )
  ap.add_argument("--asset", default=str(ASSET), help="step 3's exported model (read, or written by --train)")
  ap.add_argument(
    "--small", action="store_true", help="tiny settings (tests); trains a tiny step-3 LM, exports nothing"
  )
  a = ap.parse_args(argv)
  if a.small:
    a.seeds, a.head_steps, a.lm_steps = 1, 20, 4
  sys.stdout.reconfigure(line_buffering=True)  # each line as it is printed, also into a pipe or a log
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()

  print("1) First-passage penalty on a bracket walk (field = level = depth): a key stays live")
  print("   until the depth dips below its own; closed scopes vanish, enclosing ones stay.")
  print("\n".join(live_keys_demo()))

  from experiments import live_sets

  print(
    f"\n2) One attention head per method, trained to attend to the live keys of nested scopes "
    f"({a.seeds} seeds x {a.head_steps} steps; CPU):"
  )
  small = dict(pool=128, n_eval=16) if a.small else dict(pool=512, n_eval=64)
  res = live_sets.run(
    "scopes", seeds=a.seeds, steps=a.head_steps, objectives=("mass",), out=None, figure=False, **small
  )
  md_heads = live_sets.markdown(
    res,
    title=f"Task `scopes`, single head, d_model 16, T={live_sets.TRAIN_LEN}, "
    f"{a.head_steps} steps, {a.seeds} seeds (`bash run.sh quickstart`).",
  )
  print(md_heads)
  (out / "live_sets.md").write_text(md_heads)

  print(
    f"3) The learned KV-cache rule: an FPA LM (recipe `{a.lm_method}`) trained on nested named bindings\n"
    f"   ({a.lm_steps} steps at {LM_LEN} tokens; `fpa_jax.data.bindings`), decoded token by token at 2x and\n"
    "   4x its training length with each cache policy: far queries ask for a binding made before long,\n"
    "   closed inner scopes."
  )
  from fpa_jax.inference import export_model, load_exported

  if a.train or a.small:
    model, cfg, meta = train_step3(a, argv)
    if not a.small:
      export_model(model, cfg, a.asset, meta=meta)
      print(f"   exported to {a.asset} (commit it: the quickstart loads it from there)")
  else:
    if not (Path(a.asset) / "params.npz").exists():
      raise SystemExit(f"no exported model in {a.asset}: train one with --train (about 10 min on 2 cores)")
    model, _, meta = load_exported(a.asset)
    print(f"   loaded {a.asset} (trained by `{meta['command']}`, {meta['steps']} steps; --train retrains)")
  rows, parts = [], []
  for mult in (2, 4):
    print(f"   decoding at {mult}x under 8 cache policies ...")
    r, md = cached_decode_table(model, mult * LM_LEN, n=4 if a.small else 16)
    rows += r
    parts.append(f"At {mult}x its training length ({mult * LM_LEN} tokens):\n\n{md}")
  md_cache = "\n".join(parts)
  md_cache += (
    f"\nThe model: `{meta['command']}` ({meta['steps']} steps, {meta['train_wall_s'] / 60:.1f} min of training on "
    f"{meta['cpus']} cores, commit {meta['commit'][:12]}).\n"
  )
  print(md_cache)
  (out / "decode.md").write_text(md_cache)
  summary = {
    "live_sets": res,
    "decode": rows,
    "lm": {k: meta[k] for k in ("command", "commit", "steps", "train_wall_s", "check_loss")},
    "wall_s": round(time.perf_counter() - t0, 1),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
  print(
    f"wrote {out}/ in {summary['wall_s']:.0f} s. The full studies:\n"
    "  python -m experiments.live_sets --task all      # study 1: live-key sets, 5 seeds (+ --ablations)\n"
    "  python -m experiments.passkey                   # study 2: passkey retrieval at 1x..8x\n"
    "  python -m experiments.kv_compression            # study 3: passkey at 8x with a compressed cache\n"
    "  python -m experiments.bindings_lm               # nested bindings at 1x..8x, every cache policy\n"
    "  python -m experiments.perplexity                # study 4: bits per byte, loss by position\n"
    "  python -m experiments.report                    # README and docs results from results/"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
