"""Attention speed and memory: FPA (chunked / quadratic / recurrent) vs FoX vs XLA dense softmax.

    python -m experiments.bench_attention            # full sweep, T = 512 .. 16384 (~15 min, 2-core CPU)
    python -m experiments.bench_attention --quick    # T = 512, 1024 (a minute)
    python -m experiments.bench_attention --no-sweep --blocks 128 256 512 --skip-bench --repeats 9
        # chunked FPA vs FoX at T=4096 per block size, and dead-tile skipping; keeps the sweep's rows
    python -m experiments.bench_attention --backend gpu   # on an accelerator: Pallas FPA / FoX vs
        # chunked FPA vs cuDNN softmax (GPU); writes results/bench_attention_gpu.*; fails if no GPU

B=1, H=4, D=64, fp32. For every method and T: forward and forward+backward wall time (best of
--repeats, all methods of one T interleaved, each timed call after an untimed one) and XLA's
compiled temp memory (`.lower().compile().memory_analysis()`).
A variant whose compiled temp memory exceeds --mem-budget-gib is compiled but not run
("skipped"). Writes results/bench_attention.{json,md,png} and prints the speed targets as
measured ratios. FLOP convention (FlashAttention's): causal forward = 2 * B*H*T^2*D (two
matmuls over the lower triangle), backward = 2.5 x forward.

--blocks: chunked FPA and FoX fwd+bwd at --sweep-t for each block size, run side by side (the
repeats interleave every kernel, so load on a shared machine hits them alike), each kernel then
taken at its best block. --skip-bench: fwd+bwd with and without `skip_tolerance` on a walk whose
field dips at scope closures (FoX: hard forget resets there), and the fraction of tiles dropped.
Both record wall and process-CPU time, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from fpa_jax.ops import fox_attention, fpa_attention

B, H, D = 1, 4, 64
TARGET_T, MEMORY_T = 4096, 16384


def _methods(block_size):
  fpa = lambda impl, **kw: lambda q, k, v, f, l: fpa_attention(q, k, v, f, l, impl=impl, **kw)
  return {
    "fpa_chunked": (fpa("chunked", block_size=block_size), None),
    "fox_chunked": (lambda q, k, v, f, l: fox_attention(q, k, v, f, block_size=block_size), None),
    "xla_dense_softmax": (
      lambda q, k, v, f, l: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
      None,
    ),
    # Reference formulations: O(T^2) memory / O(T) sequential steps; run only where they fit.
    "fpa_quadratic": (fpa("quadratic"), 8192),
    "fpa_recurrent": (fpa("recurrent"), 1024),
    # Accelerator kernels (`--backend gpu|tpu`; on CPU Pallas only runs in its slow interpreter).
    "fpa_pallas": (fpa("pallas", block_size=block_size), None),
    "fox_pallas": (lambda q, k, v, f, l: fox_attention(q, k, v, f, impl="pallas", block_size=block_size), None),
    # cuDNN's fused attention takes fp16 / bf16 only: inputs cast to bf16 (fp32 softmax stats).
    "cudnn_softmax_bf16": (
      lambda q, k, v, f, l: jax.nn.dot_product_attention(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)), is_causal=True, implementation="cudnn"
      ),
      None,
    ),
  }


ACCEL_METHODS = ("fpa_pallas", "fox_pallas", "cudnn_softmax_bf16")


def backend_methods(backend):
  """Default methods for --backend: the CPU sweep, or the side-by-side accelerator table. Exits
  with a clear message when the backend is not the one JAX runs on."""
  have = jax.default_backend()
  if backend != have:
    try:
      devs = jax.devices(backend)
    except RuntimeError:
      devs = []
    hint = (
      f"JAX sees {backend} devices {devs} but defaults to {have}: set JAX_PLATFORMS={backend}"
      if devs
      else f"no {backend} device visible to JAX (default backend: {have}); install an accelerator jax "
      f"(pip install 'fpa_jax[cuda]' or 'fpa_jax[tpu]') on a machine with one"
    )
    raise SystemExit(f"--backend {backend}: {hint}")
  if backend == "cpu":
    return [m for m in _methods(None) if m not in ACCEL_METHODS]
  methods = ["fpa_pallas", "fox_pallas", "fpa_chunked", "fox_chunked", "xla_dense_softmax"]
  if backend == "gpu":
    try:  # "where present": cuDNN attention needs a recent enough GPU / cuDNN
      x = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
      jax.jit(lambda x: jax.nn.dot_product_attention(x, x, x, is_causal=True, implementation="cudnn"))(x)
      methods.append("cudnn_softmax_bf16")
    except Exception as e:  # noqa: BLE001 (any failure means: not available here)
      print(f"cudnn attention not available, left out: {type(e).__name__}: {e}", file=sys.stderr)
  return methods


def _inputs(t, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, t, H, D)), jnp.float32) for _ in range(3))
  # A gate in FoX's range: log-forget increments <= 0 for FoX, a free walk for FPA.
  f = jnp.asarray(-np.abs(rng.normal(scale=0.1, size=(B, t, H))), jnp.float32)
  l = jnp.asarray(rng.normal(size=(B, t, H)), jnp.float32)
  return q, k, v, f, l


def _compile(fn, args):
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  return compiled, (int(mem.temp_size_in_bytes) if mem is not None else None)


def _time(compiled, args, repeats):
  jax.block_until_ready(compiled(*args))  # warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def _time_side_by_side(compiled, repeats, rewarm=False):
  """{key: (wall_s, cpu_s)}, each the best of `repeats`; compiled: {key: (fn, args)}. The repeats
  interleave the keys, so a busy spell on a shared machine slows them alike.

  rewarm: one untimed call before each timed one. For mixes of light and heavy kernels: a run
  right after one with GiBs of temp memory measured ~1.4x slower in wall and CPU time (at T=4096,
  chunked FPA after the quadratic reference), which would bias whichever kernel comes first.
  """
  for fn, args in compiled.values():
    jax.block_until_ready(fn(*args))  # warm-up
  wall = {key: [] for key in compiled}
  cpu = {key: [] for key in compiled}
  for _ in range(repeats):
    for key, (fn, args) in compiled.items():
      if rewarm:
        jax.block_until_ready(fn(*args))
      c0, t0 = time.process_time(), time.perf_counter()
      jax.block_until_ready(fn(*args))
      wall[key].append(time.perf_counter() - t0)
      cpu[key].append(time.process_time() - c0)
  return {key: (min(wall[key]), min(cpu[key])) for key in compiled}


def _load_avg():
  return [round(x, 2) for x in os.getloadavg()]


def _cores():
  """CPU cores this process may run on (taskset pins it to fewer than os.cpu_count())."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _chunked(kind, block, skip=None):
  """Chunked FPA (gates f, l) or FoX (log forget gate f) as fn(q, k, v, f, l)."""
  if kind == "fpa_chunked":
    return lambda q, k, v, f, l: fpa_attention(q, k, v, f, l, block_size=block, skip_tolerance=skip)
  return lambda q, k, v, f, l: fox_attention(q, k, v, f, block_size=block, skip_tolerance=skip)


