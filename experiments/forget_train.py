"""Training that gets faster as the model forgets: the exact step and the key-sparse step, side by side.

One run, two trainings from the same init on the same batches, their steps alternating (exact, then
key-sparse) so load on a shared machine hits both alike:
  * exact: the chunked kernel, every key;
  * keys: `skip="keys"` at `skip_tolerance` eps (`fpa_jax.ops.sparse`), forward and backward: each
    row drops only keys whose weights sum to <= eps under the sound bound, so the loss and the
    gradients differ from exact by that bound (tests/ops/test_sparse.py, against float64 loops).
The model is the recipe's gate (`experiments.recipes.ONE_RECIPE["recipe_t25_fh0"]`: the library's
LM default with the evictability objective at its default target, 25% of old keys live) at
T = --seq-len on text (the LM task), its objective ramped in from --ramp-start over --ramp-steps, so
the model forgets within the run. (The library's recommended recipe has no objective: on the
one-recipe study's models without it, each (row, head) keeps ~0.56 of the keys and `skip="keys"`
saves no time, results/forget_speed.md.)

Recorded per step: each training's loss and wall time (to `block_until_ready`, the data already on
device); every --probe-every steps, on the key-sparse training's parameters and that step's batch:
the keys kept per (row, kv head) and read by the chunk loop, and the attention ops alone, forward +
backward, exact against `skip="keys"` (interleaved, median of --repeats; `experiments.forget_speed`).

    python -m experiments.forget_train                 # resumes from runs/forget_train
    python -m experiments.forget_train --phase report  # results/forget_train.{json,md,png} again

Both trainings checkpoint every --ckpt-every steps (with the data position and the per-step log), so
a rerun resumes where the last session stopped.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U

MODULE = "experiments.forget_train"
VARIANTS = ("exact", "keys")
RESULTS = "results/forget_train"


def study_config(args, variant: str):
  """The trainer config of `variant` (exact, or key-sparse at --eps): the recipe with its ramp from the
  flags, the chunked kernel both ways, the preset's logging and checkpoints (the runs checkpoint on
  their own schedule)."""
  from experiments.recipes import ONE_RECIPE

  recipe = {
    **ONE_RECIPE["recipe_t25_fh0"],
    "evict_ramp_start": args.ramp_start,
    "evict_ramp_steps": args.ramp_steps,
  }
  if variant == "keys":
    recipe |= {"skip_tolerance": args.eps, "skip": "keys"}
  run = {
    "task": "text",
    "data_dir": args.data_dir,
    "small_data": args.small_data,
    "tokenizer": "bytes",
    "seq_len": args.seq_len,
    "batch_size": args.batch_size,
    "steps": args.steps,
    "lr": args.lr,
    "warmup_steps": args.warmup,
    "seed": args.seed,
  }
  return U.study_config(U.study_model(args, attn_impl="chunked"), run, recipe)


class _Run:
  """One training: its config, state, jitted step and checkpointer."""

  def __init__(self, cfg, mesh, directory: Path):
    from fpa_jax import train as T
    from fpa_jax.checkpoint import Checkpointer

    self.cfg = cfg.validate(training=True)
    tx = T.make_optimizer(self.cfg)
    self.graphdef, self.state, self.shardings, self.abstract = T.create_state(self.cfg, mesh, tx)
    self.step_fn = T.TrainStep(self.cfg, self.graphdef, self.shardings, mesh, tx)
    self.ckpt = Checkpointer(directory / "checkpoints", keep=2)

  def model(self):
    from flax import nnx

    return nnx.merge(self.graphdef, self.state)[0]


def _probe(run, batch, eps: float, repeats: int) -> dict:
  """Keys kept / read and attention fwd+bwd seconds (exact vs keys) on `run`'s parameters and `batch`."""
  import functools

  import jax
  import jax.numpy as jnp

  from experiments import forget_speed as F
  from fpa_jax import ops

  with jax.transfer_guard("allow"):
    recorded = F.record_attention_inputs(run.model(), jnp.asarray(np.asarray(batch["inputs"])))
  kept, read = F.keys_kept(recorded, eps)
  att = {"exact": 0.0, "keys": 0.0}
  for q, k, v, gates, cfg in recorded:
    op = ops.fpa_attention if len(gates) == 2 else ops.fox_attention
    ct = jax.random.normal(jax.random.key(0), q.shape[:3] + v.shape[-1:], q.dtype)
    fns = {}
    for name, kw in (("exact", {}), ("keys", {"skip_tolerance": eps, "skip": "keys"})):
      fwd = functools.partial(op, block_size=cfg.block_size or None, scale=cfg.head_dim**-0.5, **kw)
      loss = lambda *a, f=fwd, ct=ct: jnp.sum(f(*a) * ct)
      fns[name] = (jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(gates))))), (q, k, v, *gates))
    for n, t in F.interleaved_seconds(fns, repeats).items():
      att[n] += t
  return {"keys_kept": kept, "keys_read": read, "attention_fwd_bwd_s": att}


