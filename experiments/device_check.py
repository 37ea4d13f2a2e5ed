"""The Pallas kernels on an accelerator in one run of under 8 minutes: lowered, compiled, checked, timed.

    python -m experiments.device_check           # a TPU VM or GPU host: results/device_check.{json,md}
    python -m experiments.device_check --quick   # any machine: tiny shapes (off-device: lowering only)

Phase "lower" (anywhere, CPU included): every kernel the run phase compiles, at its shapes, is
exported through `pallas.lower_for` for the accelerator's platform, or off-device for both "tpu"
and "cuda": FPA and FoX, the whole-length kernel (`kernels.py`) and on TPU the streamed one
(`tpu_flash.py`), the forward and the gradient (forward, dK / dV and dQ kernels). Each entry
records whether it lowered to exactly the expected kernel calls, or the error.

Phase "run" (JAX's backend "tpu" or "gpu"; elsewhere recorded as skipped, "no accelerator"):
  * check, at B=1, T=2048, H=8, KVH=2, D=128, bf16 q / k / v, two segments per row: each Pallas
    kernel's output and the gradients of sum(out * ct) (q, k, v, the gates) against `chunked` at
    the same tile; and FPA with zero gates (exactly causal softmax), the kernels and `chunked`,
    against `jax.nn.dot_product_attention(is_causal=True)` (segments as its mask). The reference is
    fp32 of the same rounded inputs at matmul precision "highest"; allowed is twice the reference's
    own bf16 error plus 16 eps_fp32 sqrt(T) of each array's scale (the rule of `tests/_tol.py`);
  * time forward and forward + backward (median of --repeats after a warm-up call, jitted,
    `block_until_ready`) at T = 4096 .. 32768, B=1, H=8, KVH=--kv-heads, D=128, bf16: the Pallas
    kernel (stream on TPU, whole on GPU), chunked FPA and FoX and `jax.nn.dot_product_attention`
    (XLA; on GPU also cuDNN), with each time's ratio to dot_product_attention's.

Budget: --budget-s (420 s from the start) is checked before each cell; a cell past it, or whose
estimate (its time at the previous length, the run part x 4) would pass it, is recorded as skipped
with the reason, so the whole run stays under 8 minutes. A cell that fails (a compile error, out of
memory) records its error and the run goes on. The results file is rewritten after every cell.
Exit status 1 where a kernel did not lower or a check failed.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments._common import ROOT, md_table, run_meta, study_parser, write_json, write_prefixed
from fpa_jax.ops import fox_attention, fpa_attention
from fpa_jax.ops.bias import FoXBias, FPABias
from fpa_jax.ops.common import BlockSizes
from fpa_jax.ops.pallas import lower_for, lowered_kernels, pallas_attention
from fpa_jax.ops.pallas.lowering import BACKEND_OF

MODULE = "experiments.device_check"
NAME = "device_check"
PHASES = ("lower", "run")
KINDS = ("fpa", "fox")
PLATFORM_OF = {"tpu": "tpu", "gpu": "cuda"}  # JAX's backend -> lower_for's platform
KERNELS = {"tpu": ("whole", "stream"), "cuda": ("whole",)}  # what each platform checks
TIMED_KERNEL = {"tpu": "stream", "cuda": "whole"}  # the whole-length kernel needs VMEM ~ T on TPU
FACTOR = 16.0  # tests/_tol.py's: a chain of a few reductions
SIZES = {  # check (B, T, H, KVH, D); timed lengths at B=1, H, D
  "device": dict(check=(1, 2048, 8, 2, 128), seq_lens=[4096, 8192, 16384, 32768], heads=8, d=128, repeats=5),
  "quick": dict(check=(1, 256, 4, 2, 64), seq_lens=[256], heads=4, d=64, repeats=2),
}
NO_ACCELERATOR = "no accelerator"


def platforms_for(backend: str) -> list[str]:
  """The platforms to lower for: the accelerator's, or both off-device."""
  return [PLATFORM_OF[backend]] if backend in PLATFORM_OF else ["tpu", "cuda"]


def tile(platform: str) -> int:
  """The kernels' (and the check's chunked) tile: the platform's default, given explicitly so that
  the same programs are lowered, compiled and (in a CPU test) interpreted."""
  return BlockSizes.default(BACKEND_OF[platform]).fwd


