"""Grouped-query attention (k / v / gates with kv_heads < heads) in every impl.

Ground truth is the ungrouped op on k / v / gates repeated G times along heads (query head h reads
kv head h // G): values against the float64 numpy loop reference on repeated inputs; gradients
against central finite differences of that reference (tiny case) and against autodiff of the
quadratic op on repeated inputs, where the repeat's transpose sums the grads over the group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _fd import finite_differences
from _tol import assert_close, rtol
from fpa_jax import ops
from fpa_jax.ops import bias, chunked
from fpa_jax.ops import reference_np as ref
from fpa_jax.ops.pallas import BlockSizes

IMPLS = (("quadratic", None, None), ("recurrent", None, None), ("chunked", 4, None), ("chunked", 4, 1e-3))


@functools.partial(jax.jit, static_argnames=("kind", "impl", "blk", "tol"))
def value_and_grads(q, k, v, g1, g2, ct, seg, *, kind, impl, blk, tol):
  """loss = sum(out * ct) and grads w.r.t. (q, k, v, g1[, g2]); kind "fpa" (field g1, level g2)
  or "fox" (log_fgate g1; g2 unused)."""

  def loss(q, k, v, g1, g2):
    kw = dict(impl=impl, segment_ids=seg, block_size=blk, skip_tolerance=tol)
    out = ops.fpa_attention(q, k, v, g1, g2, **kw) if kind == "fpa" else ops.fox_attention(q, k, v, g1, **kw)
    return jnp.sum(out.astype(jnp.float32) * ct)

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g1, g2)


def make(seed, b, t, h, kvh, d=3, dv=2, seg=False, kink_free=False):
  """f32-representable float64 inputs: q [B, T, H, K], k [B, T, KVH, K], v [B, T, KVH, Kv],
  field / level [B, T, KVH], log_fgate [B, T, KVH], ct [B, T, H, Kv], seg [B, T] or None."""
  rng = np.random.default_rng(seed)
  f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)
  q = f32(rng.normal(size=(b, t, h, d)))
  k = f32(rng.normal(size=(b, t, kvh, d)))
  v = f32(rng.normal(size=(b, t, kvh, dv)))
  if kink_free:  # distinct fields 1/4 apart, levels at odd multiples of 1/8: FD never crosses a kink
    field = np.stack([np.stack([rng.permutation(2 * t)[:t] - t for _ in range(kvh)], -1) for _ in range(b)]) * 0.25
    level = (rng.integers(-t, t, size=(b, t, kvh)) + 0.5) * 0.25
  else:
    field = np.cumsum(rng.normal(size=(b, t, kvh)), 1)
    level = field + rng.normal(size=(b, t, kvh))
  lf = -np.abs(rng.normal(size=(b, t, kvh)))
  ct = f32(rng.normal(size=(b, t, h, dv)))
  s = np.sort(rng.integers(0, 3, size=(b, t)), 1).astype(np.int32) if seg else None
  return q, k, v, f32(field), f32(level), f32(lf), ct, s


def rep(x, g):
  return np.repeat(x, g, axis=2)


def run(kind, impl, blk, tol, q, k, v, g1, g2, ct, seg):
  j = lambda x: jnp.asarray(x, jnp.float32)
  val, gr = value_and_grads(
    j(q),
    j(k),
    j(v),
    j(g1),
    j(g2),
    j(ct),
    None if seg is None else jnp.asarray(seg),
    kind=kind,
    impl=impl,
    blk=blk,
    tol=tol,
  )
  return float(val), [np.asarray(x, np.float64) for x in gr]


@pytest.mark.parametrize(
  "h,kvh,seg,kind",
  [  # GQA with segments; MQA
    pytest.param(4, 2, True, "fpa", marks=pytest.mark.slow),
    pytest.param(4, 2, True, "fox", marks=pytest.mark.slow),
    (3, 1, False, "fpa"),
    pytest.param(3, 1, False, "fox", marks=pytest.mark.slow),
  ],
)
def test_values_match_repeated_reference(kind, h, kvh, seg):
  b, t, g = 2, 9, h // kvh  # T = 9 with tile 4: three tiles, the last one padded
  q, k, v, field, level, lf, ct, s = make(0, b, t, h, kvh, seg=seg)
  if kind == "fpa":
    want = ref.fpa_attention_np(q, rep(k, g), rep(v, g), rep(field, g), rep(level, g), segment_ids=s)
  else:
    want = ref.fox_attention_np(q, rep(k, g), rep(v, g), rep(lf, g), segment_ids=s)
  for impl, blk, tol in IMPLS:
    g1, g2 = (field, level) if kind == "fpa" else (lf, lf)
    kw = dict(impl=impl, segment_ids=None if s is None else jnp.asarray(s), block_size=blk, skip_tolerance=tol)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g1, g2)]
    out = ops.fpa_attention(*args, **kw) if kind == "fpa" else ops.fox_attention(*args[:4], **kw)
    assert out.shape == (b, t, h, v.shape[-1])
    # float64 reference: fp32 rounding over t keys, at the scale of v (outputs are convex
    # combinations of v); skip_tolerance moves each output by <= 2 eps max|v| (the chunked module's bound).
    r = rtol(np.float32, t)
    atol = (r if tol is None else 2 * tol + r) * np.abs(v).max()
    np.testing.assert_allclose(np.asarray(out), want, rtol=r, atol=atol, err_msg=f"{kind} {impl} tol={tol}")


def test_grads_match_finite_differences_tiny():
  """Every partial derivative, against central FD of the float64 reference on repeated inputs."""
  b, t, h, kvh, g = 1, 6, 4, 2, 2
  q, k, v, field, level, _, ct, s = make(1, b, t, h, kvh, d=2, dv=2, seg=False, kink_free=True)
  args = [q, k, v, field, level]

  grouped = lambda q, k, v, f, l: ref.fpa_attention_np(q, rep(k, g), rep(v, g), rep(f, g), rep(l, g))
  want = finite_differences(grouped, args, ct, eps=1e-5)
  for impl, blk, tol in IMPLS[:3]:
    _, got = run("fpa", impl, blk, tol, *args, ct, s)
    for name, a, w in zip("q k v field level".split(), got, want):
      np.testing.assert_allclose(a, w, rtol=1e-3, atol=1e-3 * max(1.0, np.abs(w).max()), err_msg=f"{impl} d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fpa", "fox"])
@pytest.mark.parametrize("h,kvh,seg", [(4, 2, True), (3, 1, False)])
def test_grads_match_repeated_heads(kind, h, kvh, seg):
  """Grads of grouped inputs = grads through jnp.repeat of the ungrouped quadratic op (which sums
  the k / v / gate grads over the group); checked against FD in test_ops_grad."""
  b, t, g = 2, 9, h // kvh
  q, k, v, field, level, lf, ct, s = make(2, b, t, h, kvh, seg=seg)
  g1, g2 = (field, level) if kind == "fpa" else (lf, lf)
  j = lambda x: jnp.asarray(x, jnp.float32)
  seg_j = None if s is None else jnp.asarray(s)

  def loss_rep(q, k, v, g1, g2):
    r = lambda x: jnp.repeat(x, g, axis=2)  # the ground truth only: the ops never repeat
    kw = dict(impl="quadratic", segment_ids=seg_j)
    out = (
      ops.fpa_attention(q, r(k), r(v), r(g1), r(g2), **kw)
      if kind == "fpa"
      else ops.fox_attention(q, r(k), r(v), r(g1), **kw)
    )
    return jnp.sum(out * j(ct))

  want_val, want = jax.value_and_grad(loss_rep, argnums=(0, 1, 2, 3, 4))(*map(j, (q, k, v, g1, g2)))
  for impl, blk, tol in IMPLS:
    val, got = run(kind, impl, blk, tol, q, k, v, g1, g2, ct, s)
    # Exact impls: fp32 rounding over t keys; val sums ct.size unit random terms (~sqrt of that).
    # With skip_tolerance these random inputs drop little; the bound is loose, a tolerance here.
    if tol is None:
      assert_close(val, float(want_val), dtype=np.float32, n=t, scale=max(abs(float(want_val)), np.sqrt(ct.size)))
    else:
      np.testing.assert_allclose(val, float(want_val), rtol=1e-2, atol=1e-2)
    for name, a, w in zip("q k v g1 g2".split(), got, want):
      w = np.asarray(w)
      assert a.shape == w.shape
      if tol is None:
        assert_close(a, w, dtype=np.float32, n=t, err_msg=f"{kind} {impl} tol={tol} d{name}")
      else:
        np.testing.assert_allclose(
          a, w, rtol=1e-2, atol=1e-2 * max(1.0, np.abs(w).max()), err_msg=f"{kind} {impl} tol={tol} d{name}"
        )


def test_skip_drops_tiles_for_the_whole_group():
  """Strong forgetting: chunked skipping drops tiles under GQA, dead per (batch, kv head) with the
  group's largest query norm, and the output stays within the bound of the exact one."""
  b, t, h, kvh = 1, 32, 4, 2
  q, k, v, _, _, _, _, _ = make(3, b, t, h, kvh)
  lf = np.full((b, t, kvh), -4.0)
  j = lambda x: jnp.asarray(x, jnp.float32)
  fb = bias.FoXBias(jnp.cumsum(j(lf), 1))
  dead = chunked.dead_tiles(j(q), j(k), fb, skip_tolerance=1e-3, block_size=4)
  assert dead.shape == (b, kvh, 8, 8) and bool(dead.any())
  # Scaling one query head of a group up can only keep more of that group's tiles.
  q2 = q.copy()
  q2[:, :, 1] *= 50.0
  dead2 = chunked.dead_tiles(j(q2), j(k), fb, skip_tolerance=1e-3, block_size=4)
  assert bool((dead2 <= dead).all()) and int(dead2[:, 0].sum()) < int(dead[:, 0].sum())
  exact = ops.fox_attention(j(q), j(k), j(v), j(lf), impl="chunked", block_size=4)
  skip = ops.fox_attention(j(q), j(k), j(v), j(lf), impl="chunked", block_size=4, skip_tolerance=1e-3)
  np.testing.assert_allclose(np.asarray(skip), np.asarray(exact), atol=(2e-3 + rtol(np.float32, t)) * np.abs(v).max())