def train_side_by_side(args, argv) -> dict:
  import jax

  from fpa_jax import sharding as S
  from fpa_jax import train as T

  root = Path(args.runs_dir)
  log_path = root / "log.json"
  mesh = S.make_mesh(None)
  cfgs = {v: study_config(args, v) for v in VARIANTS}
  pipeline = T.make_data(cfgs["exact"])
  runs = {v: _Run(cfgs[v], mesh, root / v) for v in VARIANTS}
  log = U.read_json(log_path, {"steps": [], "probes": [], "sessions": []})
  start = 0
  saved = [r.ckpt.latest_step() for r in runs.values()]
  if all(s is not None for s in saved):
    start = min(saved)
    for v, r in runs.items():  # both at the same step: the older one's, so the two stay paired
      step, r.state, data_state, _ = _restore_at(r, start)
    pipeline.set_state(data_state)
    print(f"[forget_train] resumed both trainings from step {start} in {root}", file=sys.stderr)
  log["steps"] = [s for s in log["steps"] if s["step"] <= start]
  log["probes"] = [p for p in log["probes"] if p["step"] <= start]
  t_session = time.perf_counter()
  bar = U.progress(range(start, args.steps), initial=start, total=args.steps, desc="forget_train")
  for step in bar:
    done = step + 1
    host = next(pipeline)
    batch = S.shard_batch(host, mesh)
    rec = {"step": done}
    for v, r in runs.items():
      t = time.perf_counter()
      r.state, metrics = r.step_fn(r.state, batch)
      metrics = jax.device_get(metrics)
      rec[f"step_s_{v}"] = time.perf_counter() - t
      if metrics["nonfinite"]:
        raise T.NonFiniteLossError(f"{v}: non-finite loss at step {done}; lower --lr or lengthen --warmup")
      rec[f"loss_{v}"] = float(metrics["loss"])
      for k in ("evict_hinge", "evict_live", "evict_target"):
        if k in metrics:
          rec[f"{k}_{v}"] = float(np.mean(metrics[k]))
    log["steps"].append(rec)
    bar.set_postfix(
      loss=f"{rec['loss_exact']:.3f}/{rec['loss_keys']:.3f}", ratio=f"{rec['step_s_exact'] / rec['step_s_keys']:.2f}"
    )
    if done % args.probe_every == 0 or done == args.steps:
      log["probes"].append({"step": done, **_probe(runs["keys"], host, args.eps, args.repeats)})
      p = log["probes"][-1]
      print(
        f"[forget_train] step {done}: kept {p['keys_kept']:.3f} read {p['keys_read']:.3f} attention fwd+bwd "
        f"{p['attention_fwd_bwd_s']['exact'] / p['attention_fwd_bwd_s']['keys']:.2f}x",
        file=sys.stderr,
        flush=True,
      )
    if done % args.ckpt_every == 0 or done == args.steps:
      for r in runs.values():
        r.ckpt.save(done, r.state, pipeline.get_state(), r.cfg.to_dict())
      for r in runs.values():
        r.ckpt.wait()
      session = {"from": start, "to": done, "wall_s": round(time.perf_counter() - t_session, 1)}
      log["sessions"] = [s for s in log["sessions"] if s.get("from") != start] + [session]
      log["config"] = cfgs["keys"].to_dict()
      log["meta"] = U.run_meta(MODULE, argv, wall_s=sum(s["wall_s"] for s in log["sessions"]))
      U.write_json(log_path, log)  # the log is as old as the checkpoints: a resume truncates nothing it needs
  for r in runs.values():
    r.ckpt.close()
  return log


