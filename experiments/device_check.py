"""The Pallas kernels on an accelerator: compiled, checked against the chunked kernel, and timed.

    python -m experiments.device_check            # on a GPU or TPU, under 8 minutes: results/device_check.{json,md}
    python -m experiments.device_check --smoke    # any machine: tiny sizes (the Pallas interpreter on CPU)

Until it has run on a GPU or TPU, the Pallas kernels are known only from the interpreter
(`tests/ops/pallas/`). On CPU without --smoke it refuses: the interpreter is what the tests run.

Check. For FPA and FoX, the dense Pallas kernels and the block-sparse ones (`skip_tolerance`;
Mosaic TPU and the interpreter only: on Triton they raise, recorded as not supported) against
`chunked` at the same tile size and tolerance, so that the same tiles are dropped: the output and
the gradients of sum(out * ct) for q, k, v and the gates, with grouped-query heads (H = 2 KVH) and
two segments per row. Tolerances follow from the dtype (the rule of `tests/_tol.py`):
  * fp32, both kernels at matmul precision "highest": |pallas - chunked| <= 16 eps sqrt(T) scale,
    scale the largest |chunked| of the compared array;
  * bf16 (q, k, v; gates fp32): against the fp32 result of the same rounded inputs, Pallas' error
    may be at most twice chunked's own bf16 error plus the fp32 tolerance.

Time. Forward and forward + backward of Pallas FPA / FoX, chunked FPA / FoX, XLA's dense
softmax and (GPU, where it compiles) cuDNN's fused attention in bf16 (`jax.nn.
dot_product_attention`), at T = 4096 .. 32768, B=1, H=4, D=64, fp32 inputs at the backend's default
matmul precision: `experiments.bench_attention.run` (the methods side by side, best of --repeats,
XLA's temp memory, variants over --mem-budget-gib compiled but not run). A length whose estimated
time (the last one's x 4.5) would pass --time-budget-s is left out and says so.

Resume: each check and each length is written to the results file when it is done; a rerun with
the same settings on the same backend keeps them (--fresh redoes everything).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments._common import ROOT, md_table, read_json, run_meta, study_parser, write_json, write_prefixed
from fpa_jax.ops import bias as _bias
from fpa_jax.ops import fox_attention, fpa_attention
from fpa_jax.ops.chunked import skipped_tile_fraction
from fpa_jax.ops.common import BlockSizes
from fpa_jax.ops.validate import PALLAS_SKIP_GPU

MODULE = "experiments.device_check"
KINDS = ("fpa", "fox")
VARIANTS = {"dense": None, "block_sparse": 1e-3}  # skip_tolerance
FACTOR = 16.0  # tests/_tol.py's: a chain of a few reductions
SIZES = {  # the check's shapes (B, T, H, KVH, D) and the timed lengths
  "device": dict(check=(2, 1024, 4, 2, 64), seq_lens=[4096, 8192, 16384, 32768], repeats=3),
  "smoke": dict(check=(1, 48, 2, 1, 8), seq_lens=[64], repeats=1),
}


def refuse_cpu(backend: str, smoke: bool) -> None:
  """SystemExit with what to do instead where there is no accelerator and no --smoke."""
  if backend not in ("gpu", "tpu") and not smoke:
    raise SystemExit(
      f"device_check: JAX's backend is {backend}, not a GPU or TPU, so the Pallas kernels would only run "
      "in the interpreter, which tests/ops/pallas already covers. Run it on an accelerator machine with "
      "an accelerator jax (pip install -e '.[cuda]' or '.[tpu]'), or pass --smoke for the tiny run."
    )


def inputs(shape, dtype, seed=0):
  """q [B, T, H, D], k, v [B, T, KVH, D] in dtype; fp32 gates [B, T, KVH]: a slow walk (level) whose
  field dips by 50 every T/4 tokens (so the skip bound drops tiles), a FoX log forget gate with a
  hard reset at the same places; segment ids [B, T] (a second segment from 3T/5); a cotangent."""
  b, t, h, kvh, d = shape
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.normal(size=s).astype(np.float32)
  dips = (np.arange(t) % max(t // 4, 1) == max(t // 4, 1) - 1)[None, :, None]
  walk = np.cumsum(0.1 * normal(b, t, kvh), 1)
  gates = {
    "field": np.where(dips, walk - 50.0, walk),
    "level": walk,
    "log_fgate": np.where(dips, -50.0, -np.abs(0.01 * normal(b, t, kvh))),
  }
  seg = (np.arange(t)[None] >= (3 * t) // 5).astype(np.int32).repeat(b, 0)
  qkv = [jnp.asarray(normal(b, t, n, d), dtype) for n in (h, kvh, kvh)]
  return qkv, {k: jnp.asarray(x) for k, x in gates.items()}, jnp.asarray(seg), jnp.asarray(normal(b, t, h, d))


def _attention(kind, impl, block, tol, seg):
  """fn(q, k, v, gates) -> out [B, T, H, D] of one kernel."""
  kw = dict(impl=impl, block_size=block, skip_tolerance=tol, segment_ids=seg)
  if kind == "fpa":
    return lambda q, k, v, g: fpa_attention(q, k, v, g["field"], g["level"], **kw)
  return lambda q, k, v, g: fox_attention(q, k, v, g["log_fgate"], **kw)


def _value_and_grads(fn, qkv, gates, ct):
  """(out, grads of sum(out * ct) for q, k, v, gates) as float64 numpy, compiled at precision highest."""

  def run(q, k, v, g):
    out, pull = jax.vjp(fn, q, k, v, g)
    return out, pull(ct.astype(out.dtype))

  with jax.default_matmul_precision("highest"):  # Mosaic / Triton read it when the kernel is traced
    compiled = jax.jit(run).lower(*qkv, gates).compile()
  out, (dq, dk, dv, dg) = jax.block_until_ready(compiled(*qkv, gates))
  arrays = {"out": out, "dq": dq, "dk": dk, "dv": dv, **{f"d{k}": x for k, x in dg.items()}}
  return {k: np.asarray(x, np.float64) for k, x in arrays.items()}


def _max_err(a, b):
  return {k: float(np.max(np.abs(a[k] - b[k]), initial=0.0)) for k in b}


def check(kind, variant, dtype, shape, block, seed=0):
  """One kernel against chunked: per compared array its max error, scale and allowed error; `ok`.
  A Pallas configuration the backend does not run is recorded as `not_supported` (its message)."""
  qkv, gates, seg, ct = inputs(shape, jnp.dtype(dtype), seed)
  tol = VARIANTS[variant]
  gates = {k: gates[k] for k in (("field", "level") if kind == "fpa" else ("log_fgate",))}
  t0 = time.perf_counter()
  try:
    pallas = _value_and_grads(_attention(kind, "pallas", block, tol, seg), qkv, gates, ct)
  except ValueError as e:
    if str(e) != PALLAS_SKIP_GPU:
      raise
    return {"not_supported": str(e)}  # the block-sparse kernels on Triton
  row = {"compile_and_run_s": time.perf_counter() - t0}
  if tol is not None:  # the share of off-diagonal tiles dropped per (row, kv head): > 0, or nothing is tested
    b = _bias.FPABias(**gates) if kind == "fpa" else _bias.FoXBias(jnp.cumsum(gates["log_fgate"], 1))
    row["tiles_dropped"] = skipped_tile_fraction(*qkv[:2], b, skip_tolerance=tol, block_size=block)[0]
  chunked = lambda qkv: _value_and_grads(_attention(kind, "chunked", block, tol, seg), qkv, gates, ct)
  r32 = FACTOR * float(jnp.finfo(jnp.float32).eps) * math.sqrt(shape[1])
  if jnp.dtype(dtype) == jnp.float32:
    ref, err = chunked(qkv), None
  else:  # the fp32 result of the same (rounded) inputs, and chunked's own error in dtype
    ref = chunked([x.astype(jnp.float32) for x in qkv])
    err = _max_err(chunked(qkv), ref)
  perr = _max_err(pallas, ref)
  arrays = {}
  for name, e in perr.items():
    scale = float(np.max(np.abs(ref[name]), initial=0.0))
    allowed = r32 * scale + (0.0 if err is None else 2.0 * err[name])
    arrays[name] = {"max_err": e, "scale": scale, "allowed": allowed, "ok": bool(e <= allowed)}
    if err is not None:
      arrays[name]["chunked_err"] = err[name]
  return row | {"arrays": arrays, "ok": all(a["ok"] for a in arrays.values())}


def timing(seq_lens, repeats, mem_budget_gib, methods, done, save, budget_s, t_start):
  """`bench_attention.run` one length at a time into done[str(T)] (saved after each); a length whose
  estimate (the previous one's time x 4.5: quadratic work plus compiles) would pass budget_s from
  t_start is recorded as left out."""
  from experiments.bench_attention import run

  last = None
  for t in seq_lens:
    if "rows" in done.get(str(t), {}):
      continue
    spent = time.perf_counter() - t_start
    if last is not None and spent + 4.5 * last > budget_s:
      done[str(t)] = {"left_out": f"estimated {4.5 * last:.0f} s after {spent:.0f} s: over {budget_s:.0f} s"}
    else:
      t0 = time.perf_counter()
      done[str(t)] = {"rows": run([t], repeats, None, mem_budget_gib, methods)}
      last = done[str(t)]["wall_s"] = time.perf_counter() - t0
    save()


def timed_methods(backend: str) -> list[str]:
  """bench_attention's method names: the Pallas and chunked kernels, XLA's dense softmax and, on a
  GPU where it compiles, cuDNN's (`bench_attention.backend_methods` probes it)."""
  methods = ["fpa_pallas", "fox_pallas", "fpa_chunked", "fox_chunked", "xla_dense_softmax"]
  if backend == "gpu":
    from experiments.bench_attention import backend_methods

    methods += [m for m in backend_methods("gpu") if m == "cudnn_softmax_bf16"]
  return methods


def main(argv=None) -> dict:
  p = study_parser(MODULE, __doc__)
  p.add_argument("--smoke", action="store_true", help="tiny sizes; on CPU the Pallas interpreter")
  p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="timed lengths (default 4096 .. 32768)")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--mem-budget-gib", type=float, default=24.0, help="compile but do not run variants over this")
  p.add_argument("--time-budget-s", type=float, default=420.0, help="leave out lengths estimated to end after this")
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
  p.add_argument("--out", default=str(ROOT / "results" / "device_check"), help="path prefix of .json / .md")
  p.add_argument("--fresh", action="store_true", help="ignore an existing results file (no resume)")
  a = p.parse_args(argv)
  backend = jax.default_backend()
  refuse_cpu(backend, a.smoke)
  size = SIZES["smoke" if a.smoke else "device"]
  block = BlockSizes.default(backend).fwd if backend in ("gpu", "tpu") else 16
  dtypes = ["float32"] if a.smoke and backend == "cpu" else a.dtypes  # XLA:CPU has no bf16 x bf16 -> fp32 dot
  settings = {
    "backend": backend,
    "device_kind": jax.devices()[0].device_kind,
    "check_shape_B_T_H_KVH_D": list(size["check"]),
    "block": block,
    "dtypes": dtypes,
    "seq_lens": a.seq_lens or size["seq_lens"],
    "repeats": a.repeats or size["repeats"],
    "mem_budget_gib": a.mem_budget_gib,
  }
  old = None if a.fresh else read_json(f"{a.out}.json")
  res = old if old and old.get("settings") == settings else {"settings": settings, "checks": {}, "timing": {}}
  t0 = time.perf_counter()
  prev_wall = res.get("meta", {}).get("wall_s", 0.0)

  def save(final=False):  # after every cell, so that a killed run resumes; printed at the end
    res["meta"] = run_meta(MODULE, argv, wall_s=prev_wall + time.perf_counter() - t0)
    (write_prefixed if final else _write_quietly)(a.out, res, markdown(res))

  for kind in KINDS:
    for variant in VARIANTS:
      for dt in dtypes:
        name = f"{kind}_{variant}_{dt}"
        if name not in res["checks"]:
          res["checks"][name] = check(kind, variant, dt, size["check"], block)
          save()
  methods = timed_methods(backend)
  timing(settings["seq_lens"], settings["repeats"], a.mem_budget_gib, methods, res["timing"], save, a.time_budget_s, t0)
  res["all_checks_ok"] = all(c.get("ok", True) for c in res["checks"].values())
  save(final=True)
  return res