def test_decode_step_cache_holds_kv_heads():
  """The cache is per kv head; decode steps match the quadratic op on the same grouped inputs."""
  b, t, h, kvh = 2, 5, 4, 2
  q, k, v, field, level, _, _, _ = make(4, b, t, h, kvh)
  j = lambda x: jnp.asarray(x, jnp.float32)
  cache = ops.init_recurrent_cache(b, t, kvh, q.shape[-1], v.shape[-1])
  outs = []
  for i in range(t):
    o, cache = ops.decode_step(
      cache, j(q[:, i]), j(k[:, i]), j(v[:, i]), j(field[:, i]), j(level[:, i]), scale=q.shape[-1] ** -0.5
    )
    outs.append(o)
  assert cache.k.shape == (b, t, kvh, q.shape[-1]) and cache.level.shape == (b, t, kvh)
  want = ops.fpa_attention(*map(j, (q, k, v, field, level)), impl="quadratic")
  assert_close(np.stack(outs, 1), want, n=t)


def test_bad_head_counts_raise_before_tracing():
  b, t, d = 1, 4, 2
  q = jnp.zeros((b, t, 4, d))
  k3, v3 = jnp.zeros((b, t, 3, d)), jnp.zeros((b, t, 3, d))
  g3 = jnp.zeros((b, t, 3))
  for impl in ("quadratic", "chunked", "recurrent", "pallas", "auto"):
    with pytest.raises(ValueError, match="multiple of k's kv_heads"):
      ops.fpa_attention(q, k3, v3, g3, g3, impl=impl)
    with pytest.raises(ValueError, match="multiple of k's kv_heads"):
      ops.fox_attention(q, k3, v3, g3, impl=impl)
  with pytest.raises(ValueError, match="multiple of k's kv_heads"):
    ops.softmax_attention(q, k3, v3)
  k2, v2, g2 = jnp.zeros((b, t, 2, d)), jnp.zeros((b, t, 2, d)), jnp.zeros((b, t, 2))
  with pytest.raises(ValueError, match="v must be"):
    ops.fpa_attention(q, k2, jnp.zeros((b, t, 4, d)), g2, g2)  # v with q's heads, k with kv_heads
  with pytest.raises(ValueError, match=r"field must have shape \[batch, seq, kv_heads\]"):
    ops.fpa_attention(q, k2, v2, jnp.zeros((b, t, 4)), g2)  # per-query-head gates: one convention only
  with pytest.raises(ValueError, match="log_fgate"):
    ops.fox_attention(q, k2, v2, jnp.zeros((b, t, 4)))
  # "auto" keeps grouped heads on "chunked" on every backend (module docstring of ops.attention).
  assert ops.validate.resolve_impl("auto", grouped=True) == "chunked"