def _restore_at(run, step: int):
  from fpa_jax.checkpoint import abstract_with_shardings

  state, data_state, config = run.ckpt.restore(step, abstract_with_shardings(run.abstract, run.shardings))
  return step, state, data_state, config


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def summarise(log: dict, skip_first: int, window: int) -> dict:
  """Step-time ratios (exact / keys) over windows of steps, loss agreement, and the probes."""
  steps = [s for s in log["steps"] if s["step"] > skip_first]  # the first steps compile
  rows = []
  for lo in range(0, len(steps), window):
    w = steps[lo : lo + window]
    ex = statistics.median(s["step_s_exact"] for s in w)
    ke = statistics.median(s["step_s_keys"] for s in w)
    rows.append(
      {
        "steps": f"{w[0]['step']}-{w[-1]['step']}",
        "step_s_exact": ex,
        "step_s_keys": ke,
        "step_speedup": ex / ke,
        "loss_exact": float(np.mean([s["loss_exact"] for s in w])),
        "loss_keys": float(np.mean([s["loss_keys"] for s in w])),
      }
    )
  d = np.array([s["loss_keys"] - s["loss_exact"] for s in steps])
  # noise: how much the loss moves from one step to the next (batches differ), against the paired gap
  noise = float(np.std(np.diff([s["loss_exact"] for s in steps]))) if len(steps) > 2 else float("nan")
  probes = [
    {
      **p,
      "attention_speedup": p["attention_fwd_bwd_s"]["exact"] / p["attention_fwd_bwd_s"]["keys"],
    }
    for p in log["probes"]
  ]
  return {
    "windows": rows,
    "loss_gap_mean": float(d.mean()) if len(d) else float("nan"),
    "loss_gap_max_abs": float(np.abs(d).max()) if len(d) else float("nan"),
    "loss_step_noise": noise,
    "probes": probes,
  }


def markdown(res: dict) -> str:
  s, meta, cfg = res["summary"], res["meta"], res["config"]
  md = (
    f"`{meta['command']}`: the recipe's gate with the evictability objective (target {cfg['evict_target']}, "
    f"ramp from step {cfg['evict_ramp_start']} over {cfg['evict_ramp_steps']}), {cfg['n_layers']} layers, "
    f"d_model {cfg['d_model']}, {cfg['n_heads']} heads, T = {cfg['seq_len']}, batch {cfg['batch_size']}, "
    f"block {cfg['block_size']}, text; two trainings from one init on the same batches, steps alternating: "
    f"exact, and `skip=\"keys\"` at eps = {cfg['skip_tolerance']} (forward and backward). "
    f"{meta['machine']['backend']}, {meta['machine']['cpu_count']} cores, load {meta['load_avg_1_5_15min']}.\n\n"
  )
  md += "Whole train step, median per window (speed-up = exact / keys):\n\n"
  md += U.md_table(
    ["steps", "exact s", "keys s", "speed-up", "loss exact", "loss keys"],
    [
      [w["steps"], w["step_s_exact"], w["step_s_keys"], f"{w['step_speedup']:.2f}x", w["loss_exact"], w["loss_keys"]]
      for w in s["windows"]
    ],
  )
  md += (
    f"\nLoss, keys minus exact, per step: mean {s['loss_gap_mean']:+.4f}, largest |gap| {s['loss_gap_max_abs']:.4f}; "
    f"the exact loss's own step-to-step std (batches differ) {s['loss_step_noise']:.4f}.\n\n"
  )
  md += (
    "Attention ops alone on the key-sparse training's parameters and batch, forward + backward, summed over layers:\n\n"
  )
  md += U.md_table(
    ["step", "keys kept per head", "keys read", "exact s", "keys s", "speed-up"],
    [
      [
        p["step"],
        p["keys_kept"],
        p["keys_read"],
        p["attention_fwd_bwd_s"]["exact"],
        p["attention_fwd_bwd_s"]["keys"],
        f"{p['attention_speedup']:.2f}x",
      ]
      for p in s["probes"]
    ],
  )
  return md


