"""Gate biases for the Pallas kernels: per-token stat vectors (built outside, differentiable JAX)
and the in-kernel tile bias with its hand-written pullback, shared by FPA and FoX.

Stat layouts (Tp = T padded to a whole number of tiles, blk the tile):
  krow [B, H, nr, Tp]  key-side stats, one row per stat: a tile reads [1, bk] rows
  qcol [B, H, Tp, nc]  query-side stats, one column per stat: a tile reads [bq, 1] columns
  r    [B, H, nb, nb]  FPA only: R[I, J], the min of the block minima strictly between I and J
Rows and columns are stored in the shape a tile broadcasts them in, so a kernel never transposes
or reshapes a vector (neither Mosaic nor Triton does that cheaply).

  FoX  krow = [c], qcol = [c] with c = cumsum(log_fgate): bias = c_i - c_j on every tile.
  FPA  krow = [level, S, N_0 .. N_{L-1}], qcol = [C, M_0 .. M_{L-1}]:
    off-diagonal tiles: the tiling identity of `fpa_jax.ops.chunked` with S, C, R (same stats);
    diagonal tiles: a sparse table. M_k[i] = min(field over (i - 2^k, i]) and
    N_k[j] = min(field over (j, j + 2^k]); for 2^k <= i - j < 2^(k+1) the two windows cover
    (j, i] exactly, so min(field over (j, i]) = min(N_k[j], M_k[i]): L = bit_length(blk - 1)
    elementwise passes over the tile instead of an in-kernel scan, and the pullback routes each
    element's cotangent to one N_k or M_k entry (JAX autodiff takes it from there to the field).
  Penalties are `common.dip(level, min)`, as in `fpa_jax.ops.chunked`: level = +inf gives 0 on
  an empty range (distance 0, +inf statistics) and -inf bias (a dead key) on a finite one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fpa_jax.ops.common import F32, dip

INF = float("inf")


def _min_scan(x, axis, reverse=False):
  return jax.lax.associative_scan(jnp.minimum, x, axis=axis % x.ndim, reverse=reverse)


def _block_stats(phi):
  """phi [B, H, nb, blk] -> S (min after j in its block), C (min up to i in its block), both
  [B, H, nb, blk], and R [B, H, nb, nb] (R[I, J]: min of the block minima strictly between)."""
  nb = phi.shape[-2]
  inf = jnp.full(phi.shape[:-1] + (1,), INF, F32)
  suffix = jnp.concatenate([_min_scan(phi, -1, reverse=True)[..., 1:], inf], -1)
  prefix = _min_scan(phi, -1)
  bmin = phi.min(-1)
  ib = jnp.arange(nb)
  # p[I, J] = min(bmin over (J, I]) for I > J; R[I, J] = p[I - 1, J].
  p = _min_scan(jnp.where(ib[:, None] > ib[None, :], bmin[..., :, None], INF), -2)
  r = jnp.concatenate([jnp.full(p.shape[:-2] + (1, nb), INF, F32), p[..., :-1, :]], -2)
  return suffix, prefix, r


def n_levels(blk: int) -> int:
  """Sparse-table levels for in-tile distances 1 .. blk - 1."""
  return (blk - 1).bit_length()


def _pad_bht(x, tp):
  """[B, T, H] -> [B, H, Tp] fp32, zero-padded at the end (padding is never inside a real range)."""
  x = jnp.swapaxes(x.astype(F32), 1, 2)
  return jnp.pad(x, [(0, 0), (0, 0), (0, tp - x.shape[-1])])


def _shift(x, n):
  """x[..., t + n] along the last axis (n > 0: look ahead, n < 0: look back), +inf outside."""
  t = x.shape[-1]
  if abs(n) >= t:
    return jnp.full_like(x, INF)
  fill = jnp.full(x.shape[:-1] + (abs(n),), INF, x.dtype)
  return jnp.concatenate([x[..., n:], fill], -1) if n > 0 else jnp.concatenate([fill, x[..., :n]], -1)


def fpa_stats(field, level, blk, tp):
  """field, level [B, T, H] -> (krow [B, H, 2 + L, Tp], qcol [B, H, Tp, 1 + L], r [B, H, nb, nb])."""
  phi, lvl = _pad_bht(field, tp), _pad_bht(level, tp)
  b, h, _ = phi.shape
  nb = tp // blk
  suffix, prefix, r = _block_stats(phi.reshape(b, h, nb, blk))
  ms, ns = [], []
  m, n = phi, _shift(phi, 1)  # windows (i - 1, i] and (j, j + 1]
  for k in range(n_levels(blk)):
    ms.append(m)
    ns.append(n)
    m, n = jnp.minimum(m, _shift(m, -(2**k))), jnp.minimum(n, _shift(n, 2**k))  # disjoint halves: no ties
  krow = jnp.stack([lvl, suffix.reshape(b, h, tp)] + ns, 2)
  qcol = jnp.stack([prefix.reshape(b, h, tp)] + ms, -1)
  return krow, qcol, r


def fox_stats(c, tp):
  """c = cumsum(log_fgate) [B, T, H] -> (krow [B, H, 1, Tp], qcol [B, H, Tp, 1], None)."""
  c = _pad_bht(c, tp)
  return c[:, :, None, :], c[..., None], None


def tile_bias(kind, n_lv, kvec, qvec, r, dist):
  """One tile's bias [bq, bk] and its pullback.

  kvec(n) -> [1, bk] key stat row n; qvec(n) -> [bq, 1] query stat column n (module docstring);
  r: [1, 1] R[I, J] (FPA, off-diagonal tiles); dist: [bq, bk] int32 i - j on a diagonal tile,
  None off it. pull(ds, side) with ds = d loss / d bias [bq, bk] returns {row n: [1, bk]} and the
  [1, 1] cotangent of r (side "key"), or {column n: [bq, 1]} (side "query"). Subgradients at ties
  (measure zero for continuous gates): the key side wins (S over R, A_j over C_i, N_k over M_k).
  """
  if kind == "fox":
    c_k, c_q = kvec(0), qvec(0)

    def pull_fox(g, side):
      return ({0: -g.sum(0, keepdims=True)}, None) if side == "key" else {0: g.sum(1, keepdims=True)}

    return c_q - c_k, pull_fox

  lvl = kvec(0)
  if dist is None:
    suf, pre = kvec(1), qvec(0)
    a = jnp.minimum(suf, r)
    # -dip(level_j, min(A_j, C_i)) with A_j = min(S_j, R): no inf - inf for level = +inf.
    bias = -dip(lvl, jnp.minimum(a, pre))

    def pull_off(g, side):
      g_c = jnp.where(pre < jnp.minimum(a, lvl), g, 0.0)  # penalty level_j - C_i
      if side == "query":
        return {0: g_c.sum(1, keepdims=True)}
      # penalty level_j - A_j where C_i >= A_j and level_j > A_j; key-only condition after the sum
      d_a = jnp.where(lvl > a, jnp.where(pre >= a, g, 0.0).sum(0, keepdims=True), 0.0)
      to_s = suf <= r
      return (
        {0: -(d_a + g_c.sum(0, keepdims=True)), 1: jnp.where(to_s, d_a, 0.0)},
        jnp.where(to_s, 0.0, d_a).sum(1, keepdims=True),
      )

    return bias, pull_off

  ns = [kvec(2 + k) for k in range(n_lv)]
  ms = [qvec(1 + k) for k in range(n_lv)]
  m = jnp.full(dist.shape, INF, F32)  # distance 0 (and masked j > i): empty range, no penalty
  for k in range(n_lv):  # ascending: the last level with 2^k <= i - j wins
    m = jnp.where(dist >= 2**k, jnp.minimum(ns[k], ms[k]), m)
  bias = -dip(lvl, m)  # 0 at distance 0 (m = +inf) for every level, +inf included

  def pull_diag(g, side):
    g = jnp.where(lvl > m, g, 0.0)  # bias = m - level where the penalty is active
    out = {0: -g.sum(0, keepdims=True)} if side == "key" else {}
    for k in range(n_lv):
      band = (dist >= 2**k) & (dist < 2 ** (k + 1))
      to_n = ns[k] <= ms[k]
      if side == "key":
        out[2 + k] = jnp.where(band & to_n, g, 0.0).sum(0, keepdims=True)
      else:
        out[1 + k] = jnp.where(band & ~to_n, g, 0.0).sum(1, keepdims=True)
    return (out, None) if side == "key" else out

  return bias, pull_diag