def _fwdbwd(fn):
  return jax.grad(lambda q, k, v, f, l: jnp.sum(fn(q, k, v, f, l) * v), argnums=(0, 1, 2, 3, 4))


def block_sweep(t, blocks, repeats):
  """Chunked FPA and FoX fwd+bwd at length t for each block size, side by side."""
  args = _inputs(t)
  kinds = ("fpa_chunked", "fox_chunked")
  compiled = {(kind, blk): (_compile(_fwdbwd(_chunked(kind, blk)), args)[0], args) for kind in kinds for blk in blocks}
  load_before = _load_avg()
  times = _time_side_by_side(compiled, repeats)
  rows = [{"method": kind, "block": blk, "fwdbwd_s": w, "fwdbwd_cpu_s": c} for (kind, blk), (w, c) in times.items()]
  best = {
    kind: {
      clock: min((r for r in rows if r["method"] == kind), key=lambda r: r[key])
      for clock, key in (("wall", "fwdbwd_s"), ("cpu", "fwdbwd_cpu_s"))
    }
    for kind in kinds
  }
  ratio = {
    clock: best["fpa_chunked"][clock][key] / best["fox_chunked"][clock][key]
    for clock, key in (("wall", "fwdbwd_s"), ("cpu", "fwdbwd_cpu_s"))
  }
  return {
    "T": t,
    "blocks": list(blocks),
    "repeats": repeats,
    "rows": rows,
    "best": best,
    "fpa_over_fox_at_best_blocks": ratio,
    "load_avg_before": load_before,
    "load_avg_after": _load_avg(),
    "cores": _cores(),
  }


