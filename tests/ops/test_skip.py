"""Dead-tile skipping (`skip_tolerance`) in the chunked kernel: outputs and gradients within the
bound stated in `fpa_jax.ops.chunked`, on fields where most tiles are dead and on random ones.

Two checks per case:
  * tight: chunked with skipping == the quadratic reference with the same tiles masked out
    (`chunked.dead_tiles`), fp32 round-off only. This pins down what the kernel computes;
  * bound: that masked reference (so the kernel) against the exact op, within the error the
    docstring bound allows, evaluated from the exact attention weights p (float64 numpy).
Bound (per row i, lost weight delta_i <= eps, A = max|ct| max|v| in 2-norms): the logit cotangent
moves by <= 2 A p_ij on a dropped entry and <= 4 A p_ij eps / (1 - eps) on a kept one (Bds);
dq_i, dk_j, d level_j, d field_s are sums of Bds against |scale| |k_j|, |scale| |q_i|, 1 and 1
over the entries each one touches; dv_j moves by sum_i p_ij (1 or eps / (1 - eps)) |ct_i|;
out_i by 2 eps max|v|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_close, rtol
from fpa_jax import ops
from fpa_jax.ops import chunked
from fpa_jax.ops import reference_np as ref
from fpa_jax.ops.bias import FoXBias, FPABias
from fpa_jax.ops.quadratic import masked_softmax_attention

NAMES = ("q", "k", "v", "field", "level")
B, T, H, D, BLK = 2, 64, 2, 4, 8
SCALE = 0.5


def dip_gates(rng, depth, periods=(16, 24), t=T, b=B):
  """A slow walk whose field dips by `depth` at every scope closure (every `period` tokens, one
  period per head) and recovers; level = the walk. Every key before a closure is then penalised
  by about `depth` for all later queries: for depth >> threshold most tiles are dead, and the
  two periods make a tile dead for one head and live for the other. [B, T, H] float64."""
  walk = np.cumsum(rng.normal(scale=0.2, size=(b, t, len(periods))), 1)
  closure = np.stack([np.arange(t) % p == p - 1 for p in periods], -1)[None]
  return np.where(closure, walk - depth, walk), walk + rng.normal(scale=0.2, size=walk.shape)


def unit_rows(rng, shape, norm):
  """Rows of a fixed 2-norm: makes the bound's U = |scale| norm^2 * 2 known in advance."""
  x = rng.normal(size=shape)
  return x / np.linalg.norm(x, axis=-1, keepdims=True) * norm


def f32(x):
  return jnp.asarray(x, jnp.float32)


@functools.partial(jax.jit, static_argnames=("kind", "tol"))
def grads(q, k, v, field, level, ct, seg, *, kind, tol=None):
  """((loss, out), d loss / d (q, k, v, field, level)), loss = sum(out * ct), for one formulation:
  "chunked" (tol = skip_tolerance), "exact" (quadratic), "masked" (quadratic minus dead tiles)."""

  def loss(q, k, v, field, level):
    if kind == "chunked":
      out = ops.fpa_attention(q, k, v, field, level, scale=SCALE, segment_ids=seg, block_size=BLK, skip_tolerance=tol)
    else:
      bias = -ops.first_passage_penalty(jnp.swapaxes(field, 1, 2), jnp.swapaxes(level, 1, 2))
      if kind == "masked":
        dead = chunked.dead_tiles(q, k, FPABias(field, level), skip_tolerance=tol, scale=SCALE, block_size=BLK)
        dead = jnp.repeat(jnp.repeat(dead, BLK, -2), BLK, -1)[..., : q.shape[1], : q.shape[1]]
        bias = jnp.where(dead, chunked.NEG, bias)
      out = masked_softmax_attention(q, k, v, bias, scale=SCALE, segment_ids=seg)
    return jnp.sum(out * ct), out

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, field, level)


def weights_np(q, k, field, level, scale):
  """Exact attention weights p [B, H, T, T] (float64, no segments)."""
  b, t, h, _ = q.shape
  p = np.zeros((b, h, t, t))
  for bb in range(b):
    for hh in range(h):
      s = scale * q[bb, :, hh] @ k[bb, :, hh].T - ref.penalty_np(field[bb, :, hh], level[bb, :, hh])
      s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
      e = np.exp(s - s.max(-1, keepdims=True))
      p[bb, hh] = e / e.sum(-1, keepdims=True)
  return p