def _write_quietly(prefix, res, md):
  write_json(f"{prefix}.json", res)
  Path(f"{prefix}.md").write_text(md)


def _fmt(x, digits=3):
  return "—" if x is None else f"{x:.{digits}g}"


def markdown(res: dict) -> str:
  s, meta = res["settings"], res.get("meta", {})
  b, t, h, kvh, d = s["check_shape_B_T_H_KVH_D"]
  where = f"{s['backend']} ({s['device_kind']})" + (
    ", in the interpreter" if s["backend"] not in ("gpu", "tpu") else ""
  )
  lines = [
    f"Pallas kernels on {where}, tiles of {s['block']} (`{meta.get('command', '')}`, "
    f"commit {meta.get('commit', '?')}).",
    "",
    f"Against chunked at the same tiles: B={b}, T={t}, H={h}, KVH={kvh}, D={d}, two segments per row; the "
    "largest error over the output and the gradients (q, k, v, gates), as a share of what is allowed.",
    "",
  ]
  rows = []
  for name, c in res["checks"].items():
    if "not_supported" in c:
      rows.append([name, "not supported here", "—", "—", "—", c["not_supported"][:80] + " …"])
      continue
    worst = max(c["arrays"].items(), key=lambda kv: kv[1]["max_err"] / max(kv[1]["allowed"], 1e-300))
    share = worst[1]["max_err"] / max(worst[1]["allowed"], 1e-300)
    dropped = _fmt(c.get("tiles_dropped"), 2)
    rows.append(
      [name, "ok" if c["ok"] else "FAILED", f"{share:.2g} ({worst[0]})", dropped, _fmt(c["compile_and_run_s"]), ""]
    )
  head = ["check", "result", "worst error / allowed", "tiles dropped", "compile + run s", "note"]
  lines += [md_table(head, rows, align="llrrrl"), ""]
  trows = []
  for t_, cell in res["timing"].items():
    if "left_out" in cell:
      trows.append([t_, "(all)", cell["left_out"], "", "", ""])
      continue
    for r in cell["rows"]:
      skip = r.get("skipped") or r.get("fwd_skipped") or r.get("fwdbwd_skipped") or ""
      mib = None if r.get("fwdbwd_temp_bytes") is None else r["fwdbwd_temp_bytes"] / 2**20
      ms = lambda k: None if r.get(k) is None else 1e3 * r[k]
      trows.append([t_, r["method"], _fmt(ms("fwd_s")), _fmt(ms("fwdbwd_s")), _fmt(mib), skip])
  if trows:
    lines += [
      f"B=1, H=4, D=64, fp32 inputs (cuDNN: bf16), the backend's default matmul precision; best of {s['repeats']}.",
      "",
      md_table(["T", "method", "fwd ms", "fwd+bwd ms", "fwd+bwd temp MiB", "note"], trows, align="rlrrrl"),
      "",
    ]
  return "\n".join(lines)


if __name__ == "__main__":
  res = main()
  raise SystemExit(0 if res["all_checks_ok"] else 1)
