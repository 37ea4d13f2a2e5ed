"""impl="pallas" against "quadratic" and "chunked": outputs and every gradient.

On CPU the kernels run in the Pallas interpreter (the TPU / GPU lowerings are not exercised here).
On a TPU / GPU backend impl="pallas" compiles them (Mosaic / Triton: `interpret=False` is the default
there), so the same tests check the compiled kernels: `FPA_PALLAS_COMPILED=1 pytest
tests/ops/pallas/test_kernels.py` on an accelerator, which skips the module where JAX has no TPU / GPU
rather than passing in the interpreter (docs/ops.md, "Verifying the Pallas kernels on an accelerator").
Each case compiles the forward and both backward kernels once, a few seconds on a loaded CPU, so
the cases are few and small; between them they cover T not a multiple of the tile (padding),
several tiles (an in-between block for R), different forward / backward tiles, a single tile,
segment ids, v_dim != head_dim and bf16 inputs.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_close
from fpa_jax import configs, ops
from fpa_jax.ops import validate
from fpa_jax.ops.pallas import BlockSizes

NAMES = ("q", "k", "v", "gate", "level")

if os.environ.get("FPA_PALLAS_COMPILED", "0") == "1" and jax.default_backend() not in ("tpu", "gpu"):
  pytest.skip(
    f"FPA_PALLAS_COMPILED=1 checks the compiled kernels and needs a TPU / GPU backend, JAX's is "
    f"{jax.default_backend()!r} (install an accelerator jax, or unset it for the interpreter tests)",
    allow_module_level=True,
  )


@functools.partial(jax.jit, static_argnames=("impl", "blk", "fox"))
def value_and_grads(q, k, v, gate, level, ct, seg, *, impl, blk, fox):
  """(out, grads w.r.t. q, k, v, gate, level) of loss = sum(out * ct); gate is log_fgate for FoX
  (then level is unused and its gradient 0), the field for FPA."""

  def loss(q, k, v, gate, level):
    if fox:
      out = ops.fox_attention(q, k, v, gate, impl=impl, segment_ids=seg, block_size=blk)
    else:
      out = ops.fpa_attention(q, k, v, gate, level, impl=impl, segment_ids=seg, block_size=blk)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gate, level)
  return out, grads


def make_inputs(seed, b, t, h, d, dv, seg, fox=False, dtype=jnp.float32):
  """Kink-free gates (as in test_ops_grad): fields distinct multiples of 1/4, levels odd multiples
  of 1/8, so no min() or relu() sits on a tie and every impl has the same gradient. FoX: a
  log-sigmoid forget gate."""
  rng = np.random.default_rng(seed)
  q, k = (rng.normal(size=(b, t, h, d)) for _ in range(2))
  v, ct = (rng.normal(size=(b, t, h, dv)) for _ in range(2))
  if fox:
    gate = np.asarray(jax.nn.log_sigmoid(jnp.asarray(rng.normal(size=(b, t, h)) * 2 + 1)))
  else:
    gate = np.stack([np.stack([rng.permutation(2 * t)[:t] - t for _ in range(h)], -1) for _ in range(b)]) * 0.25
  level = (rng.integers(-t, t, size=(b, t, h)) + 0.5) * 0.25
  if seg == "unsorted":
    seg = rng.integers(0, 3, size=(b, t))
  elif seg == "sorted":
    seg = np.sort(rng.integers(0, 3, size=(b, t)), 1)
  qkv = [jnp.asarray(x, dtype) for x in (q, k, v)]
  rest = [jnp.asarray(x, jnp.float32) for x in (gate, level, ct)]
  return (*qkv, *rest, None if seg is None else jnp.asarray(seg, jnp.int32))


def check_close(got, want, msg, **tol):
  """`_tol.assert_close(got, want, **tol)` per array (out and every gradient), all finite."""
  for name, g, w in zip(("out",) + NAMES, got, want):
    assert g.shape == w.shape and np.all(np.isfinite(np.asarray(g, np.float64))), (msg, name)
    assert_close(g, w, err_msg=f"{msg}: {name}", **tol)


def flat(res):
  out, grads = res
  return (out, *grads)


CASES = [
  # (seed, b, t, h, d, dv, seg, fox, block, vs_chunked)
  # T=21 with tile 8: 3 tiles (one in between, for R), the last one padded.
  (0, 2, 21, 2, 4, 3, "unsorted", False, 8, True),
  # Forward tiles of 16, backward tiles of 8 (stats for both tilings); T a multiple of both.
  pytest.param(1, 1, 16, 1, 8, 8, None, False, BlockSizes(16, 8), False, marks=pytest.mark.slow),
  pytest.param(3, 2, 19, 2, 4, 4, "sorted", True, 8, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("seed,b,t,h,d,dv,seg,fox,block,vs_chunked", CASES)
def test_pallas_matches_quadratic_and_chunked(seed, b, t, h, d, dv, seg, fox, block, vs_chunked):
  q, k, v, gate, level, ct, seg = make_inputs(seed, b, t, h, d, dv, seg, fox)
  got = flat(value_and_grads(q, k, v, gate, level, ct, seg, impl="pallas", blk=block, fox=fox))
  want = flat(value_and_grads(q, k, v, gate, level, ct, seg, impl="quadratic", blk=None, fox=fox))
  check_close(got, want, "pallas vs quadratic", n=t)  # sums over t keys (queries for dk, dv)
  assert np.abs(np.asarray(want[4])).max() > 1e-3, "the gate gradient should not vanish"
  if vs_chunked:
    check_close(
      got,
      flat(value_and_grads(q, k, v, gate, level, ct, seg, impl="chunked", blk=block, fox=fox)),
      "pallas vs chunked",
      n=t,
    )


def test_pallas_single_default_tile():
  # The interpreter's default tile (32) shrunk to T=5: one diagonal tile, nothing else.
  q, k, v, gate, level, _, seg = make_inputs(2, 1, 5, 2, 3, 3, "sorted")
  fpa = jax.jit(ops.fpa_attention, static_argnames=("impl",))
  assert_close(
    fpa(q, k, v, gate, level, segment_ids=seg, impl="pallas"),
    fpa(q, k, v, gate, level, segment_ids=seg, impl="quadratic"),
    n=5,
  )


@pytest.mark.slow  # bf16: ops/test_reference.py's chunked bf16; pallas: its fp32 case
def test_pallas_bf16():
  # bf16 q / k / v (gates stay fp32): the kernels' matmuls take bf16 operands (p, dS rounded to
  # bf16 as in FlashAttention), the reference sees the same rounded inputs with fp32 softmax.
  q, k, v, gate, level, ct, seg = make_inputs(4, 1, 13, 2, 8, 4, "unsorted", dtype=jnp.bfloat16)
  got = flat(value_and_grads(q, k, v, gate, level, ct, seg, impl="pallas", blk=8, fox=False))
  assert got[0].dtype == jnp.bfloat16 and all(g.dtype == x.dtype for g, x in zip(got[1:], (q, k, v, gate, level)))
  f32 = lambda x: x.astype(jnp.float32)
  want = flat(value_and_grads(f32(q), f32(k), f32(v), gate, level, ct, seg, impl="quadratic", blk=None, fox=False))
  # one bf16 rounding of each p / dS (and of the result), fp32 accumulation: a couple of bf16 eps
  check_close(got, want, "pallas bf16 vs quadratic fp32", dtype=jnp.bfloat16, factor=2)


def test_auto_resolves_to_chunked_on_every_backend(monkeypatch):
  # Traced only (no compile): "auto" must not reach a pallas_call (on any backend, until the compiled
  # kernels have passed on an accelerator: pallas is opt-in), "pallas" must.
  assert validate.resolve_impl("auto") == "chunked"
  q, k, v, gate, level, _, _ = make_inputs(5, 1, 11, 1, 4, 4, None)
  jaxpr = lambda impl: str(jax.make_jaxpr(functools.partial(ops.fpa_attention, impl=impl))(q, k, v, gate, level))
  assert "pallas_call" not in jaxpr("auto") and jaxpr("auto") == jaxpr("chunked")
  assert "pallas_call" in jaxpr("pallas")
  for backend in ("tpu", "gpu"):
    monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
    assert validate.resolve_impl("auto") == validate.resolve_impl("auto", grouped=True) == "chunked"
  assert validate.resolve_impl("quadratic") == "quadratic"


def test_names_and_errors():
  assert {"pallas", "auto"} <= set(ops.IMPLS) and configs.ATTN_IMPLS == ops.IMPLS
  assert configs.Config().attn_impl == "auto"
  with pytest.raises(ValueError, match="unknown attn_impl 'flash'"):
    configs.Config(attn_impl="flash").validate()
  configs.Config(attn_impl="pallas", block_size=16).validate()
  q, k, v, gate, level, _, _ = make_inputs(6, 1, 4, 1, 2, 2, None)
  with pytest.raises(ValueError, match="impl must be one of"):
    ops.fpa_attention(q, k, v, gate, level, impl="flash")
  with pytest.raises(ValueError, match="block_size"):
    ops.fpa_attention(q, k, v, gate, level, impl="quadratic", block_size=4)
  for bad in (0, BlockSizes(8, -1), "8"):
    with pytest.raises(ValueError, match="block sizes"):
      ops.fpa_attention(q, k, v, gate, level, impl="pallas", block_size=bad)
  assert BlockSizes.default("tpu").fwd % 128 == 0 and BlockSizes(16, 8).backward == 8