def test_softmax_attention_grouped():
  b, t, h, kvh = 1, 7, 4, 1
  q, k, v, *_ = make(5, b, t, h, kvh)
  want = ref.softmax_attention_np(q, rep(k, h), rep(v, h))
  got = ops.softmax_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
  assert_close(got, want, dtype=np.float32, n=t)


@pytest.mark.parametrize(
  "kind,h,kvh,seg,block",
  [
    ("fpa", 4, 2, True, 8),
    pytest.param("fox", 2, 1, False, 8, marks=pytest.mark.slow),
    pytest.param("fpa", 2, 1, False, BlockSizes(16, 8), marks=pytest.mark.slow),
    pytest.param(
      "fpa", 6, 2, False, 8, marks=pytest.mark.slow
    ),  # G = 3: the dK / dV kernel's [G, T, .] head blocks start at h G
  ],
)
def test_pallas_grouped_matches_quadratic(kind, h, kvh, seg, block):
  """Interpret mode: forward / dQ index maps h -> h // G; the dK / dV kernel per kv head summing its
  group's query heads in the kernel."""
  b, t = 1, 13 if block == 8 else 16  # 13 with tile 8: two tiles, the last padded
  q, k, v, field, level, lf, ct, s = make(6, b, t, h, kvh, d=4, dv=3, seg=seg, kink_free=True)
  g1, g2 = (field, level) if kind == "fpa" else (lf, lf)
  want_val, want = run(kind, "quadratic", None, None, q, k, v, g1, g2, ct, s)
  val, got = run(kind, "pallas", block, None, q, k, v, g1, g2, ct, s)
  assert_close(val, want_val, dtype=np.float32, n=t, scale=max(abs(want_val), np.sqrt(ct.size)))
  for name, a, w in zip("q k v g1 g2".split(), got, want):
    assert_close(a, w, dtype=np.float32, n=t, err_msg=f"{kind} d{name}")