def grad_bounds(args, ct, p, dead, eps, scale):
  """Per-element bounds on |skipped - exact| for (out, dq, dk, dv, dfield, dlevel), float64."""
  q, k, v, _, _ = args
  t = q.shape[1]
  norm = lambda x: np.linalg.norm(x, axis=-1)  # [B, T, H]
  a = norm(ct).max() * norm(v).max()
  kept = eps / (1 - eps)
  bds = 2 * a * p * np.where(dead, 1.0, 2 * kept)  # [B, H, T(i), T(j)]
  bth = lambda x: np.swapaxes(x, 1, 2)[..., None]  # [B, H, T] -> [B, T, H, 1]
  dq = abs(scale) * bth(np.einsum("bhij,bjh->bhi", bds, norm(k)))
  dk = abs(scale) * bth(np.einsum("bhij,bih->bhj", bds, norm(q)))
  dv = bth(np.einsum("bhij,bih->bhj", p * np.where(dead, 1.0, kept), norm(ct)))
  dlevel = np.swapaxes(bds.sum(-2), 1, 2)
  # field_s enters the penalties (i, j) with j < s <= i.
  ii, jj = np.arange(t)[:, None], np.arange(t)[None, :]
  dfield = np.swapaxes(np.stack([(bds * ((jj < s) & (s <= ii))).sum((-2, -1)) for s in range(t)], -1), 1, 2)
  out = 2 * eps * np.abs(v).max((1,), keepdims=True)  # [B, 1, H, Kv]
  return out, [dq, dk, dv, dfield, dlevel]


def check_case(args, ct, eps, seg=None, min_dead=0.0, min_moved=0.0):
  """Runs both checks; returns the fraction of (batch, head) off-diagonal tiles dropped."""
  ja = [f32(x) for x in args]
  segj = None if seg is None else jnp.asarray(seg)
  fb = FPABias(ja[3], ja[4])
  frac, frac_all = chunked.skipped_tile_fraction(ja[0], ja[1], fb, skip_tolerance=eps, scale=SCALE, block_size=BLK)
  assert frac >= min_dead and 0.0 <= frac_all <= frac
  (val, out), got = grads(*ja, f32(ct), segj, kind="chunked", tol=eps)
  (mval, mout), masked = grads(*ja, f32(ct), segj, kind="masked", tol=eps)
  # chunked-with-skips and masked quadratic: one function, two programs (fp32 rounding over T keys);
  # `tol` is that rounding as slack on the bounds below.
  tol = lambda w: rtol(np.float32, T) * float(np.abs(w).max())
  assert_close(val, mval, dtype=np.float32, n=T, scale=max(abs(float(mval)), np.sqrt(np.size(ct))))
  assert_close(out, mout, n=T, err_msg="tight: out")
  for name, g, w in zip(NAMES, got, masked):
    assert_close(g, w, n=T, err_msg=f"tight: d/d{name}")
  if seg is not None:
    return frac
  # Bound against the exact op (no segments: the weights p below ignore them).
  (_, exact_out), exact = grads(*ja, f32(ct), None, kind="exact")
  p = weights_np(*args[:2], *args[3:], SCALE)
  dead = np.asarray(chunked.dead_tiles(ja[0], ja[1], fb, skip_tolerance=eps, scale=SCALE, block_size=BLK))
  dead = np.repeat(np.repeat(dead, BLK, -2), BLK, -1)[..., :T, :T]
  lost = (p * dead).sum(-1)
  assert lost.max() <= eps, "the bound promises each row loses at most eps of its weight"
  out_b, g_b = grad_bounds(args, ct, p, dead, eps, SCALE)
  moved = np.abs(np.asarray(out) - np.asarray(exact_out))
  assert np.all(moved <= out_b + tol(exact_out)), "output outside the 2 eps max|v| bound"
  assert moved.max() >= min_moved, "skipping should change the output measurably in this case"
  for name, g, w, bnd in zip(NAMES, got, exact, g_b):
    err = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    assert np.all(err <= bnd + tol(w)), (name, float((err - bnd).max()))
  return frac


def inputs(seed, gates, qk_norm=None):
  rng = np.random.default_rng(seed)
  if qk_norm is None:
    q, k = (rng.normal(size=(B, T, H, D)) for _ in range(2))
  else:
    q, k = (unit_rows(rng, (B, T, H, D), qk_norm) for _ in range(2))
  v, ct = (rng.normal(size=(B, T, H, D)) for _ in range(2))
  field, level = gates(rng)
  args = [np.asarray(np.float32(x), np.float64) for x in (q, k, v, field, level)]
  return args, np.asarray(np.float32(ct), np.float64)


def test_mostly_dead_tiles_are_skipped_within_bound():
  # Dips of 60 against a threshold of about |scale| |q| 2|k| + log T - log eps ~ 4 + 4.2 + 6.9.
  args, ct = inputs(0, lambda rng: dip_gates(rng, 60.0), qk_norm=2.0)
  check_case(args, ct, 1e-3, min_dead=0.5)  # 0.61 of the (batch, head) tiles