# ----------------------------------------------------------------------------- the functions


def pallas_fn(kind, kernel, block, backend="auto"):
  """fn(q, k, v, gates, seg) -> out of one Pallas kernel; backend "auto" compiles on the device."""

  def fn(q, k, v, gates, seg):
    if kind == "fpa":
      bias = FPABias(gates["field"], gates["level"])
    else:  # as fox_attention builds it (its clamp is a no-op on these non-positive gates)
      bias = FoXBias(jnp.cumsum(gates["log_fgate"].astype(jnp.float32), 1))
    kw = dict(scale=q.shape[-1] ** -0.5, segment_ids=seg, block_sizes=block, backend=backend, kernel=kernel)
    return pallas_attention(q, k, v, bias, **kw)

  return fn


def chunked_fn(kind, block=None):
  def fn(q, k, v, gates, seg):
    kw = dict(impl="chunked", segment_ids=seg, block_size=block)
    if kind == "fpa":
      return fpa_attention(q, k, v, gates["field"], gates["level"], **kw)
    return fox_attention(q, k, v, gates["log_fgate"], **kw)

  return fn


def dpa_fn(implementation=None):
  """jax.nn.dot_product_attention, causal; segment ids as its mask (gates unused)."""

  def fn(q, k, v, gates, seg):
    mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)

  return fn


def grad_fn(fn):
  """d sum(out) / d (q, k, v, gates): the forward + backward that is lowered and timed."""
  loss = lambda q, k, v, gates, seg: jnp.sum(fn(q, k, v, gates, seg).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3))


def specs(shape, kind, seg):
  """(q, k, v, gates, seg) as ShapeDtypeStructs: bf16 q / k / v, fp32 gates of the kind."""
  b, t, h, kvh, d = shape
  sd = jax.ShapeDtypeStruct
  names = ("field", "level") if kind == "fpa" else ("log_fgate",)
  gates = {n: sd((b, t, kvh), jnp.float32) for n in names}
  qkv = [sd((b, t, n, d), jnp.bfloat16) for n in (h, kvh, kvh)]
  return (*qkv, gates, sd((b, t), jnp.int32) if seg else None)


# ----------------------------------------------------------------------------- phase "lower"


def lower_shapes(size, kv_heads):
  """(label, (B, T, H, KVH, D), segment ids?, kernels of the platform or only the timed one)."""
  out = [("check", tuple(size["check"]), True, None)]
  return out + [(f"T={t}", (1, t, size["heads"], kv_heads, size["d"]), False, "timed") for t in size["seq_lens"]]


def expected_calls(kind, kernel, what):
  stem = f"{kind}_attention" if kernel == "whole" else f"{kind}_stream"
  return [f"{stem}_fwd"] if what == "fwd" else sorted(f"{stem}_{p}" for p in ("fwd", "dkv", "dq"))


def lower_one(platform, kind, kernel, what, shape, seg):
  """One export: lowered (to exactly the expected kernel calls) or the error."""
  fn = pallas_fn(kind, kernel, tile(platform), BACKEND_OF[platform])
  fn = fn if what == "fwd" else grad_fn(fn)
  t0 = time.perf_counter()
  try:
    calls = sorted(n for _, n in lowered_kernels(lower_for(fn, *specs(shape, kind, seg), platform=platform)))
  except Exception as e:  # recorded: the point is to see every kernel's outcome
    return {"lowered": False, "error": f"{type(e).__name__}: {e}"[:2000], "s": round(time.perf_counter() - t0, 2)}
  want = expected_calls(kind, kernel, what)
  row = {"lowered": calls == want, "calls": calls, "s": round(time.perf_counter() - t0, 2)}
  return row if calls == want else row | {"error": f"expected the kernel calls {want}"}


def lower_phase(platforms, size, kv_heads, save):
  entries = []
  for platform in platforms:
    for label, shape, seg, which in lower_shapes(size, kv_heads):
      kernels = (TIMED_KERNEL[platform],) if which == "timed" else KERNELS[platform]
      for kernel in kernels:
        for kind in KINDS:
          for what in ("fwd", "grad"):
            row = lower_one(platform, kind, kernel, what, shape, seg)
            entries.append({"platform": platform, "shape": label, "kind": kind, "kernel": kernel, "pass": what} | row)
            save({"platforms": platforms, "entries": entries})
  out = {"platforms": platforms, "entries": entries, "all_lowered": all(e["lowered"] for e in entries)}
  save(out)
  return out


