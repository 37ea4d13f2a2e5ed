"""Training throughput (tokens/s) of the `small` config for FPA, FoX and softmax, side by side.

    python -m experiments.bench_train                 # 30 timed steps each, writes results/bench_train.json
    python -m experiments.bench_train --quick         # 5 timed steps each (smoke)
    python -m experiments.bench_train --steps 50 --set dtype=bfloat16 --mesh data=8

Each attention type gets the same model/batch/mesh; the jitted train step (forward, backward,
AdamW update) is compiled and warmed up first, then timed over --steps steps with a
block_until_ready per step. Reports median tokens/s and the FPA/FoX ratio (target >= 0.9).

    python -m experiments.bench_train --evict         # + each gated attention with the evictability objective

--evict adds a row "<attention>+evict" per gated attention, the same step with `evict_weight`
(--evict-weight, default 1; the other evict_* fields from the config or --set), and reports its
step time over the plain step's (the objective's cost: the per-layer gates returned from the same
forward pass, the reverse running min on `evict_queries` sampled queries, and their backward).

    python -m experiments.bench_train --budget-loop   # + each gated attention with budget in the loop

--budget-loop adds a row "<attention>+budget" per gated attention: every step through a random
`fpa_budget` cache (`budget_loop_prob=1`, the budget range from the config or --set; `fpa_jax.ops.budget`:
the keep-mask scan and the quadratic attention, whatever attn_impl says), and reports its step time
over the plain step's.

    python -m experiments.bench_train --memory        # writes results/bench_train_memory.{json,md}

--memory only compiles (never runs) the `base110m` train step (2 layers, seq 2048, global batch 8
unless --set says otherwise) on 8 simulated CPU devices and reports XLA's per-device compiled
memory (`.lower().compile().memory_analysis()`) on one device, data=8 and data=4,model=2, with the
model's activation sharding constraints and without them (the step traced with no mesh in
context, where `fpa_jax.sharding.constrain` is a no-op: the layout before the constraints).

    python -m experiments.bench_train --scan          # adds a section to results/bench_train.{json,md}

--scan only compiles (never runs) the `base110m` train step (seq 2048, global batch 8) on data=8
(8 simulated CPU devices) for {unscanned, scanned} x remat {none, full, dots} at 2 and 8 layers
(`--depths`, `--remats`) and reports trace+lower seconds, XLA compile seconds and per-device
compiled temp memory (`Config.scan_layers`, `Config.remat`). Both modes merge their part into the
results files: neither removes the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax

from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.checkpoint import abstract_with_shardings
from fpa_jax.data import SyntheticPipeline
from fpa_jax.train import TrainStep, abstract_state, create_state, make_optimizer

MEMORY_MESHES = ("single", "data=8", "data=4,model=2")  # "single": one device (data=1, model=1)
MEMORY_DEFAULTS = {"n_layers": 2, "seq_len": 2048, "batch_size": 8}
SCAN_DEFAULTS = {"seq_len": 2048, "batch_size": 8}
SCAN_HEADING = "## Layer scan and remat (compile only)"  # starts --scan's part of bench_train.md
GIB = 2.0**30


def bench_one(cfg: C.Config, mesh, steps: int, warmup: int) -> dict:
  graphdef, state, shardings, _ = create_state(cfg, mesh)
  step = TrainStep(cfg, graphdef, shardings, mesh, None)
  data = SyntheticPipeline(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
  batches = [S.shard_batch(next(data), mesh) for _ in range(4)]
  t0 = time.perf_counter()
  state, m = step(state, batches[0])
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  for i in range(warmup):
    state, m = step(state, batches[i % 4])
  jax.block_until_ready(m)
  times = []
  for i in range(steps):
    t = time.perf_counter()
    state, m = step(state, batches[i % 4])
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t)
  tokens = cfg.batch_size * cfg.seq_len
  med = statistics.median(times)
  return {
    "tokens_per_s": tokens / med,
    "step_s_median": med,
    "step_s_min": min(times),
    "compile_s": compile_s,
    "final_loss": float(m["loss"]),
    "traces": step.traces,
  }


def compile_train_step(cfg: C.Config, mesh, *, constrained: bool = True):
  """The compiled (never run) train step of `cfg` on `mesh`, from abstract state and batch.

  constrained=False traces the step with no mesh in context, so the model's activation
  constraints are no-ops (only the step's in/out shardings pin anything)."""
  return lower_train_step(cfg, mesh, constrained=constrained).compile()


def lower_train_step(cfg: C.Config, mesh, *, constrained: bool = True):
  """`compile_train_step` before XLA: the traced and lowered step."""
  tx = make_optimizer(cfg)
  graphdef, abstract = abstract_state(cfg, tx)
  shardings = S.state_shardings(abstract, mesh)
  step = TrainStep(cfg, graphdef, shardings, mesh, tx)
  state = abstract_with_shardings(abstract, shardings)
  bt = (cfg.batch_size, cfg.seq_len)
  sh = S.batch_sharding(mesh)
  batch = {
    k: jax.ShapeDtypeStruct(bt, dt, sharding=sh)
    for k, dt in (("inputs", "int32"), ("targets", "int32"), ("segment_ids", "int32"), ("loss_mask", "float32"))
  }
  return step.jitted.lower(state, batch) if constrained else step.jitted.jitted.lower(state, batch)


def memory_one(cfg: C.Config, mesh, constrained: bool) -> dict:
  t0 = time.perf_counter()
  compiled = compile_train_step(cfg, mesh, constrained=constrained)
  secs = time.perf_counter() - t0
  m = compiled.memory_analysis()
  return {
    "temp_gib": m.temp_size_in_bytes / GIB,
    "argument_gib": m.argument_size_in_bytes / GIB,
    "output_gib": m.output_size_in_bytes / GIB,
    "alias_gib": m.alias_size_in_bytes / GIB,
    "compile_s": secs,
  }


def _ensure_cpu_devices(n: int) -> None:
  """Simulate n CPU devices if the backend is not up yet (XLA_FLAGS may already ask for them)."""
  from jax._src import xla_bridge

  if not xla_bridge.backends_are_initialized() and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    jax.config.update("jax_num_cpu_devices", n)
  if jax.device_count() < n:
    raise SystemExit(
      f"--memory needs {n} devices, have {jax.device_count()}: run it in a fresh process "
      f"or with XLA_FLAGS=--xla_force_host_platform_device_count={n}"
    )


def memory_main(args, argv) -> dict:
  """--memory: per-device compiled memory of the train step on 1 device, data=8, data=4,model=2."""
  _ensure_cpu_devices(8)
  config = "base110m" if args.config_given is None else args.config_given
  overrides = {**MEMORY_DEFAULTS, **C.parse_overrides(C.CONFIGS[config], args.sets)}
  att = args.attention[0] if args.attention_given else "fpa"
  cfg = C.get_config(config, **{**overrides, "attention": att, "task": "synthetic"})
  rows = []
  for spec in MEMORY_MESHES:
    mesh = (
      S.make_mesh("data=1,model=1", devices=jax.devices()[:1])
      if spec == "single"
      else S.make_mesh(spec, devices=jax.devices()[:8])
    )
    cfg.validate_mesh(dict(mesh.shape))
    row = {"mesh": spec, "devices": mesh.size}
    for constrained in (False, True):
      r = memory_one(cfg, mesh, constrained)
      row["constrained" if constrained else "unconstrained"] = r
      print(
        f"{spec:16s} {'with' if constrained else 'without'} activation constraints: temp "
        f"{r['temp_gib']:.2f} GiB/device (args {r['argument_gib']:.2f}, compile {r['compile_s']:.0f} s)",
        flush=True,
      )
    rows.append(row)
  single = rows[0]["constrained"]["temp_gib"]
  for row in rows:
    row["temp_single_over_this"] = single / row["constrained"]["temp_gib"]
  out = {
    "config": config,
    "overrides": overrides,
    "attention": att,
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "host": platform.node(),
    "rows": rows,
    "command": "python -m experiments.bench_train " + " ".join(argv if argv is not None else sys.argv[1:]),
  }
  path = args.out if args.out_given else "results/bench_train_memory.json"
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  md = os.path.splitext(path)[0] + ".md"
  with open(md, "w") as f:
    f.write(memory_markdown(out))
  print(f"wrote {path} and {md}")
  return out


def memory_markdown(out: dict) -> str:
  """The --memory results as a docs/training.md table."""
  o = out["overrides"]
  lines = [
    f"`{out['command'].strip()}`: config `{out['config']}` ({out['attention']}, {o['n_layers']} layers, "
    f"seq {o['seq_len']}, global batch {o['batch_size']}), train step compiled (not run) on simulated "
    f"{out['backend']} devices, jax {out['jax']}. Per-device XLA `memory_analysis()`; \"without\" = the "
    "same step traced with no mesh in context (activation constraints off, the layout before them).",
    "",
    "| mesh | devices | temp GiB/device without | temp GiB/device with | args GiB/device | "
    "one device temp / this temp |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in out["rows"]:
    name = "one device (data=1)" if r["mesh"] == "single" else r["mesh"]
    lines.append(
      f"| {name} | {r['devices']} | {r['unconstrained']['temp_gib']:.2f} | "
      f"{r['constrained']['temp_gib']:.2f} | {r['constrained']['argument_gib']:.2f} | "
      f"{r['temp_single_over_this']:.1f}x |"
    )
  return "\n".join(lines) + "\n"


def scan_main(args, argv) -> dict:
  """--scan: compile time and per-device temp memory of the step, {unscanned, scanned} x remat x depth."""
  _ensure_cpu_devices(8)
  config = "base110m" if args.config_given is None else args.config_given
  overrides = {**SCAN_DEFAULTS, **C.parse_overrides(C.CONFIGS[config], args.sets)}
  att = args.attention[0] if args.attention_given else "fpa"
  spec = args.mesh or "data=8"
  mesh = S.make_mesh(spec, devices=jax.devices()[:8])
  depths = [int(d) for d in args.depths.split(",")]
  remats = args.remats.split(",")
  out = {
    "config": config,
    "overrides": overrides,
    "attention": att,
    "mesh": spec,
    "backend": jax.default_backend(),
    "jax": jax.__version__,
    "host": platform.node(),
    "rows": [],
    "command": "python -m experiments.bench_train " + " ".join(argv if argv is not None else sys.argv[1:]),
  }
  grid = [(d, sc, r) for d in depths for sc in (False, True) for r in remats]
  rows = {}
  # Wall-clock seconds on a shared host drift with its load: every cell is compiled `repeats` times,
  # odd passes in reverse order, and the table keeps the fastest (temp memory is deterministic).
  for rep in range(args.repeats):
    for depth, scan, remat in grid if rep % 2 == 0 else grid[::-1]:
      cfg = C.get_config(
        config,
        **{**overrides, "n_layers": depth, "scan_layers": scan, "remat": remat, "attention": att, "task": "synthetic"},
      )
      cfg.validate_mesh(dict(mesh.shape))
      t0 = time.perf_counter()
      lowered = lower_train_step(cfg, mesh)
      t1 = time.perf_counter()
      m = lowered.compile().memory_analysis()
      t2 = time.perf_counter()
      row = rows.setdefault(
        (depth, scan, remat),
        {"n_layers": depth, "scan_layers": scan, "remat": remat, "lower_s_all": [], "compile_s_all": []},
      )
      row["lower_s_all"].append(t1 - t0)
      row["compile_s_all"].append(t2 - t1)
      row.update(
        lower_s=min(row["lower_s_all"]),
        compile_s=min(row["compile_s_all"]),
        temp_gib=m.temp_size_in_bytes / GIB,
        argument_gib=m.argument_size_in_bytes / GIB,
      )
      print(
        f"{depth:2d} layers {'scanned' if scan else 'unrolled':8s} remat {remat:13s} lower {t1 - t0:6.1f} s  "
        f"compile {t2 - t1:6.1f} s  temp {row['temp_gib']:.2f} GiB/device",
        flush=True,
      )
      out["rows"] = [rows[k] for k in grid if k in rows]
      out["repeats"] = rep + 1
      _write_scan(args.out, out)  # after every compile: a long run leaves its partial table
  print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.md")
  return out


def _write_scan(path: str, scan: dict) -> None:
  """Merge `scan` into the results json (key "scan") and its section of the md; the rest stays."""
  old = {}
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump({**old, "scan": scan}, f, indent=1)
  md = os.path.splitext(path)[0] + ".md"
  head = ""
  if os.path.exists(md):
    with open(md) as f:
      head = f.read().split(SCAN_HEADING)[0].rstrip("\n")
  with open(md, "w") as f:
    f.write((head + "\n\n" if head else "") + scan_markdown(scan))


def scan_markdown(out: dict) -> str:
  """The --scan results as a docs/training.md table (one row per depth x layout x remat)."""
  o = out["overrides"]
  lines = [
    SCAN_HEADING,
    "",
    f"`{out['command'].strip()}`: config `{out['config']}` ({out['attention']}, seq "
    f"{o['seq_len']}, global batch {o['batch_size']}), train step traced, lowered and compiled (not run) on "
    f"{out['mesh']} simulated {out['backend']} devices, jax {out['jax']}. `lower s`: Python tracing + "
    "lowering; `compile s`: XLA; fastest of "
    f"{out.get('repeats', 1)} compile(s) per row, wall-clock on a shared CPU host (compare within the table "
    "only); temp: per-device `memory_analysis().temp_size_in_bytes`.",
    "",
    "| layers | blocks | remat | lower s | compile s | temp GiB/device |",
    "|---:|---|---|---:|---:|---:|",
  ]
  for r in out["rows"]:
    lines.append(
      f"| {r['n_layers']} | {'scanned' if r['scan_layers'] else 'unrolled'} | {r['remat']} | "
      f"{r['lower_s']:.1f} | {r['compile_s']:.1f} | {r['temp_gib']:.2f} |"
    )
  return "\n".join(lines + _scan_summary(out["rows"])) + "\n"


def _scan_summary(rows: list[dict]) -> list[str]:
  """Depth scaling of lower + compile seconds (remat none) and the remat temp-memory ratios."""
  cell = {(r["n_layers"], r["scan_layers"], r["remat"]): r for r in rows}
  depths = sorted({r["n_layers"] for r in rows})
  lo, hi = depths[0], depths[-1]
  secs = lambda r: r["lower_s"] + r["compile_s"]
  out = []
  for scan in (False, True):
    name = "scanned" if scan else "unrolled"
    a, b = cell.get((lo, scan, "none")), cell.get((hi, scan, "none"))
    if a and b and hi > lo:
      out.append(
        f"- {name}, remat none: lower + compile {secs(a):.0f} s at {lo} layers, {secs(b):.0f} s at {hi} "
        f"({secs(b) / secs(a):.2f}x for {hi / lo:.0f}x the layers)."
      )
    base = cell.get((hi, scan, "none"))
    for r in rows:
      if base and r["n_layers"] == hi and r["scan_layers"] == scan and r["remat"] != "none":
        out.append(
          f"- {name}, {hi} layers, remat {r['remat']}: temp {r['temp_gib'] / base['temp_gib']:.2f}x remat none's."
        )
  return [""] + out if out else []


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="small", choices=sorted(C.CONFIGS))
  ap.add_argument("--attention", nargs="+", default=["fpa", "fox", "softmax"], choices=C.ATTENTIONS)
  ap.add_argument("--steps", type=int, default=30, help="timed steps per attention type")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="5 timed steps, 1 warmup")
  ap.add_argument("--mesh", default=None)
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--out", default="results/bench_train.json")
  ap.add_argument("--evict", action="store_true", help="also time each gated attention with the evictability objective")
  ap.add_argument("--evict-weight", type=float, default=1.0, help="--evict: the objective's weight")
  ap.add_argument("--budget-loop", action="store_true", help="also time each gated attention with budget in the loop")
  ap.add_argument(
    "--memory",
    action="store_true",
    help="compile only: per-device memory of base110m (2 layers, seq 2048, batch 8) on 1 device, "
    "data=8 and data=4,model=2 -> results/bench_train_memory.{json,md}",
  )
  ap.add_argument(
    "--scan",
    action="store_true",
    help="compile only: compile s and temp memory of base110m (seq 2048, batch 8, data=8) for "
    "{unscanned, scanned} x --remats x --depths -> a section of results/bench_train.{json,md}",
  )
  ap.add_argument("--depths", default="2,8", help="--scan: comma-separated n_layers values")
  ap.add_argument("--remats", default="none,full,dots", help=f"--scan: comma-separated, from {C.REMATS}")
  ap.add_argument("--repeats", type=int, default=2, help="--scan: compiles per cell (the fastest is reported)")
  raw = list(sys.argv[1:] if argv is None else argv)
  args = ap.parse_args(argv)
  if args.memory or args.scan:
    given = lambda flag: any(a == flag or a.startswith(flag + "=") for a in raw)
    args.config_given = args.config if given("--config") else None
    args.attention_given, args.out_given = given("--attention"), given("--out")
    return memory_main(args, argv) if args.memory else scan_main(args, argv)
  if args.quick:
    args.steps, args.warmup = 5, 1
  overrides = C.parse_overrides(C.CONFIGS[args.config], args.sets)
  mesh = S.make_mesh(args.mesh)
  results = {}
  for att in args.attention:
    cfg = C.get_config(args.config, **{**overrides, "attention": att, "task": "synthetic"})
    cfg.validate_mesh(dict(mesh.shape))
    runs = [(att, cfg)]
    if args.evict and att in C.GATED:
      runs.append((f"{att}+evict", C.replace(cfg, evict_weight=args.evict_weight)))
    if args.budget_loop and att in C.GATED:
      runs.append((f"{att}+budget", C.replace(cfg, budget_loop_prob=1.0)))
    for name, c in runs:
      results[name] = bench_one(c, mesh, args.steps, args.warmup)
      print(
        f"{name:12s} {results[name]['tokens_per_s']:12.0f} tokens/s  (step {results[name]['step_s_median'] * 1e3:.1f} "
        f"ms, compile {results[name]['compile_s']:.1f} s)",
        flush=True,
      )
  out = {
    "config": args.config,
    "overrides": overrides,
    "mesh": dict(mesh.shape),
    "steps": args.steps,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "host": platform.node(),
    "jax": jax.__version__,
    "results": results,
  }
  if "fpa" in results and "fox" in results:
    out["fpa_over_fox"] = results["fpa"]["tokens_per_s"] / results["fox"]["tokens_per_s"]
    print(f"FPA / FoX throughput: {out['fpa_over_fox']:.3f} (target >= 0.9)")
  if "softmax" in results and "fox" in results:
    out["fox_over_softmax"] = results["fox"]["tokens_per_s"] / results["softmax"]["tokens_per_s"]
  for suffix, key, what in (
    ("evict", "evict_step_over_plain", "evictability objective"),
    ("budget", "budget_step_over_plain", "budget in the loop"),
  ):
    cost = {
      a: results[f"{a}+{suffix}"]["step_s_median"] / results[a]["step_s_median"]
      for a in args.attention
      if f"{a}+{suffix}" in results
    }
    if cost:
      out[key] = cost
      print(f"{what}, step time / plain step: " + ", ".join(f"{a} {r:.3f}" for a, r in cost.items()))
  out["command"] = "python -m experiments.bench_train " + " ".join(argv if argv is not None else sys.argv[1:])
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  scan = None
  if os.path.exists(args.out):  # keep --scan's section
    with open(args.out) as f:
      scan = json.load(f).get("scan")
  with open(args.out, "w") as f:
    json.dump(out if scan is None else {**out, "scan": scan}, f, indent=1)
  md = os.path.splitext(args.out)[0] + ".md"
  with open(md, "w") as f:
    f.write(markdown(out) + ("" if scan is None else "\n" + scan_markdown(scan)))
  print(f"wrote {args.out} and {md}")
  return out