def scope_closure_inputs(t, seed=0, depth=100.0, scope=(256, 768)):
  """q, k, v ~ N(0, 1) [B, T, H, D]. FPA: a slow walk (level = the walk) whose field dips by
  `depth` at scope closures spaced uniformly in `scope` tokens, shared by the heads, so every key
  before a closure is penalised by ~depth from then on. FoX: log forget gates of a slow decay
  with a hard reset (-depth) at the same closures. Returns (q, k, v, field, level, log_fgate)."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, t, H, D)), jnp.float32) for _ in range(3))
  closures = np.zeros(t, bool)
  pos = int(rng.integers(*scope))
  while pos < t:
    closures[pos] = True
    pos += int(rng.integers(*scope))
  walk = np.cumsum(rng.normal(scale=0.1, size=(B, t, H)), 1)
  field = np.where(closures[None, :, None], walk - depth, walk)
  logf = np.where(closures[None, :, None], -depth, -np.abs(rng.normal(scale=0.01, size=(B, t, H))))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return q, k, v, f32(field), f32(walk), f32(logf)


def skip_bench(t, block, tolerance, repeats):
  """fwd+bwd with and without skip_tolerance on `scope_closure_inputs`, and the tiles dropped."""
  from fpa_jax.ops import bias, chunked

  block = chunked.block_for(t, block)
  q, k, v, field, level, logf = scope_closure_inputs(t)
  biases = {
    "fpa_chunked": ((q, k, v, field, level), bias.FPABias(field, level)),
    "fox_chunked": ((q, k, v, logf, level), bias.FoXBias(jnp.cumsum(logf, 1))),
  }
  compiled = {
    (kind, skip): (_compile(_fwdbwd(_chunked(kind, block, skip)), args)[0], args)
    for kind, (args, _) in biases.items()
    for skip in (None, tolerance)
  }
  load_before = _load_avg()
  times = _time_side_by_side(compiled, repeats)
  rows = []
  for kind, (_, b) in biases.items():
    per_head, all_heads = chunked.skipped_tile_fraction(q, k, b, skip_tolerance=tolerance, block_size=block)
    (w0, c0), (w1, c1) = times[(kind, None)], times[(kind, tolerance)]
    rows.append(
      {
        "method": kind,
        "exact_fwdbwd_s": w0,
        "skip_fwdbwd_s": w1,
        "exact_fwdbwd_cpu_s": c0,
        "skip_fwdbwd_cpu_s": c1,
        "speedup_wall": w0 / w1,
        "speedup_cpu": c0 / c1,
        "tiles_skipped_per_head": per_head,
        "tiles_skipped_all_heads": all_heads,
      }
    )
  return {
    "T": t,
    "block": block,
    "skip_tolerance": tolerance,
    "repeats": repeats,
    "rows": rows,
    "load_avg_before": load_before,
    "load_avg_after": _load_avg(),
    "cores": _cores(),
  }


def matmul_gflops(n=2048, repeats=5):
  """The machine's measured fp32 matmul throughput (jit, n x n x n)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  return 2 * n**3 / _time(f.lower(a, a).compile(), (a, a), repeats) / 1e9