def plot(res: dict, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = res["steps"]
  x = [s["step"] for s in steps]
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  for v in VARIANTS:
    ax[0].plot(x, [s[f"loss_{v}"] for s in steps], label=v, lw=0.8)
    ax[1].plot(x, [s[f"step_s_{v}"] for s in steps], label=v, lw=0.8)
  ax[0].set(xlabel="step", ylabel="train loss", title="loss (same batches)", yscale="log")
  ax[1].set(xlabel="step", ylabel="s", title="train step wall time", ylim=(0, None))
  pr = res["summary"]["probes"]
  ax[2].plot([p["step"] for p in pr], [p["attention_speedup"] for p in pr], "o-", label="attention fwd+bwd")
  ws = res["summary"]["windows"]
  ax[2].plot([int(w["steps"].split("-")[-1]) for w in ws], [w["step_speedup"] for w in ws], "s-", label="whole step")
  ax2 = ax[2].twinx()
  ax2.plot([p["step"] for p in pr], [p["keys_kept"] for p in pr], "k:", label="keys kept")
  ax2.set(ylabel="keys kept per head", ylim=(0, 1))
  ax[2].set(xlabel="step", ylabel="exact / keys", title="speed-up as the model forgets")
  ax[2].axhline(1, color="gray", lw=0.5)
  for a in ax[:2]:
    a.legend()
  ax[2].legend(loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def report(args) -> dict:
  log = U.read_json(Path(args.runs_dir) / "log.json")
  if log is None or "meta" not in log:  # no checkpoint written yet: the committed results
    old = U.read_json(f"{RESULTS}.json")
    if old is None:
      raise SystemExit(f"no finished run in {args.runs_dir}: train first (python -m {MODULE})")
    log = old
  res = {k: log[k] for k in ("steps", "probes", "sessions", "config", "meta")}
  res["summary"] = summarise(log, args.skip_first, args.window)
  out = Path(args.out)
  U.write_study(out.parent, out.name, res, markdown, plot)
  print(markdown(res))
  return res


# ------------------------------------------------------------------------------------------------
# Claims: this study's rows of the README's claims table (`experiments.report` collects them)
# ------------------------------------------------------------------------------------------------


def _train_speed_row(root: Path) -> tuple[str, str]:
  """Key-sparse training against exact on the same batches (`experiments.forget_train`): once the
  objective's ramp has ended, every step window >= 1.3x, every attention probe >= 2x, and the paired
  loss gap below the loss's own step-to-step noise."""
  doc = U.load_result(root, "forget_train")
  if doc is None:
    return "not run", "`python -m experiments.forget_train`"
  cfg, s = doc["config"], doc["summary"]
  ramped = cfg["evict_ramp_start"] + cfg["evict_ramp_steps"]
  steps = [w["step_speedup"] for w in s["windows"] if int(w["steps"].split("-")[0]) > ramped]
  att = [p["attention_speedup"] for p in s["probes"] if p["step"] > ramped]
  if not steps or not att:
    return "not run", f"the run ended before its objective's ramp (step {ramped})"
  ok = min(steps) >= 1.3 and min(att) >= 2.0 and s["loss_gap_max_abs"] < s["loss_step_noise"]
  return U.seed_verdict([ok]), (
    f"T={cfg['seq_len']}, one run, after the ramp (step {ramped}): whole step {min(steps):.2f}-{max(steps):.2f}x, "
    f"attention fwd+bwd {min(att):.2f}-{max(att):.2f}x; loss gap <= {s['loss_gap_max_abs']:.4f} "
    f"(step-to-step noise {s['loss_step_noise']:.3f})"
  )


def claim_rows(root: Path = U.ROOT) -> list[U.ClaimRow]:
  """The training-speed claim: key-sparse training against exact on the same batches."""
  return [
    U.ClaimRow(
      "Training gets faster as the model forgets (>= 1.3x step, >= 2x attention, the same loss)",
      *_train_speed_row(root),
      "docs/results/kv_compression.md",
    )
  ]


def main(argv=None) -> dict:
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--phase", choices=("train", "report"), nargs="+", default=["train", "report"])
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--batch-size", type=int, default=2)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--block-size", type=int, default=128)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--warmup", type=int, default=50)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--eps", type=float, default=1e-3, help="skip_tolerance of the key-sparse training")
  ap.add_argument("--ramp-start", type=int, default=50, help="the objective's ramp start (step)")
  ap.add_argument("--ramp-steps", type=int, default=150)
  ap.add_argument("--probe-every", type=int, default=50)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--ckpt-every", type=int, default=25)
  ap.add_argument("--skip-first", type=int, default=2, help="steps left out of the timings (compiles)")
  ap.add_argument("--window", type=int, default=50, help="steps per row of the step-time table")
  ap.add_argument("--data-dir", default="data")
  ap.add_argument("--small-data", action="store_true")
  ap.add_argument("--runs-dir", default="runs/forget_train")
  ap.add_argument("--out", default=RESULTS)
  args = ap.parse_args(argv)
  res = {}
  if "train" in args.phase:
    res = train_side_by_side(args, argv)
  if "report" in args.phase:
    res = report(args)
  return res


if __name__ == "__main__":
  main()
