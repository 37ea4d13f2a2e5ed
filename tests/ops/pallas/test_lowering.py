"""The Pallas kernels lowered for TPU (Mosaic) and GPU (Triton) on CPU, through `jax.export`.

`pallas.lower_for` exports a function for a platform without its hardware; the kernels are built
for it with `pallas_backend` ("tpu" / "gpu"). Every kernel is lowered: dense and block-sparse
(skip_tolerance), forward and both backward kernels (the value and gradient of a scalar loss
w.r.t. q, k, v and the gates), FPA and FoX, plain heads and grouped-query heads with segment ids
in bf16, and the dense kernel under a (data, model) mesh. A case passes when the export is for the
asked platform and holds exactly the forward, dK / dV and dQ kernel calls, on the operand shapes
and dtypes the layout promises (k / v with kv_heads, never repeated). Lowering checks what Mosaic
and Triton accept, not numerics or the backend compiler's limits (docs/ops.md, "Lowering without
the hardware"); the target-form kernels' values are checked here in the interpreter.
Each export takes about a second on CPU: no kernel is compiled or run for it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_close
from fpa_jax import ops
from fpa_jax import sharding as S
from fpa_jax.ops import pallas
from fpa_jax.ops.bias import FPABias
from fpa_jax.ops.pallas import common as pc
from fpa_jax.ops.pallas.lowering import BACKEND_OF, CALL_TARGETS

B, T, D = 1, 256, 64  # two TPU tiles (128), four Triton tiles (64)
TOL = 0.01  # the block-sparse kernels (any tolerance: the tile lists are data, not program)
# (heads, kv_heads, segment ids, dtype)
LAYOUTS = {"mha": (2, 2, False, jnp.float32), "gqa_seg_bf16": (4, 2, True, jnp.bfloat16)}
# Mosaic's and Triton's MLIR element type names
_ELT = {jnp.float32: "f32", jnp.bfloat16: "bf16"}

# Pallas' Triton lowering of a PrefetchScalarGridSpec raises "NotImplementedError: scalar prefetch
# not implemented in the Triton backend"; impl="pallas" refuses the combination before tracing.
TRITON_NO_SPARSE = pytest.mark.xfail(
  strict=True,
  raises=ValueError,
  reason=f"Triton has no scalar prefetch, so no block-sparse kernels: ValueError({ops.validate.PALLAS_SKIP_GPU!r})",
)


def _specs(layout):
  h, kvh, seg, dt = LAYOUTS[layout]
  sd = jax.ShapeDtypeStruct
  qkv = [sd((B, T, h, D), dt), sd((B, T, kvh, D), dt), sd((B, T, kvh, D), dt)]
  return qkv + [sd((B, T, kvh), jnp.float32)] * 2 + [sd((B, T), jnp.int32) if seg else None]


def _value_and_grads(kind, kernel, backend):
  """(out, d loss / d (q, k, v, gate, level)) of loss = sum(out^2), through the public ops with
  impl="pallas"; gate is FoX's log_fgate (level then unused) or FPA's field."""
  tol = TOL if kernel == "block_sparse" else None

  def loss(q, k, v, gate, level, seg):
    kw = dict(impl="pallas", segment_ids=seg, skip_tolerance=tol, pallas_backend=backend)
    if kind == "fox":
      out = ops.fox_attention(q, k, v, gate, **kw)
    else:
      out = ops.fpa_attention(q, k, v, gate, level, **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2), out

  def fn(q, k, v, gate, level, seg):
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gate, level, seg)
    return out, grads

  return fn


def _kernel_lines(exported):
  """{kernel name: its custom call's line of StableHLO text}."""
  names = {n for _, n in pallas.lowered_kernels(exported)}
  lines = exported.mlir_module().splitlines()
  return {n: next(ln for ln in lines if re.search(rf'name = "{n}"', ln)) for n in names}


def _operands(line):
  """The operand tensor types of a custom call's line, e.g. ["tensor<1x2x256x64xf32>", ...]."""
  signature = line[line.rindex("} : (") :]
  return re.findall(r"tensor<[^>]*>", signature[: signature.index(") -> ")])


CASES = [
  pytest.param(
    (p, kern, kind, lay),
    id=f"{p}-{kern}-{kind}-{lay}",
    marks=[TRITON_NO_SPARSE] if (p, kern) == ("cuda", "block_sparse") else [],
  )
  for p in pallas.PLATFORMS
  for kern in ("dense", "block_sparse")
  for kind in ("fpa", "fox")
  for lay in LAYOUTS
]


@pytest.fixture(scope="module", params=CASES)
def lowered(request):
  platform, kernel, kind, layout = request.param
  exported = pallas.lower_for(_value_and_grads(kind, kernel, BACKEND_OF[platform]), *_specs(layout), platform=platform)
  return request.param, exported


def test_every_kernel_lowers_for_the_platform(lowered):
  (platform, kernel, kind, _), exported = lowered
  assert exported.platforms == (platform,)
  stem = f"{kind}_{'attention' if kernel == 'dense' else 'block_sparse'}"
  calls = pallas.lowered_kernels(exported)
  assert sorted(n for _, n in calls) == sorted(f"{stem}_{p}" for p in ("fwd", "dkv", "dq")), calls
  assert all(t in CALL_TARGETS[platform] for t, _ in calls), calls


def test_kernels_read_the_layout(lowered):
  """The forward kernel takes q [B, H, Tp, K] and k [B, KVH, Tp, K] in the input dtype (kv heads are
  read, not repeated); the block-sparse kernels take their two prefetched tile lists first."""
  (_, kernel, kind, layout), exported = lowered
  h, kvh, _, dt = LAYOUTS[layout]
  fwd = f"{kind}_{'attention' if kernel == 'dense' else 'block_sparse'}_fwd"
  ops_ = _operands(_kernel_lines(exported)[fwd])
  lists, (q, k) = (ops_[:2], ops_[2:4]) if kernel == "block_sparse" else ([], ops_[:2])
  assert q == f"tensor<{B}x{h}x{T}x{D}x{_ELT[dt]}>" and k == f"tensor<{B}x{kvh}x{T}x{D}x{_ELT[dt]}>", ops_
  assert all(x.endswith("xi32>") for x in lists), ops_


def test_dense_kernels_lower_per_shard_under_a_mesh():
  """Under a data=2, model=2 mesh (`sharding.shard_local`, as the layer runs impl="pallas"), the
  kernels lower inside the shard_map's manual computations (forward, backward), split over batch and
  heads, on per-device shapes."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (tests/conftest.py simulates 8 on CPU)")
  q, k, v, f, lv, _ = _specs("gqa_seg_bf16")
  ax, gate = ("act_batch", "act_seq", "act_heads", "act_head_dim"), ("act_batch", "act_seq", "act_heads")
  q, k, v = (jax.ShapeDtypeStruct((2,) + x.shape[1:], x.dtype) for x in (q, k, v))
  f = lv = jax.ShapeDtypeStruct((2,) + f.shape[1:], f.dtype)
  inner = lambda *a: ops.fpa_attention(*a, impl="pallas", pallas_backend="tpu")
  loss = lambda *a: jnp.sum(S.shard_local(inner, a, (ax, ax, ax, gate, gate), ax).astype(jnp.float32) ** 2)
  with jax.set_mesh(S.make_mesh("data=2,model=2", jax.devices()[:4])):
    exported = pallas.lower_for(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, k, v, f, lv, platform="tpu")
  text = exported.mlir_module()
  assert exported.nr_devices == 4 and text.count("sdy.manual_computation(") == 2, exported.nr_devices  # fwd, bwd
  assert '[{"data"}, {}, {"model"}, {}]' in text  # q, k, v: batch over data, heads over model
  want = sorted(f"fpa_attention_{p}" for p in ("fwd", "dkv", "dq"))
  assert sorted(n for _, n in pallas.lowered_kernels(exported)) == want
  fwd = _operands(_kernel_lines(exported)["fpa_attention_fwd"])
  assert fwd[:2] == [f"tensor<1x2x{T}x{D}xbf16>", f"tensor<1x1x{T}x{D}xbf16>"], fwd  # one row, half the heads


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_target_kernels_run_in_the_interpreter_and_match_chunked(backend):
  """backend="tpu" / "gpu" with interpret=True: the kernels built for the target (its tiles, 128 /
  64, and compiler params), computed by the interpreter, equal chunked at that tile."""
  rng = np.random.default_rng(0)
  h, kvh = 4, 2
  q = jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, T, kvh, D)), jnp.float32) for _ in range(2))
  field, level = (jnp.asarray(rng.normal(size=(B, T, kvh)) * 4, jnp.float32) for _ in range(2))
  seg = jnp.asarray(np.sort(rng.integers(0, 2, (B, T)), 1), jnp.int32)
  blk = pallas.BlockSizes.default(backend).fwd
  got = jax.jit(
    lambda *a: pallas.pallas_attention(
      *a[:3], FPABias(*a[3:5]), scale=D**-0.5, segment_ids=a[5], backend=backend, interpret=True
    )
  )(q, k, v, field, level, seg)
  want = ops.fpa_attention(q, k, v, field, level, impl="chunked", segment_ids=seg, block_size=blk)
  assert_close(got, want, n=T)


@pytest.mark.parametrize(
  "interpret, backend, mode",
  [
    (None, "auto", (True, "interpret")),  # today's default on CPU: unchanged
    (True, "auto", (True, "interpret")),
    (None, "interpret", (True, "interpret")),
    (None, "tpu", (False, "tpu")),
    (False, "gpu", (False, "gpu")),
    (True, "tpu", (True, "tpu")),
  ],
)
def test_run_mode_on_cpu(interpret, backend, mode):
  if jax.default_backend() != "cpu":
    pytest.skip("the table is CPU's")
  assert pc.run_mode(interpret, backend) == mode


def test_bad_settings_raise_before_tracing():
  q = jnp.zeros((B, 0, 2, D))  # empty: the kernels would return before tracing anything
  g = jnp.zeros((B, 0, 2))
  with pytest.raises(ValueError, match=r"unknown backend 'xla'.*\('auto', 'interpret', 'tpu', 'gpu'\)"):
    pallas.pallas_attention(q, q, q, FPABias(g, g), scale=1.0, backend="xla")
  with pytest.raises(ValueError, match=r"unknown backend 'cuda'"):
    pallas.block_sparse_attention(q, q, q, FPABias(g, g), scale=1.0, skip_tolerance=TOL, backend="cuda")
  with pytest.raises(ValueError, match=r"backend='interpret' runs the Pallas interpreter"):
    pallas.pallas_attention(q, q, q, FPABias(g, g), scale=1.0, backend="interpret", interpret=False)
  with pytest.raises(ValueError, match=r"unknown pallas_backend 'mosaic'"):
    ops.fpa_attention(q, q, q, g, g, impl="pallas", pallas_backend="mosaic")
  with pytest.raises(ValueError, match=r"pallas_backend='tpu' only applies to impl='pallas'"):
    ops.fox_attention(q, q, q, g, impl="chunked", pallas_backend="tpu")
  with pytest.raises(ValueError, match=r"Triton on GPU has neither"):
    ops.fpa_attention(q, q, q, g, g, impl="pallas", skip_tolerance=TOL, pallas_backend="gpu")
  with pytest.raises(ValueError, match=r"the platform must be one of \('tpu', 'cuda'\)"):
    pallas.lower_for(lambda x: x, q, platform="gpu")


def test_lower_for_refuses_a_module_without_kernels():
  """The interpreter's kernels (pallas_backend="auto" on CPU) lower to plain HLO: lower_for says so
  rather than return an export that proves nothing about Mosaic."""
  if jax.default_backend() != "cpu":
    pytest.skip("auto builds the interpreter's kernels on CPU only")
  q, k, v, f, lv, _ = _specs("mha")
  fn = lambda q, k, v, f, lv: ops.fpa_attention(q, k, v, f, lv, impl="pallas")
  with pytest.raises(ValueError, match=r"build them with backend='tpu'"):
    pallas.lower_for(fn, q, k, v, f, lv, platform="tpu")


def test_block_sparse_check_reads_the_chosen_backend(monkeypatch):
  """`validate.check_pallas_skip` asks JAX's backend only under pallas_backend="auto": on a GPU host
  "tpu" lowers the block-sparse TPU kernels, and "gpu" is refused on any host."""
  with pytest.raises(ValueError, match=r"Triton on GPU has neither"):
    ops.validate.check_pallas_skip("pallas", None, TOL, "gpu")  # on this (CPU) host too
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU host, as the checks see it
  with pytest.raises(ValueError, match=r"Triton on GPU has neither"):
    ops.validate.check_pallas_skip("pallas", None, TOL)  # "auto": JAX's backend, as before
  ops.validate.check_pallas_skip("pallas", None, TOL, "interpret")
  exported = pallas.lower_for(_value_and_grads("fpa", "block_sparse", "tpu"), *_specs("mha"), platform="tpu")
  assert sorted(n for _, n in pallas.lowered_kernels(exported)) == sorted(
    f"fpa_block_sparse_{p}" for p in ("fwd", "dkv", "dq")
  )
