"""Attention speed and memory: FPA (chunked / quadratic / recurrent) vs FoX vs XLA dense softmax.

    python -m experiments.bench_attention            # full sweep, T = 512 .. 16384 (~15 min, 2-core CPU)
    python -m experiments.bench_attention --quick    # T = 512, 1024 (a minute)

B=1, H=4, D=64, fp32. For every method and T: forward and forward+backward wall time (best of
--repeats after one warm-up) and XLA's compiled temp memory (`.lower().compile().memory_analysis()`).
A variant whose compiled temp memory exceeds --mem-budget-gib is compiled but not run
("skipped"). Writes results/bench_attention.{json,md,png} and prints the issue's targets as
measured ratios. FLOP convention (FlashAttention's): causal forward = 2 * B*H*T^2*D (two
matmuls over the lower triangle), backward = 2.5 x forward.
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
  fpa = lambda impl, **kw: (lambda q, k, v, f, l: fpa_attention(q, k, v, f, l, impl=impl, **kw))
  return {
      "fpa_chunked": (fpa("chunked", block_size=block_size), None),
      "fox_chunked": (lambda q, k, v, f, l: fox_attention(q, k, v, f, block_size=block_size), None),
      "xla_dense_softmax": (
          lambda q, k, v, f, l: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"), None),
      # Reference formulations: O(T^2) memory / O(T) sequential steps; run only where they fit.
      "fpa_quadratic": (fpa("quadratic"), 8192),
      "fpa_recurrent": (fpa("recurrent"), 1024),
  }


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


def matmul_gflops(n=2048, repeats=5):
  """The machine's measured fp32 matmul throughput (jit, n x n x n)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  return 2 * n ** 3 / _time(f.lower(a, a).compile(), (a, a), repeats) / 1e9


def run(seq_lens, repeats, block_size, mem_budget_gib, only=None):
  rows = []
  budget = mem_budget_gib * 2 ** 30
  methods = _methods(block_size)
  if only:
    unknown = sorted(set(only) - set(methods))
    if unknown:
      raise ValueError(f"unknown method(s) {unknown}; choose from {sorted(methods)}")
    methods = {k: v for k, v in methods.items() if k in only}
  todo = [(t, m) for t in seq_lens for m in methods]
  for t, name in tqdm(todo, desc="bench_attention", unit="cfg"):
    fn, max_t = methods[name]
    row = {"method": name, "T": t}
    if max_t is not None and t > max_t:
      rows.append(row | {"skipped": f"reference impl, run up to T={max_t}"})
      continue
    args = _inputs(t)
    loss = lambda q, k, v, f, l: jnp.sum(fn(q, k, v, f, l) * v)
    fb = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    flops_f = 2 * B * H * t * t * D
    for tag, f_, flops in (("fwd", fn, flops_f), ("fwdbwd", fb, 3.5 * flops_f)):
      compiled, temp = _compile(f_, args)
      row[f"{tag}_temp_bytes"] = temp
      if temp is not None and temp > budget:
        row[f"{tag}_skipped"] = f"temp {temp / 2**30:.1f} GiB > budget {mem_budget_gib} GiB"
        continue
      secs = _time(compiled, args, repeats)
      row[f"{tag}_s"] = secs
      row[f"{tag}_gflops"] = flops / secs / 1e9
      del compiled
    rows.append(row)
  return rows


def _get(rows, method, t, key):
  for r in rows:
    if r["method"] == method and r["T"] == t:
      return r.get(key)
  return None