def run(seq_lens, repeats, block_size, mem_budget_gib, only=None):
  rows = []
  budget = mem_budget_gib * 2**30
  methods = _methods(block_size)
  if only:
    unknown = sorted(set(only) - set(methods))
    if unknown:
      raise ValueError(f"unknown method(s) {unknown}; choose from {sorted(methods)}")
    methods = {k: v for k, v in methods.items() if k in only}
  for t in tqdm(seq_lens, desc="bench_attention", unit="T"):
    # Every method at this T is compiled first and then timed side by side (interleaved
    # repeats), so a busy spell on a shared machine slows them alike instead of one cell.
    args = _inputs(t)
    flops_f = 2 * B * H * t * t * D
    by_t, compiled = {}, {}
    for name, (fn, max_t) in methods.items():
      row = by_t[name] = {"method": name, "T": t}
      if max_t is not None and t > max_t:
        row["skipped"] = f"reference impl, run up to T={max_t}"
        continue
      loss = lambda q, k, v, f, l, fn=fn: jnp.sum(fn(q, k, v, f, l) * v)
      fb = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
      for tag, f_ in (("fwd", fn), ("fwdbwd", fb)):
        exe, temp = _compile(f_, args)
        row[f"{tag}_temp_bytes"] = temp
        if temp is not None and temp > budget:
          row[f"{tag}_skipped"] = f"temp {temp / 2**30:.1f} GiB > budget {mem_budget_gib} GiB"
        else:
          compiled[(name, tag)] = (exe, args)
    for (name, tag), (secs, _) in _time_side_by_side(compiled, repeats, rewarm=True).items():
      by_t[name][f"{tag}_s"] = secs
      by_t[name][f"{tag}_gflops"] = (3.5 if tag == "fwdbwd" else 1.0) * flops_f / secs / 1e9
    rows += by_t.values()
    del compiled
  return rows


def _get(rows, method, t, key):
  for r in rows:
    if r["method"] == method and r["T"] == t:
      return r.get(key)
  return None


def targets(rows, sweep=None):
  """The speed targets as measured ratios (None where a side was not measured); sweep: the
  `block_sweep` result, for FPA vs FoX each at its best block."""
  ratio = lambda a, b: (a / b) if (a is not None and b) else None
  fpa = _get(rows, "fpa_chunked", TARGET_T, "fwdbwd_s")
  mem = _get(rows, "fpa_chunked", MEMORY_T, "fwdbwd_temp_bytes")
  out = {
    f"fpa_chunked_fwdbwd_over_xla_dense_T{TARGET_T}": (
      ratio(fpa, _get(rows, "xla_dense_softmax", TARGET_T, "fwdbwd_s")),
      1.0,
    ),
    f"fpa_chunked_fwdbwd_over_fox_chunked_T{TARGET_T}": (
      ratio(fpa, _get(rows, "fox_chunked", TARGET_T, "fwdbwd_s")),
      1.25,
    ),
    f"fpa_chunked_fwdbwd_temp_over_dense_TxT_fp32_T{MEMORY_T}": (ratio(mem, MEMORY_T * MEMORY_T * 4), 1 / 16),
    f"fpa_chunked_fwd_over_xla_dense_T{TARGET_T}": (
      ratio(_get(rows, "fpa_chunked", TARGET_T, "fwd_s"), _get(rows, "xla_dense_softmax", TARGET_T, "fwd_s")),
      None,
    ),
  }
  if sweep is not None:
    for clock in ("wall", "cpu"):
      out[f"fpa_chunked_fwdbwd_over_fox_chunked_best_blocks_{clock}_T{sweep['T']}"] = (
        sweep["fpa_over_fox_at_best_blocks"][clock],
        1.1,
      )
  return {
    k: {"measured": v, "target_max": tgt, "met": None if v is None or tgt is None else bool(v <= tgt)}
    for k, (v, tgt) in out.items()
  }


def _fmt(x, kind):
  if x is None:
    return "—"
  if kind == "s":
    return f"{x * 1e3:.0f}" if x >= 0.01 else f"{x * 1e3:.2f}"
  if kind == "b":
    return f"{x / 2**20:.1f}"
  return f"{x:.1f}"