def markdown(out: dict) -> str:
  """The results as a docs/training.md table."""
  cfg = C.get_config(out["config"], **out["overrides"])
  lines = [
    f"`{out['command'].strip()}`: config `{out['config']}` (d_model {cfg.d_model}, {cfg.n_layers} layers, "
    f"{cfg.n_heads} heads, seq {cfg.seq_len}, batch {cfg.batch_size}, block {cfg.block_size or 'default'}), "
    f"{out['devices']} {out['backend']} device(s), jax {out['jax']}, median of {out['steps']} steps.",
    "",
    "| attention | tokens/s | step ms (median) | compile s |",
    "|---|---:|---:|---:|",
  ]
  for att, r in out["results"].items():
    lines.append(f"| {att} | {r['tokens_per_s']:.0f} | {r['step_s_median'] * 1e3:.1f} | {r['compile_s']:.1f} |")
  if "fpa_over_fox" in out:
    ratio = out["fpa_over_fox"]
    lines += ["", f"FPA / FoX throughput: **{ratio:.3f}** (target ≥ 0.9: {'met' if ratio >= 0.9 else 'not met'})."]
  if out.get("evict_step_over_plain"):
    cost = ", ".join(f"{a} {r:.3f}" for a, r in out["evict_step_over_plain"].items())
    lines += ["", f"Evictability objective (`<attention>+evict` rows), step time over the plain step: {cost}."]
  if out.get("budget_step_over_plain"):
    cost = ", ".join(f"{a} {r:.3f}" for a, r in out["budget_step_over_plain"].items())
    lines += [
      "",
      f"Budget in the loop (`<attention>+budget` rows, every step budgeted), step time over the plain step: {cost}.",
    ]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