def targets(rows):
  """The issue's targets as measured ratios (None where a side was not measured)."""
  ratio = lambda a, b: (a / b) if (a is not None and b) else None
  fpa = _get(rows, "fpa_chunked", TARGET_T, "fwdbwd_s")
  mem = _get(rows, "fpa_chunked", MEMORY_T, "fwdbwd_temp_bytes")
  out = {
      f"fpa_chunked_fwdbwd_over_xla_dense_T{TARGET_T}": (
          ratio(fpa, _get(rows, "xla_dense_softmax", TARGET_T, "fwdbwd_s")), 1.0),
      f"fpa_chunked_fwdbwd_over_fox_chunked_T{TARGET_T}": (
          ratio(fpa, _get(rows, "fox_chunked", TARGET_T, "fwdbwd_s")), 1.25),
      f"fpa_chunked_fwdbwd_temp_over_dense_TxT_fp32_T{MEMORY_T}": (
          ratio(mem, MEMORY_T * MEMORY_T * 4), 1 / 16),
      f"fpa_chunked_fwd_over_xla_dense_T{TARGET_T}": (
          ratio(_get(rows, "fpa_chunked", TARGET_T, "fwd_s"),
                _get(rows, "xla_dense_softmax", TARGET_T, "fwd_s")), None),
  }
  return {k: {"measured": v, "target_max": tgt,
              "met": None if v is None or tgt is None else bool(v <= tgt)} for k, (v, tgt) in out.items()}


def _fmt(x, kind):
  if x is None:
    return "—"
  if kind == "s":
    return f"{x * 1e3:.0f}" if x >= 0.01 else f"{x * 1e3:.2f}"
  if kind == "b":
    return f"{x / 2**20:.1f}"
  return f"{x:.1f}"


def markdown(result):
  lines = [f"B={B}, H={H}, D={D}, fp32, block={result['block_size']}, {result['machine']}; "
           f"measured fp32 matmul: {result['matmul_gflops']:.1f} GFLOP/s.", "",
           "| method | T | fwd ms | fwd+bwd ms | fwd+bwd GFLOP/s | fwd temp MiB | fwd+bwd temp MiB |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    if "skipped" in r:
      continue
    fb = _fmt(r.get("fwdbwd_s"), "s") if "fwdbwd_skipped" not in r else "skipped (memory)"
    fw = _fmt(r.get("fwd_s"), "s") if "fwd_skipped" not in r else "skipped (memory)"
    lines.append(f"| {r['method']} | {r['T']} | {fw} | {fb} | {_fmt(r.get('fwdbwd_gflops'), 'g')} | "
                 f"{_fmt(r.get('fwd_temp_bytes'), 'b')} | {_fmt(r.get('fwdbwd_temp_bytes'), 'b')} |")
  lines += ["", "| target | measured | required | met |", "|---|---:|---:|---|"]
  for k, t in result["targets"].items():
    m = "—" if t["measured"] is None else f"{t['measured']:.3f}"
    req = "—" if t["target_max"] is None else f"≤ {t['target_max']:.3g}"
    lines.append(f"| {k} | {m} | {req} | {t['met'] if t['met'] is not None else '—'} |")
  return "\n".join(lines) + "\n"


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
  p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")],
                 default=[512, 1024, 2048, 4096, 8192, 16384])
  p.add_argument("--quick", action="store_true", help="T = 512, 1024 only")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--block-size", type=int, default=None)
  p.add_argument("--mem-budget-gib", type=float, default=6.0)
  p.add_argument("--methods", type=lambda s: s.split(","), default=None,
                 help="comma-separated subset of methods (default: all)")
  p.add_argument("--out-dir", default="results")
  a = p.parse_args(argv)
  seq_lens = [512, 1024] if a.quick else a.seq_lens
  from fpa_jax.ops.chunked import block_for
  result = {
      "machine": f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} {jax.default_backend()}",
      "block_size": block_for(max(seq_lens), a.block_size),
      "matmul_gflops": matmul_gflops(),
      "command": "python -m experiments.bench_attention " + " ".join(argv if argv is not None else sys.argv[1:]),
  }
  result["rows"] = run(seq_lens, a.repeats, a.block_size, a.mem_budget_gib, a.methods)
  result["targets"] = targets(result["rows"])
  out = Path(a.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench_attention.json").write_text(json.dumps(result, indent=1))
  (out / "bench_attention.md").write_text(markdown(result))
  plot(result, out / "bench_attention.png")
  print(markdown(result))
  print(f"wrote {out}/bench_attention.{{json,md,png}}")


if __name__ == "__main__":
  main()
