"""The in-kernel tile bias of the Pallas kernels, with its hand-written pullback, for FPA and FoX.

The per-token statistics are the bias protocol's (`ops.bias`: `bias.kernel_stats(blk, tp)`, built
outside the kernels by differentiable JAX), in this layout (Tp = T padded to a whole number of
tiles, blk the tile):
  krow [B, H, nr, Tp]  key-side stats, one row per stat: a tile reads [1, bk] rows
  qcol [B, H, Tp, nc]  query-side stats, one column per stat: a tile reads [bq, 1] columns
  r    [B, H, nb, nb]  FPA only: R[I, J], the min of the block minima strictly between I and J
Rows and columns are stored in the shape a tile broadcasts them in, so a kernel never transposes
or reshapes a vector (neither Mosaic nor Triton does that cheaply).

  FoX  krow = [c], qcol = [c] with c = cumsum(log_fgate): bias = c_i - c_j on every tile.
  FPA  krow = [level, S, N_0 .. N_{L-1}], qcol = [C, M_0 .. M_{L-1}]:
    off-diagonal tiles: the tiling identity (`first_passage.block_stats`: S, C, R, as chunked);
    diagonal tiles: the sparse table (`first_passage.window_mins`). M_k[i] = min(field over
    (i - 2^k, i]) and N_k[j] = min(field over (j, j + 2^k]); for 2^k <= i - j < 2^(k+1) the two
    windows cover (j, i] exactly, so min(field over (j, i]) = min(N_k[j], M_k[i])
    (`first_passage.table_min`): L = bit_length(blk - 1) elementwise passes over the tile instead
    of an in-kernel scan, and the pullback routes each element's cotangent to one N_k or M_k
    entry (JAX autodiff takes it from there to the field).
  Penalties are `first_passage.dip(level, min)`: level = +inf gives 0 on an empty range
  (distance 0, +inf statistics) and -inf bias (a dead key) on a finite one.
"""

from __future__ import annotations

import jax.numpy as jnp

from fpa_jax.ops.first_passage import dip, table_min

INF = float("inf")


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
  m = table_min(ns, ms, dist)  # +inf at distance 0 (and masked j > i): empty range, no penalty
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