# ----------------------------------------------------------------------------- phase "run": checks


def check_inputs(shape, seed=0):
  """bf16 q [B, T, H, D], k, v [B, T, KVH, D]; fp32 gates [B, T, KVH]: a slow walk (level) whose field
  dips by 50 every T/4 tokens, a FoX log forget gate with a hard reset there, and zeros (FPA is then
  causal softmax); segment ids [B, T] (a second segment from 3T/5); a cotangent [B, T, H, D]."""
  b, t, h, kvh, d = shape
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.normal(size=s).astype(np.float32)
  dips = (np.arange(t) % max(t // 4, 1) == max(t // 4, 1) - 1)[None, :, None]
  walk = np.cumsum(0.1 * normal(b, t, kvh), 1)
  gates = {
    "fpa": {"field": np.where(dips, walk - 50.0, walk), "level": walk},
    "fox": {"log_fgate": np.where(dips, -50.0, -np.abs(0.01 * normal(b, t, kvh)))},
    "zero": {"field": np.zeros((b, t, kvh), np.float32), "level": np.zeros((b, t, kvh), np.float32)},
  }
  gates = {k: {n: jnp.asarray(x) for n, x in g.items()} for k, g in gates.items()}
  seg = jnp.asarray((np.arange(t)[None] >= (3 * t) // 5).astype(np.int32).repeat(b, 0))
  qkv = [jnp.asarray(normal(b, t, n, d), jnp.bfloat16) for n in (h, kvh, kvh)]
  return qkv, gates, seg, jnp.asarray(normal(b, t, h, d))


def value_and_grads(fn, qkv, gates, seg, ct, precision=None):
  """(out, grads of sum(out * ct) for q, k, v, gates) as float64 numpy, and the compile + run time."""

  def run(q, k, v, g):
    out, pull = jax.vjp(lambda q, k, v, g: fn(q, k, v, g, seg), q, k, v, g)
    return out, pull(ct.astype(out.dtype))

  t0 = time.perf_counter()
  with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
    out, (dq, dk, dv, dg) = jax.block_until_ready(jax.jit(run)(*qkv, gates))
  arrays = {"out": out, "dq": dq, "dk": dk, "dv": dv, **{f"d{k}": x for k, x in dg.items()}}
  return {k: np.asarray(x.astype(jnp.float32), np.float64) for k, x in arrays.items()}, time.perf_counter() - t0


def _max_err(a, b, keys):
  return {k: float(np.max(np.abs(a[k] - b[k]), initial=0.0)) for k in keys}


def reference(fn, qkv, gates, seg, ct):
  """(fp32 result of the same rounded inputs at precision "highest", the bf16 run's own error)."""
  ref, _ = value_and_grads(fn, [x.astype(jnp.float32) for x in qkv], gates, seg, ct, "highest")
  own, _ = value_and_grads(fn, qkv, gates, seg, ct)
  return ref, _max_err(own, ref, ref)


def compare(got, ref, own_err, keys, t):
  """Per array: max error, scale, allowed (2 x the reference's own bf16 error + the fp32 rule)."""
  r32 = FACTOR * float(jnp.finfo(jnp.float32).eps) * math.sqrt(t)
  arrays = {}
  for name, e in _max_err(got, ref, keys).items():
    scale = float(np.max(np.abs(ref[name]), initial=0.0))
    allowed = r32 * scale + 2.0 * own_err[name]
    arrays[name] = {"max_err": e, "scale": scale, "allowed": allowed, "ref_bf16_err": own_err[name]}
    arrays[name]["ok"] = bool(e <= allowed)
  return {"arrays": arrays, "ok": all(a["ok"] for a in arrays.values())}


def check_cells(platform):
  """(name, against, kind of gates, the function) of every check, in the order run."""
  block = tile(platform)
  cells = []
  for kernel in KERNELS[platform]:
    cells += [(f"{kind}_{kernel}", "chunked", kind, pallas_fn(kind, kernel, block)) for kind in KINDS]
  for kernel in KERNELS[platform]:
    cells.append((f"fpa_{kernel}_zero_gate", "dot_product_attention", "zero", pallas_fn("fpa", kernel, block)))
  cells.append(("fpa_chunked_zero_gate", "dot_product_attention", "zero", chunked_fn("fpa", block)))
  return cells


def run_checks(platform, shape, checks, over_budget, save):
  qkv, gates, seg, ct = check_inputs(shape)
  refs = {}  # the references, computed once each on first use
  ref_fns = {"chunked": lambda kind: chunked_fn(kind, tile(platform)), "dot_product_attention": lambda _: dpa_fn()}
  for name, against, kind, fn in check_cells(platform):
    skip = over_budget()
    if skip:
      checks[name] = {"skipped": skip}
      save()
      continue
    g = gates[kind]
    try:
      got, s = value_and_grads(fn, qkv, g, seg, ct)
      if (against, kind) not in refs:
        refs[against, kind] = reference(ref_fns[against](kind), qkv, g, seg, ct)
      ref, own = refs[against, kind]
      keys = [k for k in ref if against == "chunked" or k in ("out", "dq", "dk", "dv")]
      checks[name] = {"against": against, "compile_and_run_s": round(s, 2)} | compare(got, ref, own, keys, shape[1])
    except Exception as e:  # recorded; the other checks still run
      checks[name] = {"against": against, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    print(f"check {name}: {'ok' if checks[name]['ok'] else 'FAILED'}", flush=True)
    save()


# ----------------------------------------------------------------------------- phase "run": timing


def timed_methods(platform):
  """{method: (kind of gates, fn)}: dot_product_attention first (the ratios' baseline)."""
  kernel, methods = TIMED_KERNEL[platform], {"dpa_xla": ("fpa", dpa_fn())}
  for kind in KINDS:
    methods[f"{kind}_pallas_{kernel}"] = (kind, pallas_fn(kind, kernel, tile(platform)))
  for kind in KINDS:
    methods[f"{kind}_chunked"] = (kind, chunked_fn(kind))  # chunked's default tile: what impl="chunked" runs
  if platform == "cuda":
    methods["dpa_cudnn"] = ("fpa", dpa_fn("cudnn"))
  return methods


def timed_inputs(t, heads, kv_heads, d, seed=0):
  """bf16 q / k / v, fp32 gates of both kinds (a shared FPA walk, FoX log forget gates), on the device."""
  kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (1, t, heads, d), jnp.bfloat16)
  k, v = (jax.random.normal(x, (1, t, kv_heads, d), jnp.bfloat16) for x in (kk, kv))
  g = jax.random.normal(kg, (1, t, kv_heads), jnp.float32)
  walk = jnp.cumsum(0.1 * g, 1)
  return (q, k, v), {"fpa": {"field": walk, "level": walk}, "fox": {"log_fgate": jax.nn.log_sigmoid(g + 3.0)}}


def _device_memory():
  try:
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  except Exception:  # not every backend reports it
    return None


def time_cell(fn, args, repeats):
  """Compile, check the memory XLA plans against the device's, one warm-up call, then the median of
  `repeats` timed calls."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  row = {"compile_s": round(time.perf_counter() - t0, 2)}
  try:
    ma = compiled.memory_analysis()
    need = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
    row["memory_gib"] = round(need / 2**30, 2)
  except Exception:  # not every backend reports it
    need = None
  limit = _device_memory()
  if need is not None and limit and need > limit:
    return row | {"skipped": f"needs {need / 2**30:.1f} GiB of the device's {limit / 2**30:.1f} GiB"}
  jax.block_until_ready(compiled(*args))
  runs = []
  for _ in range(repeats):
    t1 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    runs.append(time.perf_counter() - t1)
  return row | {"median_ms": 1e3 * statistics.median(runs), "runs_ms": [round(1e3 * r, 3) for r in runs]}


def run_timing(platform, size, kv_heads, repeats, rows, over_budget, save):
  methods = timed_methods(platform)
  last = {}  # (method, pass) -> (T, row): the estimate for the next length
  for t in size["seq_lens"]:
    qkv, gates = timed_inputs(t, size["heads"], kv_heads, size["d"])
    for method, (kind, fn) in methods.items():
      for what, f in (("fwd", fn), ("fwd+bwd", grad_fn(fn))):
        row = {"T": t, "method": method, "pass": what}
        prev = last.get((method, what))
        est = None
        if prev and "median_ms" in prev[1]:  # compile, then warm-up + repeats at (T / T_prev)^2 the time
          est = prev[1]["compile_s"] + (repeats + 1) * 1e-3 * prev[1]["median_ms"] * (t / prev[0]) ** 2
        skip = over_budget(est)
        if skip:
          rows.append(row | {"skipped": skip})
          save()
          continue
        try:
          row |= time_cell(f, (*qkv, gates[kind], None), repeats)
        except Exception as e:  # out of memory, a compile error: recorded, the others still run
          row["error"] = f"{type(e).__name__}: {e}"[:2000]
        last[method, what] = (t, row)
        rows.append(row)
        add_ratios(rows)
        print(f"T={t} {method} {what}: {_fmt(row.get('median_ms'))} ms {_note(row)}", flush=True)
        save()


def add_ratios(rows):
  """Each timed row's ratio to dot_product_attention (XLA) at the same T and pass."""
  base = {(r["T"], r["pass"]): r.get("median_ms") for r in rows if r["method"] == "dpa_xla"}
  for r in rows:
    b = base.get((r["T"], r["pass"]))
    r["vs_dpa"] = None if b is None or r.get("median_ms") is None else r["median_ms"] / b


def run_phase(platform, size, kv_heads, repeats, over_budget, save):
  """The checks and the timing on JAX's device, `platform`'s kernels (`KERNELS`, `TIMED_KERNEL`)."""
  out = {"checks": {}, "timing": []}
  run_checks(platform, size["check"], out["checks"], over_budget, lambda: save(out))
  run_timing(platform, size, kv_heads, repeats, out["timing"], over_budget, lambda: save(out))
  out["all_checks_ok"] = all(c.get("ok", True) for c in out["checks"].values())  # skipped: not failed
  save(out)
  return out


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
  p = study_parser(MODULE, __doc__)
  p.add_argument("--phase", nargs="+", choices=PHASES, default=list(PHASES), help="what to run (default both)")
  p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (off-device, lowering only)")
  p.add_argument("--out-dir", default=str(ROOT / "results"), help="where device_check.{json,md} go")
  p.add_argument("--budget-s", type=float, default=420.0, help="no cell starts after this (from the start)")
  p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="timed lengths (default 4096 .. 32768)")
  p.add_argument("--kv-heads", type=int, default=None, help="timed kv heads (default H: no grouping)")
  p.add_argument("--repeats", type=int, default=None, help="timed calls per cell after the warm-up")
  a = p.parse_args(argv)
  size = dict(SIZES["quick" if a.quick else "device"])
  size["seq_lens"] = a.seq_lens or size["seq_lens"]
  kv_heads, repeats = a.kv_heads or size["heads"], a.repeats or size["repeats"]
  if size["heads"] % kv_heads or a.budget_s <= 0 or repeats < 1:
    raise SystemExit(f"--kv-heads must divide {size['heads']}, --budget-s be > 0 and --repeats >= 1")
  t0 = time.perf_counter()
  backend = jax.default_backend()
  res = {
    "settings": {
      "backend": backend,
      "device_kind": jax.devices()[0].device_kind,
      "phases": a.phase,
      "check_shape_B_T_H_KVH_D": list(size["check"]),
      "timed_B_H_KVH_D": [1, size["heads"], kv_heads, size["d"]],
      "dtype": "bfloat16",
      "seq_lens": size["seq_lens"],
      "repeats": repeats,
      "budget_s": a.budget_s,
    }
  }
  out = Path(a.out_dir) / NAME

  def save(key=None, value=None, final=False):  # after every cell: a killed run leaves what it did
    if key is not None:
      res[key] = value
    res["meta"] = run_meta(MODULE, argv, wall_s=time.perf_counter() - t0)
    if final:
      write_prefixed(out, res, markdown(res))
    else:
      write_json(f"{out}.json", res)
      Path(f"{out}.md").write_text(markdown(res))

  def over_budget(estimate=None):
    spent = time.perf_counter() - t0
    if spent >= a.budget_s:
      return f"not reached: {spent:.0f} s of the {a.budget_s:.0f} s budget spent"
    if estimate is not None and spent + estimate > a.budget_s:
      return f"estimated {estimate:.0f} s after {spent:.0f} s: past the {a.budget_s:.0f} s budget"
    return None

  if "lower" in a.phase:
    lower_phase(platforms_for(backend), size, kv_heads, lambda v: save("lower", v))
  if "run" in a.phase:
    if backend not in PLATFORM_OF:
      save("run", {"skipped": f"{NO_ACCELERATOR}: JAX's backend is {backend}, not tpu or gpu"})
    else:
      run_phase(PLATFORM_OF[backend], size, kv_heads, repeats, over_budget, lambda v: save("run", v))
  lowered = res.get("lower", {}).get("all_lowered", True)
  res["ok"] = bool(lowered and res.get("run", {}).get("all_checks_ok", True))
  save(final=True)
  return res


# ----------------------------------------------------------------------------- the table


def _fmt(x, digits=3):
  return "—" if x is None else f"{x:.{digits}g}"


def _note(row):
  return (row.get("skipped") or row.get("error") or "").split("\n")[0][:160]


def markdown(res: dict) -> str:
  s, meta = res["settings"], res.get("meta", {})
  machine = meta.get("machine", {})
  lines = [
    f"# Device check: {s['backend']} ({s['device_kind']})",
    "",
    f"`{meta.get('command', '')}`, commit {meta.get('commit', '?')}, host {machine.get('host', '?')}, "
    f"jax {machine.get('jax', '?')}, {meta.get('wall_s', '?')} s.",
    "",
  ]
  low = res.get("lower")
  if low:
    rows = {}
    for e in low["entries"]:
      key = (e["platform"], e["shape"], f"{e['kind']}_{e['kernel']}")
      r = rows.setdefault(key, [*key, "—", "—", ""])
      r[3 if e["pass"] == "fwd" else 4] = "yes" if e["lowered"] else "NO"
      r[5] = r[5] or _note(e)
    lines += [
      "Lowered through `pallas.lower_for` (the forward; the gradient: forward, dK / dV and dQ kernels):",
      "",
      md_table(["platform", "shape", "kernel", "fwd", "grad", "error"], rows.values(), align="llllll"),
    ]
  run = res.get("run")
  if run and "skipped" in run:
    lines += [f"Run phase skipped: {run['skipped']}.", ""]
  elif run:
    b, t, h, kvh, d = s["check_shape_B_T_H_KVH_D"]
    crows = []
    for name, c in run["checks"].items():
      if "arrays" not in c:
        crows.append([name, c.get("against", ""), "skipped" if "skipped" in c else "FAILED", "—", "—", _note(c)])
        continue
      worst = max(c["arrays"].items(), key=lambda kv: kv[1]["max_err"] / max(kv[1]["allowed"], 1e-300))
      share = worst[1]["max_err"] / max(worst[1]["allowed"], 1e-300)
      ok = "ok" if c["ok"] else "FAILED"
      crows.append([name, c["against"], ok, f"{share:.2g} ({worst[0]})", _fmt(c["compile_and_run_s"]), ""])
    lines += [
      f"Checked at B={b}, T={t}, H={h}, KVH={kvh}, D={d}, bf16, two segments per row: output and gradients "
      "against the fp32 reference; allowed twice the reference's own bf16 error + 16 eps sqrt(T) scale.",
      "",
      md_table(["check", "against", "result", "worst error / allowed", "compile + run s", "note"], crows, "lllrrl"),
    ]
    trows = [
      [r["T"], r["method"], r["pass"], _fmt(r.get("median_ms")), _fmt(r.get("vs_dpa")), _fmt(r.get("compile_s"))]
      + [_fmt(r.get("memory_gib")), _note(r)]
      for r in run["timing"]
    ]
    _, th, tkvh, td = s["timed_B_H_KVH_D"]
    lines += [
      f"Timed at B=1, H={th}, KVH={tkvh}, D={td}, bf16: median of {s['repeats']} after a warm-up; "
      "x dpa = the time over `jax.nn.dot_product_attention`'s (XLA) at the same T and pass.",
      "",
      md_table(["T", "method", "pass", "ms", "x dpa", "compile s", "GiB", "note"], trows, "rllrrrrl"),
    ]
  done = "running" if "ok" not in res else "yes" if res["ok"] else "NO"
  lines.append(f"All lowered and checked: {done}.")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  raise SystemExit(0 if main()["ok"] else 1)
