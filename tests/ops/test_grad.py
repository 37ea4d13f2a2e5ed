"""Gradients of every fpa_attention impl: against central finite differences, against each other,
and finite (no NaN / inf) on hard inputs.

Finite differences. The ops keep their statistics in fp32 whatever the input dtype, so there is no
float64 path through them. Two FD checks instead:
  * elementwise central FD (eps 1e-5) of the float64 numpy loop reference `fpa_attention_np`,
    against each impl's fp32 `jax.grad`: every partial derivative of every input;
  * directional central FD (eps 1e-2) of the op itself in fp32, along a random direction.
The penalty is piecewise linear in field / level (min, relu), so FD inputs are kink-free by
construction: fields are distinct multiples of 1/4 and levels are odd multiples of 1/8, so every
level - field difference is >= 1/8 away from 0 and every two fields are >= 1/4 apart, far more
than any FD step moves them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_close
from fpa_jax import ops
from fpa_jax.ops import reference_np as ref

NAMES = ("q", "k", "v", "field", "level")


@functools.partial(jax.jit, static_argnames=("impl", "blk"))
def value_and_grads(q, k, v, field, level, ct, seg, *, impl, blk):
  """loss = sum(out * ct) and its gradients w.r.t. (q, k, v, field, level)."""

  def loss(q, k, v, field, level):
    out = ops.fpa_attention(q, k, v, field, level, impl=impl, segment_ids=seg, block_size=blk)
    return jnp.sum(out.astype(jnp.float32) * ct)

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, field, level)


def impl_blocks(blk):
  return [("quadratic", None), ("recurrent", None), ("chunked", blk)]


def kink_free_gates(rng, b, t, h):
  """field: distinct multiples of 1/4 per (b, h); level: odd multiples of 1/8. [B, T, H] float64."""
  field = np.stack([np.stack([rng.permutation(2 * t)[:t] - t for _ in range(h)], -1) for _ in range(b)]) * 0.25
  level = (rng.integers(-t, t, size=(b, t, h)) + 0.5) * 0.25
  return field.astype(np.float64), level.astype(np.float64)


def make_inputs(seed, b, t, h, d, dv, gates="kink_free", seg=None):
  rng = np.random.default_rng(seed)
  q, k = (rng.normal(size=(b, t, h, d)).astype(np.float32).astype(np.float64) for _ in range(2))
  v = rng.normal(size=(b, t, h, dv)).astype(np.float32).astype(np.float64)
  if gates == "kink_free":
    field, level = kink_free_gates(rng, b, t, h)
  elif gates == "iid":
    field, level = rng.normal(size=(b, t, h)), rng.normal(size=(b, t, h))
  elif gates == "spikes":  # +-1e3 excursions of the field, some levels far above / below
    field = np.cumsum(rng.normal(size=(b, t, h)), 1)
    field = np.where(rng.random((b, t, h)) < 0.3, rng.choice([-1e3, 1e3], size=(b, t, h)), field)
    level = np.where(rng.random((b, t, h)) < 0.5, field, rng.choice([-1e3, 0.0, 1e3], size=(b, t, h)))
  elif gates == "ties":  # integer shared walk: many equal field values, penalties exactly 0
    field = np.cumsum(rng.integers(-1, 2, size=(b, t, h)), 1).astype(np.float64)
    level = field
  else:
    raise ValueError(gates)
  field, level = (x.astype(np.float32).astype(np.float64) for x in (field, level))
  ct = rng.normal(size=(b, t, h, dv)).astype(np.float32).astype(np.float64)
  if seg == "unsorted":
    seg = rng.integers(0, 3, size=(b, t)).astype(np.int32)
  elif seg == "sorted":
    seg = np.sort(rng.integers(0, 3, size=(b, t)), 1).astype(np.int32)
  elif seg == "isolated":
    seg = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  return (q, k, v, field, level), ct, seg


def jax_grads(args, ct, seg, impl, blk):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  val, g = value_and_grads(*map(f32, args), f32(ct), None if seg is None else jnp.asarray(seg), impl=impl, blk=blk)
  return float(val), [np.asarray(x, np.float64) for x in g]


def fd_grads_np(args, ct, seg, eps=1e-5):
  """Elementwise central finite differences of sum(fpa_attention_np(...) * ct), float64."""

  def loss(a):
    return float(np.sum(ref.fpa_attention_np(*a, segment_ids=seg) * ct))

  grads = []
  for n in range(len(args)):
    g = np.zeros_like(args[n])
    for idx in np.ndindex(args[n].shape):
      a_plus = [x.copy() for x in args]
      a_minus = [x.copy() for x in args]
      a_plus[n][idx] += eps
      a_minus[n][idx] -= eps
      g[idx] = (loss(a_plus) - loss(a_minus)) / (2 * eps)
    grads.append(g)
  return grads


def assert_grads_close(got, want, rtol=None, atol_rel=None, msg="", *, n=None):
  """Against finite differences: `rtol` and `atol_rel` (x max(1, max|want|)), the FD error. Against
  another impl: `n`, the reduction length (`_tol`: fp32 rounding in another order)."""
  for name, g, w in zip(NAMES, got, want):
    assert g.shape == w.shape, (msg, name)
    if n is not None:
      assert_close(g, w, dtype=np.float32, n=n, err_msg=f"{msg}: d/d{name}")
      continue
    atol = atol_rel * max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{msg}: d/d{name}")


def assert_loss_close(val, want, ct, n):
  """sum(out * ct) of two impls: N = ct.size unit random terms sum to ~sqrt(N), whatever cancels."""
  assert_close(val, want, dtype=np.float32, n=n, scale=max(abs(want), np.sqrt(np.size(ct))))


# ----------------------------------------------------------------------------- finite differences


# Most tests share one shape, so the jitted gradients compile once per (impl, segment_ids present).
SHAPE = dict(b=2, t=9, h=2, d=3, dv=2)

FD_CASES = [
  # (seed, b, t, h, d, dv, seg, blk): T=9 with tile 4 -> 3 tiles (an in-between tile for R),
  # the last one padded.
  (0, 1, 9, 1, 2, 3, None, 4),
  pytest.param(1, *SHAPE.values(), "unsorted", 4, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("seed,b,t,h,d,dv,seg,blk", FD_CASES)
def test_grads_match_fd_of_float64_reference(seed, b, t, h, d, dv, seg, blk):
  args, ct, seg = make_inputs(seed, b, t, h, d, dv, "kink_free", seg)
  want = fd_grads_np(args, ct, seg)
  # The inputs are meant to exercise both penalty branches: some active, some clipped to 0.
  pens = np.stack([ref.penalty_np(args[3][bb, :, hh], args[4][bb, :, hh]) for bb in range(b) for hh in range(h)])
  lower = np.tril(np.ones((t, t), bool), -1)
  assert (pens[:, lower] > 0).any() and (pens[:, lower] == 0).any()
  assert np.abs(want[3]).max() > 1e-3 and np.abs(want[4]).max() > 1e-3, "gate gradients should not vanish"
  for impl, bs in impl_blocks(blk):
    _, got = jax_grads(args, ct, seg, impl, bs)
    assert_grads_close(got, want, rtol=1e-3, atol_rel=1e-4, msg=f"impl={impl} block={bs} vs FD(reference)")


@pytest.mark.parametrize("impl,blk", [("quadratic", None), ("recurrent", None), ("chunked", 4)])
def test_grads_match_fp32_directional_fd_of_op(impl, blk):
  seed, b, t, h, d, dv, seg, _ = FD_CASES[0]
  args, ct, seg = make_inputs(seed, b, t, h, d, dv, "kink_free", seg)
  _, g = jax_grads(args, ct, seg, impl, blk)
  rng = np.random.default_rng(123)
  for n, name in enumerate(NAMES):
    direction = rng.normal(size=args[n].shape)
    direction /= np.abs(direction).max()  # every entry moves by <= eps: no kink is crossed
    eps = 1e-2
    plus, minus = list(args), list(args)
    plus[n] = args[n] + eps * direction
    minus[n] = args[n] - eps * direction
    fd = (jax_grads(plus, ct, seg, impl, blk)[0] - jax_grads(minus, ct, seg, impl, blk)[0]) / (2 * eps)
    an = float(np.sum(g[n] * direction))
    assert abs(fd - an) <= 1e-2 * abs(an) + 2e-3, (name, fd, an)


# ----------------------------------------------------------------------------- impls agree


AGREE_CASES = [
  # (seed, b, t, h, d, dv, gates, seg, blk)
  (3, *SHAPE.values(), "iid", "sorted", 4),
  pytest.param(4, *SHAPE.values(), "spikes", None, 4, marks=pytest.mark.slow),
  (5, *SHAPE.values(), "spikes", "unsorted", 4),
  (6, 1, 1, 2, 3, 2, "iid", None, None),  # T = 1
]


@pytest.mark.parametrize("seed,b,t,h,d,dv,gates,seg,blk", AGREE_CASES)
def test_impl_grads_agree_and_are_finite(seed, b, t, h, d, dv, gates, seg, blk):
  args, ct, seg = make_inputs(seed, b, t, h, d, dv, gates, seg)
  val_q, want = jax_grads(args, ct, seg, "quadratic", None)
  for g in want:
    assert np.all(np.isfinite(g))
  for impl, bs in impl_blocks(blk)[1:]:
    val, got = jax_grads(args, ct, seg, impl, bs)
    assert_loss_close(val, val_q, ct, n=t)
    for name, g in zip(NAMES, got):
      assert np.all(np.isfinite(g)), (impl, name)
    assert_grads_close(got, want, n=t, msg=f"impl={impl} block={bs} vs quadratic")


@pytest.mark.parametrize("seg", [None, "unsorted"])
def test_grads_finite_on_ties(seg):
  # Plateaus of an integer shared walk: min() and relu() sit exactly on their kinks. The
  # subgradient picked may differ between impls (tie splitting), so only finiteness is checked,
  # plus the q / k / v gradients, which do not go through any kink.
  args, ct, seg = make_inputs(9, *SHAPE.values(), "ties", seg)
  _, want = jax_grads(args, ct, seg, "quadratic", None)
  for impl, bs in impl_blocks(4):
    _, got = jax_grads(args, ct, seg, impl, bs)
    for name, g in zip(NAMES, got):
      assert np.all(np.isfinite(g)), (impl, name)
    assert_grads_close(got[:3], want[:3], n=SHAPE["t"], msg=f"impl={impl} block={bs} vs quadratic")


def test_isolated_segments_grads_are_exact():
  # Every token its own segment: out_i = v_i. So d/dv = ct exactly and every other gradient is 0
  # (masked entries must pass neither value nor gradient, even with +-1e3 gates).
  args, ct, seg = make_inputs(8, *SHAPE.values(), "spikes", "isolated")
  for impl, bs in impl_blocks(4):
    _, g = jax_grads(args, ct, seg, impl, bs)
    assert_close(g[2], ct, dtype=np.float32, err_msg=impl)  # one key per query: no sum
    for name, x in zip(("q", "k", "field", "level"), (g[0], g[1], g[3], g[4])):
      np.testing.assert_array_equal(x, 0.0, err_msg=f"{impl}: d/d{name}")


# ----------------------------------------------------------------------------- FoX


@functools.partial(jax.jit, static_argnames=("impl", "blk", "via_fpa"))
def fox_grads(q, k, v, logf, ct, *, impl, blk, via_fpa):
  def loss(q, k, v, logf):
    if via_fpa:
      c = jnp.cumsum(logf, axis=1)
      out = ops.fpa_attention(q, k, v, c, c, impl="quadratic")
    else:
      out = ops.fox_attention(q, k, v, logf, impl=impl, block_size=blk)
    return jnp.sum(out * ct)

  return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, logf)


def test_fox_grads_match_fpa_special_case():
  rng = np.random.default_rng(10)
  b, t, h, d = 2, 11, 2, 3
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(3))
  # Strictly negative log gates: the cumsum is strictly decreasing, so min() has no ties.
  logf = jax.nn.log_sigmoid(jnp.asarray(rng.normal(size=(b, t, h)) + 1.0, jnp.float32))
  ct = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  want = [np.asarray(x) for x in fox_grads(q, k, v, logf, ct, impl=None, blk=None, via_fpa=True)]
  assert np.abs(want[3]).max() > 1e-3
  for impl, bs in impl_blocks(4):
    got = fox_grads(q, k, v, logf, ct, impl=impl, blk=bs, via_fpa=False)
    for name, g, w in zip(("q", "k", "v", "log_fgate"), got, want):
      g = np.asarray(g)
      assert np.all(np.isfinite(g))
      assert_close(g, w, n=t, err_msg=f"fox impl={impl}: d/d{name}")


# ----------------------------------------------------------------------------- large tiles


@pytest.mark.slow
@pytest.mark.parametrize(
  "seed,t,blk,gates,seg",
  [
    # Several tiles of size >= 32: diagonal tiles exercise the hand-written in-tile pullback
    # (running-min take-over rows / next-smaller spans), off-diagonal ones the (S, R, C) pullback
    # with R over more than one block in between; T not a multiple of the tile.
    (7, 100, 32, "kink_free", "sorted"),
    (8, 130, 64, "spikes", None),
    (9, 70, 16, "iid", "unsorted"),
  ],
)
def test_chunked_large_tiles_grads_match_quadratic(seed, t, blk, gates, seg):
  args, ct, seg = make_inputs(seed, 1, t, 2, 4, 3, gates, seg)
  val_q, want = jax_grads(args, ct, seg, "quadratic", None)
  val, got = jax_grads(args, ct, seg, "chunked", blk)
  assert_loss_close(val, val_q, ct, n=t)
  assert_grads_close(got, want, n=t, msg=f"chunked block={blk} vs quadratic")
  assert np.abs(got[3]).max() > 0 and np.abs(got[4]).max() > 0  # the gate gradients are exercised