@pytest.mark.slow
def test_near_threshold_dips_move_the_output_within_bound():
  # Dips close to the threshold with a loose eps: dropped weights are large enough to see, so the
  # bound is checked where it has to hold, not where everything dropped is ~exp(-50).
  eps = 0.2
  threshold = SCALE * 2.0 * 2 * 2.0 + np.log(T) - np.log(eps)
  args, ct = inputs(1, lambda rng: dip_gates(rng, threshold + 1.0), qk_norm=2.0)
  check_case(args, ct, eps, min_dead=0.2, min_moved=1e-4)


@pytest.mark.slow  # test_mostly_dead_tiles_are_skipped_within_bound
def test_random_fields_within_bound():
  # iid fields and levels of scale 30: scattered dead tiles (0.24 per head), never the same for
  # every head, so each one runs with some heads masked.
  args, ct = inputs(2, lambda rng: (rng.normal(size=(B, T, H)) * 30, rng.normal(size=(B, T, H)) * 30), qk_norm=2.0)
  check_case(args, ct, 1e-2, min_dead=0.1)
  # A plain walk dips far less: nothing dropped, and the result is the exact kernel's (to round-off).
  args, ct = inputs(3, lambda rng: (np.cumsum(rng.normal(size=(B, T, H)), 1),) * 2)
  assert check_case(args, ct, 1e-3) == 0.0


@pytest.mark.slow
def test_segments_and_padding():
  # T not a multiple of the tile (padded last block) and packed segments: tight check only.
  rng = np.random.default_rng(4)
  args, ct = inputs(4, lambda rng: dip_gates(rng, 60.0), qk_norm=2.0)
  t = 61
  args, ct = [x[:, :t] for x in args], ct[:, :t]
  seg = np.sort(rng.integers(0, 3, size=(B, t)), 1).astype(np.int32)
  assert check_case(args, ct, 1e-3, seg=seg) >= 0.5


# ----------------------------------------------------------------------------- FoX


@functools.partial(jax.jit, static_argnames=("kind", "tol"))
def fox_grads(q, k, v, logf, ct, *, kind, tol=None):
  """(out, d loss / d (q, k, v, log_fgate)): "chunked" FoX, or the exact / masked FPA special case."""

  def loss(q, k, v, logf):
    if kind == "chunked":
      out = ops.fox_attention(q, k, v, logf, scale=SCALE, block_size=BLK, skip_tolerance=tol)
    else:
      c = jnp.cumsum(logf, 1)
      bias = -ops.first_passage_penalty(jnp.swapaxes(c, 1, 2), jnp.swapaxes(c, 1, 2))
      if kind == "masked":
        dead = chunked.dead_tiles(q, k, FoXBias(c), skip_tolerance=tol, scale=SCALE, block_size=BLK)
        bias = jnp.where(jnp.repeat(jnp.repeat(dead, BLK, -2), BLK, -1), chunked.NEG, bias)
      out = masked_softmax_attention(q, k, v, bias, scale=SCALE)
    return jnp.sum(out * ct), out

  return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, logf)[::-1]


@pytest.mark.slow  # test_mostly_dead_tiles_are_skipped_within_bound
def test_fox_skipping_within_bound():
  # Slow forgetting with hard resets (log f = -40) every 16 tokens: keys before a reset are dead.
  rng = np.random.default_rng(5)
  q, k = (unit_rows(rng, (B, T, H, D), 2.0) for _ in range(2))
  v, ct = (rng.normal(size=(B, T, H, D)) for _ in range(2))
  logf = np.asarray(jax.nn.log_sigmoid(rng.normal(size=(B, T, H)) + 4.0), np.float64)
  logf = np.where((np.arange(T) % 16 == 15)[None, :, None], -40.0, logf)
  q, k, v, logf, ct = (np.asarray(np.float32(x), np.float64) for x in (q, k, v, logf, ct))
  eps = 1e-3
  c = np.cumsum(logf, 1)
  fb = FoXBias(jnp.cumsum(f32(logf), 1))  # the kernel's own fp32 cumsum: the same tiles
  frac, _ = chunked.skipped_tile_fraction(f32(q), f32(k), fb, skip_tolerance=eps, scale=SCALE, block_size=BLK)
  assert frac >= 0.6
  # Same bound as FPA with field = level = c (penalty c_j - c_i).
  out, got = fox_grads(*map(f32, (q, k, v, logf, ct)), kind="chunked", tol=eps)
  mout, masked = fox_grads(*map(f32, (q, k, v, logf, ct)), kind="masked", tol=eps)
  exact_out, want = fox_grads(*map(f32, (q, k, v, logf, ct)), kind="exact")
  for name, g, w in zip(("out", "q", "k", "v", "log_fgate"), (out, *got), (mout, *masked)):
    assert_close(g, w, n=T, err_msg=f"tight: {name}")
  p = weights_np(q, k, c, c, SCALE)
  dead = np.asarray(chunked.dead_tiles(f32(q), f32(k), fb, skip_tolerance=eps, scale=SCALE, block_size=BLK))
  dead = np.repeat(np.repeat(dead, BLK, -2), BLK, -1)
  assert (p * dead).sum(-1).max() <= eps
  out_b, (bq, bk, bv, bfield, blevel) = grad_bounds([q, k, v, c, c], ct, p, dead, eps, SCALE)
  assert np.all(
    np.abs(np.asarray(out) - np.asarray(exact_out)) <= out_b + rtol(np.float32, T) * np.abs(exact_out).max()
  )
  # c_t is the field and the level at once, so d c_t moves by <= the sum of both bounds, and
  # d log f_s = sum_{t >= s} d c_t.
  blogf = np.flip(np.cumsum(np.flip(bfield + blevel, 1), 1), 1)
  for name, g, w, bnd in zip(("q", "k", "v", "log_fgate"), got, want, (bq, bk, bv, blogf)):
    err = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
    assert np.all(err <= bnd + rtol(np.float32, T) * float(np.abs(w).max())), name


