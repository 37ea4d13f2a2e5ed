"""impl="pallas" with skip_tolerance (the block-sparse kernels, `ops.pallas.block_sparse`) against the
chunked kernel with the same tolerance, which drops the same tiles: outputs and every gradient.

In the Pallas interpreter on CPU (as tests/ops/pallas/test_kernels.py; `FPA_PALLAS_COMPILED=1` on a TPU runs
them compiled). Gates fall at a different rate per (batch row, kv head), so the dropped tiles differ
between them: per-(row, head) index lists, not one shared mask. Between them the cases cover T not a
multiple of the tile, grouped heads, segment ids, FPA and FoX, a query block whose only live tile
is its diagonal, and skip_tolerance=None (every causal tile: the exact kernels).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_close
from fpa_jax import ops
from fpa_jax.ops import bias as _bias
from fpa_jax.ops import chunked
from fpa_jax.ops.pallas import BlockSizes, block_sparse_attention
from fpa_jax.ops.pallas.block_sparse import live_lists, tile_lists

NAMES = ("out", "q", "k", "v", "gate", "level")

if os.environ.get("FPA_PALLAS_COMPILED", "0") == "1" and jax.default_backend() != "tpu":
  pytest.skip("the compiled block-sparse kernels need a TPU backend (scalar prefetch)", allow_module_level=True)


@functools.partial(jax.jit, static_argnames=("impl", "blk", "fox", "tol"))
def value_and_grads(q, k, v, gate, level, ct, seg, *, impl, blk, fox, tol):
  """(out, grads w.r.t. q, k, v, gate, level) of sum(out * ct); gate: log_fgate (FoX) or the field."""

  def loss(q, k, v, gate, level):
    kw = dict(impl=impl, segment_ids=seg, block_size=blk, skip_tolerance=tol)
    out = ops.fox_attention(q, k, v, gate, **kw) if fox else ops.fpa_attention(q, k, v, gate, level, **kw)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gate, level)
  return (out, *grads)


def make_inputs(seed, b, t, h, kvh, d, seg_on, fox, drop=None):
  """Gates that fall at rate 0.2 or 2 per token by (row, kv head): at 2 the tiles a few blocks back
  are dead, at 0.2 none is. FPA: field a falling random walk, level = field + noise (continuous:
  no ties). drop: a position whose gate falls by 60 at once (every earlier tile dead after it)."""
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, kvh, d))
  v = rng.normal(size=(b, t, kvh, d))
  ct = rng.normal(size=(b, t, h, d))
  rate = np.where((np.arange(b)[:, None] + np.arange(kvh)[None, :]) % 2 == 0, 2.0, 0.2)[:, None, :]
  step = rate * rng.uniform(0.5, 1.5, size=(b, t, kvh))
  if drop is not None:
    step[:, drop] = 60.0
  if fox:
    gate, level = -step, np.zeros_like(step)
  else:
    gate = -np.cumsum(step, 1)
    level = gate + rng.normal(size=gate.shape) * 0.5 + 0.5
  seg = None
  if seg_on:
    seg = np.sort(rng.integers(0, 3, size=(b, t)), 1)
  arr = lambda x: jnp.asarray(x, jnp.float32)
  return (*map(arr, (q, k, v, gate, level, ct)), None if seg is None else jnp.asarray(seg, jnp.int32))


def _dead(q, k, gate, level, fox, tol, blk):
  bias = _bias.FoXBias(jnp.cumsum(gate, 1)) if fox else _bias.FPABias(gate, level)
  return np.asarray(chunked.dead_tiles(q, k, bias, skip_tolerance=tol, block_size=blk))


def check_close(got, want, msg, n):
  for name, g, w in zip(NAMES, got, want):
    assert g.shape == w.shape and np.all(np.isfinite(np.asarray(g))), (msg, name)
    assert_close(g, w, n=n, err_msg=f"{msg}: {name}")


CASES = [
  # (seed, b, t, h, kvh, seg, fox, drop): T=60 with tiles of 8 (the last one padded); grouped heads
  (0, 2, 60, 4, 2, True, False, None),
  # FoX; a fall of 60 at token 24: query block 3's only live tile is its diagonal
  (1, 1, 48, 2, 2, False, True, 24),
]


@pytest.mark.parametrize("seed,b,t,h,kvh,seg,fox,drop", CASES)
def test_block_sparse_matches_chunked_with_the_same_tolerance(seed, b, t, h, kvh, seg, fox, drop):
  tol, blk = 1e-3, 8
  q, k, v, gate, level, ct, seg = make_inputs(seed, b, t, h, kvh, 4, seg, fox, drop)
  dead = _dead(q, k, gate, level, fox, tol, blk)
  n_dead = dead.sum((-2, -1))
  # tiles are dropped, not everywhere alike: the lists are per (row, kv head)
  assert n_dead.max() > 0 and n_dead.min() < n_dead.max(), n_dead
  if drop is not None:
    assert dead[..., drop // blk, : drop // blk].all()  # that block walks its diagonal alone
  got = value_and_grads(q, k, v, gate, level, ct, seg, impl="pallas", blk=blk, fox=fox, tol=tol)
  want = value_and_grads(q, k, v, gate, level, ct, seg, impl="chunked", blk=blk, fox=fox, tol=tol)
  check_close(got, want, "block-sparse pallas vs chunked, same skip_tolerance", n=t)
  assert np.abs(np.asarray(want[4])).max() > 1e-3, "the gate gradient should not vanish"


@pytest.mark.parametrize("fox", [pytest.param(False, marks=pytest.mark.slow), True])
def test_block_sparse_walks_exactly_the_given_tiles(monkeypatch, fox):
  # The sound bound drops tiles whose weights are far below rounding, so the test above cannot
  # tell a dropped tile from a kept one. Here both kernels get one arbitrary dead mask (drawn per
  # (row, kv head), live tiles of real weight dropped): equal to each other, far from the exact
  # result. A shape no other test traces (the jitted ops cache their traces).
  t, blk, tol = 37, 8, 1e-3
  q, k, v, gate, level, ct, seg = make_inputs(4, 2, t, 4, 2, 4, True, fox)
  nb = -(-t // blk)
  below = np.arange(nb)[:, None] > np.arange(nb)[None, :]
  mask = jnp.asarray(np.random.default_rng(5).random((2, 2, nb, nb)) < 0.5) & below
  monkeypatch.setattr(chunked, "_dead_tiles", lambda *a: mask)
  got = value_and_grads(q, k, v, gate, level, ct, seg, impl="pallas", blk=blk, fox=fox, tol=tol)
  want = value_and_grads(q, k, v, gate, level, ct, seg, impl="chunked", blk=blk, fox=fox, tol=tol)
  check_close(got, want, "block-sparse pallas vs chunked, one dead mask", n=t)
  exact = value_and_grads(q, k, v, gate, level, ct, seg, impl="chunked", blk=blk, fox=fox, tol=None)
  assert np.abs(np.asarray(exact[0] - want[0])).max() > 1e-2, "the mask should drop weight"


@pytest.mark.slow  # fp32: ..._matches_chunked_with_the_same_tolerance
def test_block_sparse_bf16():
  # bf16 q / k / v: the kernels round p / dS to bf16 for their matmuls (as `kernels.py`); the
  # reference, chunked in fp32 on the same rounded inputs, drops the same tiles (the bound reads
  # fp32 norms of those values).
  t, blk, tol = 29, 8, 1e-3
  q, k, v, gate, level, ct, seg = make_inputs(6, 1, t, 2, 1, 8, False, False)
  bf = lambda x: x.astype(jnp.bfloat16)
  got = value_and_grads(bf(q), bf(k), bf(v), gate, level, ct, seg, impl="pallas", blk=blk, fox=False, tol=tol)
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
  f32 = lambda x: bf(x).astype(jnp.float32)
  want = value_and_grads(f32(q), f32(k), f32(v), gate, level, ct, seg, impl="chunked", blk=blk, fox=False, tol=tol)
  assert _dead(f32(q), f32(k), gate, level, False, tol, blk).any()
  for name, g, w in zip(NAMES, got, want):
    assert_close(g, w, dtype=jnp.bfloat16, factor=2, err_msg=f"bf16 block-sparse vs fp32 chunked: {name}")


def test_block_sparse_without_tolerance_is_exact():
  # skip_tolerance=None walks every causal tile: the exact result, values and gradients.
  q, k, v, gate, level, ct, seg = make_inputs(2, 1, 21, 2, 1, 4, True, False)
  bsp = lambda q, k, v, gate, level: block_sparse_attention(
    q, k, v, _bias.FPABias(gate, level), scale=0.5, skip_tolerance=None, segment_ids=seg, block_sizes=8
  )
  exact = lambda q, k, v, gate, level: ops.fpa_attention(
    q, k, v, gate, level, impl="quadratic", scale=0.5, segment_ids=seg
  )

  def vg(f):
    loss = lambda *a: (jnp.sum(f(*a) * ct), f(*a))
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, gate, level)
    return (out, *grads)

  check_close(jax.jit(lambda: vg(bsp))(), jax.jit(lambda: vg(exact))(), "block-sparse (no tolerance) vs quadratic", 21)


def test_live_lists():
  # diagonal first, then the live blocks ascending, then the last live one repeated
  live = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 0, 1, 1]]], bool)[None]
  count, idx = live_lists(live)
  assert count.tolist() == [[[1, 2, 1, 3]]]
  assert idx.tolist() == [[[[0, 0, 0, 0], [1, 0, 0, 0], [2, 2, 2, 2], [3, 0, 2, 2]]]]
  dead = ~live & (jnp.arange(4)[:, None] > jnp.arange(4)[None, :])
  cnt, idx, cnt_t, idx_t = tile_lists(dead, (1, 1, 4))
  assert cnt.tolist() == count.tolist() and idx.tolist() == [[[[0, 0, 0, 0], [1, 0, 0, 0], [2, 2, 2, 2], [3, 0, 2, 2]]]]
  # the transposed walk: key block J's live query blocks I >= J, J first
  assert cnt_t.tolist() == [[[3, 1, 2, 1]]] and idx_t.tolist()[0][0][:3] == [[0, 1, 3, 3], [1, 1, 1, 1], [2, 3, 3, 3]]


def test_errors_before_tracing(monkeypatch):
  q, k, v, gate, level, _, _ = make_inputs(3, 1, 8, 1, 1, 2, False, False)
  with pytest.raises(ValueError, match="skip='keys' \\(key-sparse attention\\) is the chunked kernel's"):
    ops.fpa_attention(q, k, v, gate, level, impl="pallas", skip_tolerance=1e-3, skip="keys")
  with pytest.raises(ValueError, match="one tile size"):
    ops.fpa_attention(q, k, v, gate, level, impl="pallas", skip_tolerance=1e-3, block_size=BlockSizes(16, 8))
  with pytest.raises(ValueError, match="skip_tolerance only applies to the tiled kernels"):
    ops.fox_attention(q, k, v, gate, impl="recurrent", skip_tolerance=1e-3)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with pytest.raises(ValueError, match="Triton on GPU"):
    ops.fox_attention(q, k, v, gate, impl="pallas", skip_tolerance=1e-3)