def markdown(result):
  lines = [
    f"B={B}, H={H}, D={D}, fp32, block={result['block_size']}, {result['machine']}; "
    f"measured fp32 matmul: {result['matmul_gflops']:.1f} GFLOP/s.",
    "",
    "| method | T | fwd ms | fwd+bwd ms | fwd+bwd GFLOP/s | fwd temp MiB | fwd+bwd temp MiB |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in result["rows"]:
    if "skipped" in r:
      continue
    fb = _fmt(r.get("fwdbwd_s"), "s") if "fwdbwd_skipped" not in r else "skipped (memory)"
    fw = _fmt(r.get("fwd_s"), "s") if "fwd_skipped" not in r else "skipped (memory)"
    lines.append(
      f"| {r['method']} | {r['T']} | {fw} | {fb} | {_fmt(r.get('fwdbwd_gflops'), 'g')} | "
      f"{_fmt(r.get('fwd_temp_bytes'), 'b')} | {_fmt(r.get('fwdbwd_temp_bytes'), 'b')} |"
    )
  lines += ["", "| target | measured | required | met |", "|---|---:|---:|---|"]
  for k, t in result["targets"].items():
    m = "—" if t["measured"] is None else f"{t['measured']:.3f}"
    req = "—" if t["target_max"] is None else f"≤ {t['target_max']:.3g}"
    lines.append(f"| {k} | {m} | {req} | {t['met'] if t['met'] is not None else '—'} |")
  return "\n".join(lines) + "\n"


def markdown_sections(result):
  """The block sweep and skipping tables, when they were run."""
  lines = []
  if "block_sweep" in result:
    s = result["block_sweep"]
    lines += [
      "",
      f"Block sweep, T={s['T']}, fwd+bwd, best of {s['repeats']} interleaved runs on {s['cores']} "
      f"core(s); load average {s['load_avg_before']} before, {s['load_avg_after']} after "
      f"(`{s['command']}`):",
      "",
      "| method | block | fwd+bwd ms (wall) | fwd+bwd ms (process CPU) |",
      "|---|---:|---:|---:|",
    ]
    for r in s["rows"]:
      lines.append(f"| {r['method']} | {r['block']} | {_fmt(r['fwdbwd_s'], 's')} | {_fmt(r['fwdbwd_cpu_s'], 's')} |")
    best = lambda kind, clock: s["best"][kind][clock]["block"]
    lines += [
      "",
      f"At each kernel's best block, FPA / FoX = {s['fpa_over_fox_at_best_blocks']['wall']:.3f} wall "
      f"(blocks {best('fpa_chunked', 'wall')} / {best('fox_chunked', 'wall')}), "
      f"{s['fpa_over_fox_at_best_blocks']['cpu']:.3f} process CPU "
      f"(blocks {best('fpa_chunked', 'cpu')} / {best('fox_chunked', 'cpu')}).",
    ]
  if "skipping" in result:
    s = result["skipping"]
    lines += [
      "",
      f"Dead-tile skipping, T={s['T']}, block {s['block']}, skip_tolerance={s['skip_tolerance']:g}, "
      f"walk with scope closures every 256-768 tokens (`scope_closure_inputs`); best of {s['repeats']} "
      f"on {s['cores']} core(s); load average {s['load_avg_before']} before, {s['load_avg_after']} after "
      f"(`{s['command']}`):",
      "",
      "| method | exact fwd+bwd ms | skipping fwd+bwd ms | speedup (wall / CPU) | tiles dropped "
      "per head | tiles skipped (all heads) |",
      "|---|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
      lines.append(
        f"| {r['method']} | {_fmt(r['exact_fwdbwd_s'], 's')} | {_fmt(r['skip_fwdbwd_s'], 's')} | "
        f"{r['speedup_wall']:.2f} / {r['speedup_cpu']:.2f} | {r['tiles_skipped_per_head']:.2f} | "
        f"{r['tiles_skipped_all_heads']:.2f} |"
      )
  if lines and result.get("sweep_kept_from"):
    lines += ["", f"(The T sweep above is the earlier run `{result['sweep_kept_from']}`.)"]
  return "\n".join(lines) + ("\n" if lines else "")


def plot(result, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for name in dict.fromkeys(r["method"] for r in result["rows"]):
    rs = [r for r in result["rows"] if r["method"] == name]
    ts = [r["T"] for r in rs if r.get("fwdbwd_s")]
    axes[0].plot(ts, [r["fwdbwd_s"] for r in rs if r.get("fwdbwd_s")], "o-", label=name)
    tm = [r["T"] for r in rs if r.get("fwdbwd_temp_bytes")]
    axes[1].plot(tm, [r["fwdbwd_temp_bytes"] / 2**20 for r in rs if r.get("fwdbwd_temp_bytes")], "o-", label=name)
  axes[0].set(xscale="log", yscale="log", xlabel="T", ylabel="fwd+bwd seconds", title="time (fwd+bwd)")
  axes[1].set(xscale="log", yscale="log", xlabel="T", ylabel="MiB", title="XLA temp memory (fwd+bwd)")
  for ax in axes:
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"B={B} H={H} D={D} fp32 — {result['machine']}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    "--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096, 8192, 16384]
  )
  p.add_argument("--quick", action="store_true", help="T = 512, 1024 only")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--block-size", type=int, default=None)
  p.add_argument("--mem-budget-gib", type=float, default=6.0)
  p.add_argument(
    "--methods", type=lambda s: s.split(","), default=None, help="comma-separated subset of methods (default: all)"
  )
  p.add_argument("--out-dir", default="results")
  p.add_argument(
    "--backend",
    choices=("cpu", "gpu", "tpu"),
    default=None,
    help="require this JAX backend and run its default methods (gpu / tpu: Pallas vs chunked vs "
    "XLA / cuDNN softmax) into results/bench_attention_<backend>.*",
  )
  p.add_argument(
    "--blocks",
    type=int,
    nargs="+",
    default=None,
    help="block sizes for the chunked FPA vs FoX sweep at --sweep-t (each kernel at its best)",
  )
  p.add_argument("--sweep-t", type=int, default=TARGET_T)
  p.add_argument("--skip-bench", action="store_true", help="fwd+bwd with vs without skip_tolerance at --sweep-t")
  p.add_argument("--skip-tolerance", type=float, default=1e-3)
  p.add_argument(
    "--no-sweep",
    action="store_true",
    help="run no T sweep: keep the rows of the existing results JSON, add --blocks / --skip-bench",
  )
  a = p.parse_args(argv)
  command = "python -m experiments.bench_attention " + " ".join(argv if argv is not None else sys.argv[1:])
  if a.backend is not None:
    default = backend_methods(a.backend)  # exits when the backend is not there
  else:
    default = [m for m in _methods(None) if m not in ACCEL_METHODS]
  a.methods = a.methods or default
  stem = "bench_attention" if a.backend in (None, "cpu") else f"bench_attention_{a.backend}"
  seq_lens = [512, 1024] if a.quick else a.seq_lens
  from fpa_jax.ops.chunked import DEFAULT_BLOCK, block_for

  out = Path(a.out_dir)
  if a.no_sweep:
    result = json.loads((out / f"{stem}.json").read_text())
    result["sweep_kept_from"] = result["command"]
  else:
    result = {
      "machine": f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} {jax.default_backend()} "
      f"({jax.devices()[0].device_kind})",
      "block_size": block_for(max(seq_lens), a.block_size),
      "matmul_gflops": matmul_gflops(),
      "command": command,
    }
    result["rows"] = run(seq_lens, a.repeats, a.block_size, a.mem_budget_gib, a.methods)
  if a.blocks:
    result["block_sweep"] = block_sweep(a.sweep_t, a.blocks, a.repeats) | {"command": command}
  if a.skip_bench:
    blk = a.block_size or DEFAULT_BLOCK
    result["skipping"] = skip_bench(a.sweep_t, blk, a.skip_tolerance, a.repeats) | {"command": command}
  result["targets"] = targets(result["rows"], result.get("block_sweep"))
  out.mkdir(parents=True, exist_ok=True)
  md = markdown(result) + markdown_sections(result)
  (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
  (out / f"{stem}.md").write_text(md)
  plot(result, out / f"{stem}.png")
  print(md)
  print(f"wrote {out}/{stem}.{{json,md,png}}")


if __name__ == "__main__":
  main()