# ----------------------------------------------------------------------------- API


def small():
  rng = np.random.default_rng(6)
  q, k, v = (f32(rng.normal(size=(1, 20, 2, 4))) for _ in range(3))
  field, level = (f32(rng.normal(size=(1, 20, 2))) for _ in range(2))
  return q, k, v, field, level


def test_none_is_the_exact_kernel():
  """skip_tolerance=None is the default: the same program (equal jaxprs, forward and backward, so
  equal bits without compiling either), and it carries no cond at all; skipping branches per tile."""
  q, k, v, field, level = small()
  fwd = lambda **kw: lambda q, k, f_, l: ops.fpa_attention(q, k, v, f_, l, block_size=8, **kw)
  jaxpr = lambda fn: str(jax.make_jaxpr(fn)(q, k, field, level))
  bwd = lambda **kw: jax.grad(lambda *a: jnp.sum(fwd(**kw)(*a)), argnums=(0, 1, 2, 3))
  assert jaxpr(fwd(skip_tolerance=None)) == jaxpr(fwd())
  assert jaxpr(bwd(skip_tolerance=None)) == jaxpr(bwd())
  assert "cond[" not in jaxpr(fwd(skip_tolerance=None)) and "cond[" not in jaxpr(bwd(skip_tolerance=None))
  assert "cond[" in jaxpr(fwd(skip_tolerance=1e-3))
  lf = -jnp.abs(field)
  fox = lambda **kw: str(jax.make_jaxpr(lambda q: ops.fox_attention(q, k, v, lf, block_size=8, **kw))(q))
  assert fox(skip_tolerance=None) == fox() and "cond[" not in fox()
  # ... and it runs: one evaluation against the quadratic reference
  assert_close(fwd()(q, k, field, level), ops.fpa_attention(q, k, v, field, level, impl="quadratic"), n=20)


@pytest.mark.parametrize("bad", [-0.1, 0.0, 1.0, 1.5, float("nan"), 1, True, "0.1", np.float32(0.1), jnp.asarray(0.1)])
def test_bad_skip_tolerance_raises(bad):
  q, k, v, field, level = small()
  with pytest.raises(ValueError, match="skip_tolerance"):
    ops.fpa_attention(q, k, v, field, level, skip_tolerance=bad)
  with pytest.raises(ValueError, match="skip_tolerance"):
    ops.fox_attention(q, k, v, -jnp.abs(field), skip_tolerance=bad)
  # Checked in Python before anything is traced, also under jit.
  with pytest.raises(ValueError, match="skip_tolerance"):
    jax.jit(lambda q: ops.fpa_attention(q, k, v, field, level, skip_tolerance=bad))(q)


@pytest.mark.parametrize("impl", ["quadratic", "recurrent"])
def test_skip_tolerance_is_for_the_tiled_kernels_only(impl):
  q, k, v, field, level = small()
  with pytest.raises(ValueError, match="impl='chunked'"):
    ops.fpa_attention(q, k, v, field, level, impl=impl, skip_tolerance=1e-3)
  with pytest.raises(ValueError, match="impl='chunked'"):
    ops.fox_attention(q, k, v, -jnp.abs(field), impl=impl, skip_tolerance=1e-3)
