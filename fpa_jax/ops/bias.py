"""The bias protocol: what a tiled kernel reads of FPA or FoX to bias its logits (pure JAX).

One object per call, over per-token gates [B, T, KVH] (one bias per kv head, shared by its group):

    FPABias(field, level)  bias -dip(level_j, min field over (j, i])   (`first_passage`)
    FoXBias(c)             bias c_i - c_j, c = cumsum(log_fgate)

Three kernels read it, each through the same few methods:

  chunked (`ops.chunked`)    stats(nb, blk) -> (kst, qst, pst): key-side and query-side tuples of
                             [B, H, nb, ...] per-block statistics and block-pair ones [B, H, nb, nb];
                             off_bias(kst_J, qst_I, pst_IJ) / diag_bias(kst_I, qst_I) -> a tile's
                             bias [B, H, blk, blk]; tile_floor(kst, qst, pst) -> [B, H, nb, nb], a
                             lower bound on every penalty of a tile (the skip bound).
  sparse keys (`ops.sparse`) block_keys(kst, pst, i) -> what query block i reads of every key;
                             key_floor(keys, qst_i) -> [B, H, Tp] its penalty bound per key;
                             key_bias(gathered keys, qst_i) -> [B, H, blk, C].
  Pallas (`ops.pallas`)      kind ("fpa" / "fox") and kernel_stats(blk, tp): the same statistics as
                             per-token rows / columns; the in-kernel tile bias is
                             `ops.pallas.tile_bias`.

FPA's statistics are the tiling identity of `first_passage.block_stats`: off a diagonal tile
min field over (j, i] = min(S_j, R[I, J], C_i), a few elementwise passes over the tile. A
diagonal tile runs the in-tile column scan (`first_passage.column_min`) or, for n >= 2 * DIAG_SUB
tokens, applies the identity once more to its sub-tiles of DIAG_SUB tokens, from sub-tile
statistics computed for every tile at once outside the tile loop, and scans only its diagonal
sub-tiles: O(block^2) elementwise work rather than O(block^2 log block).

Gradients. The statistics are computed by plain differentiable JAX outside the kernels, which
treat them as inputs: a tile's bias pulls the logit cotangent back to (S, C, R, level) or, on the
diagonal, to level and the field (small tiles) or the sub-tile statistics, and autodiff carries
them through the min-scans to the field. The tile biases carry hand-written pullbacks
(`_fpa_bias`, `_diag_bias`, `_diag_bias_sub`, `_column_min_stat`): autodiff of min / dip and of
the scan was the chunked backward pass's bottleneck.

Infinite levels. Every FPA bias is -dip(level_j, min field), so level = +inf against an empty
range or a +inf statistic (S_j, R, the above-diagonal parts of a diagonal tile) gives 0, not
inf - inf, and against a finite one -inf: a dead key whose weight exp(-inf - m) is exactly 0 (m is
finite: the diagonal entry is always live). The pullbacks route cotangents by compares only (no
product with a statistic), so its ds = 0 and every gradient stays finite; for the skip bounds its
floor is +inf.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from fpa_jax.ops.common import F32
from fpa_jax.ops.first_passage import block_stats, column_min, dip, n_levels, window_mins


def blocks(x, nb, blk):
  """Per-token gate stats: [B, T, H] -> [B, H, nb, blk] (zero-padded along T)."""
  t = x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, nb * blk - t)] + [(0, 0)] * (x.ndim - 2))
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(x.shape[:2] + (nb, blk) + x.shape[3:])


@jax.custom_vjp
def _fpa_bias(lvl, suffix, prefix, r):
  """-relu(level_j - min(S_j, R, C_i)) on an off-diagonal tile.

  lvl, suffix: [B, H, 1, bk] (keys); prefix: [B, H, bq, 1] (queries); r: [B, H, 1, 1] (the tile's
  R[I, J]) -> [B, H, bq, bk]. With A_j = min(S_j, R) (key-only) the bias is
  -dip(level_j, min(A_j, C_i)): a few elementwise passes, fused into the logits. `dip`, not relu of
  the difference, so that level = +inf meets A_j = +inf (no field value after j in J or between)
  without an inf - inf: the bias is then -inf through C_i (a dead key, weight exactly 0).
  """
  return -dip(lvl, jnp.minimum(jnp.minimum(suffix, r), prefix))


def _fpa_bias_fwd(lvl, suffix, prefix, r):
  return _fpa_bias(lvl, suffix, prefix, r), (lvl, suffix, prefix, r)


def _fpa_bias_bwd(res, g):
  # Hand-written pullback: autodiff of min/relu evaluates tie-splitting selects on every tile
  # element, which made this the backward pass's bottleneck. Here: one compare per element per
  # route, key-only conditions applied after the column sums. Subgradient at ties: the key side
  # A_j wins over C_i, and S_j over R (any choice is valid; ties have measure zero for
  # continuous fields).
  lvl, suffix, prefix, r = res
  a = jnp.minimum(suffix, r)
  # The penalty is level_j - C_i where C_i < min(A_j, level_j) (g_c) ...
  g_c = jnp.where(prefix < jnp.minimum(a, lvl), g, 0.0)
  col, col_c = g.sum(-2, keepdims=True), g_c.sum(-2, keepdims=True)
  # ... else level_j - A_j where level_j > A_j, on the rows C_i >= A_j: the complement of g_c's
  # rows there, so one masked tile pass serves both routes.
  active = lvl > a
  d_a = jnp.where(active, col - col_c, 0.0)
  to_s = suffix <= r
  return (
    -jnp.where(active, col, col_c),
    jnp.where(to_s, d_a, 0.0),
    g_c.sum(-1, keepdims=True),
    jnp.where(to_s, 0.0, d_a).sum(-1, keepdims=True),
  )


_fpa_bias.defvjp(_fpa_bias_fwd, _fpa_bias_bwd)


@jax.custom_vjp
def _diag_bias(lvl, phi):
  """Exact in-tile first-passage bias: [..., n] level, field -> [..., n, n] (query i, key j)."""
  return -dip(lvl[..., None, :], column_min(phi))


def _diag_bias_fwd(lvl, phi):
  m = column_min(phi)
  # The pullback runs in the same tile iteration of the backward loop, so keeping the tile-sized
  # m costs no extra peak memory and saves re-running the scan.
  return -dip(lvl[..., None, :], m), (lvl, phi, m)


def _nse_pse(phi):
  """Next strictly smaller / previous smaller-or-equal position of each phi_s, [..., n] -> two
  [..., n] int (n / -1 where there is none).

  Binary lifting over window minima, O(n log n) on vectors (the all-pairs compare was two
  tile-sized passes): from s + 1 jump 2^k ahead while the window jumped over holds nothing
  below phi_s, largest k first; likewise backwards.
  """
  n = phi.shape[-1]
  inf = lambda w: jnp.full(phi.shape[:-1] + (w,), jnp.inf, phi.dtype)
  ahead, behind = [phi], [phi]  # [k][t]: min of phi over [t, t + 2^k) / (t - 2^k, t]
  while 2 ** len(ahead) <= n:
    w = 2 ** (len(ahead) - 1)
    ahead.append(jnp.minimum(ahead[-1], jnp.concatenate([ahead[-1][..., w:], inf(w)], -1)))
    behind.append(jnp.minimum(behind[-1], jnp.concatenate([inf(w), behind[-1][..., :-w]], -1)))
  at = lambda table, pos: jnp.take_along_axis(table, jnp.clip(pos, 0, n - 1), -1)
  idx = jnp.arange(n)
  nse, pse = jnp.broadcast_to(idx + 1, phi.shape), jnp.broadcast_to(idx - 1, phi.shape)
  for k in reversed(range(len(ahead))):
    w = 2**k
    nse = jnp.where((nse + w <= n) & (at(ahead[k], nse) >= phi), nse + w, nse)
    pse = jnp.where((pse - w >= -1) & (at(behind[k], pse) > phi), pse - w, pse)
  return nse, pse


def _colmin_pullback(phi, dm):
  """Cotangent of phi [..., n] from dm [..., n, n], the cotangent of `column_min(phi)`.

  Autodiff through the associative scan costs ~100 tile-sized passes; this is a handful.
  Column j's running min is phi_s exactly for rows s <= i < nse(s) (the next *strictly* smaller
  field value after s) and keys pse(s) <= j < s (pse: the last earlier position with field <=
  phi_s; ties go to the earliest position, a valid subgradient), so
    d phi_s = sum_{j = pse(s)}^{s-1} sum_{i = s}^{nse(s) - 1} dm[i, j]
  a difference of column prefix sums.
  """
  n = phi.shape[-1]
  idx = jnp.arange(n)
  nse, pse = _nse_pse(phi)
  cum = jax.lax.associative_scan(jnp.add, dm, axis=dm.ndim - 2)  # 2x faster than jnp.cumsum on CPU
  end = jnp.take_along_axis(cum, jnp.broadcast_to((nse - 1)[..., :, None], cum.shape), axis=-2)
  rows = end - cum + dm  # [s, j] = sum_{i = s}^{nse(s) - 1} dm[i, j]
  took = (idx[None, :] < idx[:, None]) & (idx[None, :] >= pse[..., :, None])  # [s, j]
  return jnp.where(took, rows, 0.0).sum(-1)


def _diag_bias_bwd(res, g):
  lvl, phi, m = res
  dm = jnp.where(lvl[..., None, :] > m, g, 0.0)  # bias = m - level where the penalty is active
  return -dm.sum(-2), _colmin_pullback(phi, dm)


_diag_bias.defvjp(_diag_bias_fwd, _diag_bias_bwd)


@jax.custom_vjp
def _column_min_stat(phi):
  """`first_passage.column_min` with the hand-written pullback: [..., n] -> [..., n, n]."""
  return column_min(phi)


_column_min_stat.defvjp(lambda phi: (column_min(phi), phi), lambda phi, dm: (_colmin_pullback(phi, dm),))

# Sub-tile size of large diagonal tiles. The in-tile scan costs O(n^2 log n) per tile and, inside
# the tile loop, XLA fuses its last levels into the tile-sized loops (re-evaluated per element);
# so a diagonal tile of n >= 2 * DIAG_SUB tokens applies the tiling identity once more inside
# itself, from sub-tile statistics computed for all tiles at once *outside* the loop, and scans
# only its diagonal sub-tiles.
DIAG_SUB = 64


def _diag_sub(n):
  """The sub-tile used for an n-token diagonal tile, or None (plain in-tile scan)."""
  return DIAG_SUB if n >= 2 * DIAG_SUB and n % DIAG_SUB == 0 else None


def _sub_stats(phi, sub):
  """Statistics of the diagonal tiles' sub-tiles, phi [..., nb, blk] -> (a [..., nb, ns, blk],
  c [..., nb, ns, sub], phi [..., nb, ns, sub]), ns = blk / sub: O(T * ns) memory.

  In a diagonal tile, row i of query sub-tile I' sees key j of an earlier sub-tile J' < I' at
  min(a[I', j], c[I', i]), a = min(S'_j, R'[I', J']) (the key side and the sub-tiles between),
  c = C'_i; on a diagonal sub-tile it sees the in-sub-tile column min, which `_diag_bias_tiled`
  scans per tile (precomputed for all tiles it would cost O(T * sub) memory).
  """
  lead, blk = phi.shape[:-1], phi.shape[-1]
  ps = phi.reshape(lead + (blk // sub, sub))
  suffix, prefix, r = block_stats(ps)
  a = jnp.minimum(suffix[..., None, :, :], r[..., :, :, None]).reshape(lead + (blk // sub, blk))
  return a, prefix, ps


def _diag_bias_tiled(lvl, a, c, ps):
  """A diagonal tile's bias [..., n, n] from `_sub_stats` of that tile; lvl [..., n]."""
  return _diag_bias_sub(lvl, a, c, _column_min_stat(ps))


def _set_diag_blocks(x, tiles):
  """x [..., n, n] with its diagonal sub x sub blocks replaced by tiles [..., ns, sub, sub].

  Static in-place slice updates: a select against a block-diagonal broadcast of `tiles` is
  ~7x slower on XLA:CPU than the min it would wrap."""
  sub = tiles.shape[-1]
  for i in range(tiles.shape[-3]):
    x = x.at[..., i * sub : (i + 1) * sub, i * sub : (i + 1) * sub].set(tiles[..., i, :, :])
  return x


def _sub_min(a, c, d):
  """The diagonal tile's column min [..., n, n] from `_sub_stats` of that tile."""
  n = a.shape[-1]
  off = jnp.minimum(a[..., :, None, :], c[..., :, :, None]).reshape(a.shape[:-2] + (n, n))
  return _set_diag_blocks(off, d)


@jax.custom_vjp
def _diag_bias_sub(lvl, a, c, d):
  """Exact first-passage bias of a diagonal tile from its sub-tile statistics: lvl [..., n] ->
  [..., n, n]. Sub-tiles above the diagonal hold finite values that the causal mask drops."""
  return -dip(lvl[..., None, :], _sub_min(a, c, d))


def _diag_bias_sub_fwd(lvl, a, c, d):
  m = _sub_min(a, c, d)
  return -dip(lvl[..., None, :], m), (lvl, a, c, m)


def _diag_bias_sub_bwd(res, g):
  # Route each active penalty's cotangent to the statistic that set the min: d on the diagonal
  # sub-tiles, else a (key side, wins ties) or c. Three reductions over the tile, no scan; the
  # diagonal sub-tiles are masked out of a's and c's by an iota compare (cheap in the fused
  # reductions, unlike a copy of the tile with those blocks zeroed).
  lvl, a, c, m = res
  ns, sub = c.shape[-2:]
  n = a.shape[-1]
  dm = jnp.where(lvl[..., None, :] > m, g, 0.0).reshape(c.shape + (n,))  # [..., I', i, j]
  off = (jnp.arange(n) // sub)[None, None, :] != jnp.arange(ns)[:, None, None]  # key j outside sub-tile I'
  to_a = a[..., :, None, :] <= c[..., :, :, None]
  d_a = jnp.where(to_a & off, dm, 0.0).sum(-2)
  d_c = jnp.where(~to_a & off, dm, 0.0).sum(-1)
  d_d = jnp.stack([dm[..., i, :, i * sub : (i + 1) * sub] for i in range(ns)], -3)
  return -dm.sum((-3, -2)), d_a, d_c, d_d


_diag_bias_sub.defvjp(_diag_bias_sub_fwd, _diag_bias_sub_bwd)


@jax.custom_vjp
def _key_low(suffix, r):
  """min(S_j, R[I, J]) of every key for one query block (same shapes), with `_fpa_bias`'s
  subgradient at ties (S_j wins over R)."""
  return jnp.minimum(suffix, r)


def _key_low_bwd(res, g):
  suffix, r = res
  to_s = suffix <= r
  return jnp.where(to_s, g, 0.0), jnp.where(to_s, 0.0, g)


_key_low.defvjp(lambda s, r: (jnp.minimum(s, r), (s, r)), _key_low_bwd)


Kind = Literal["fpa", "fox"]  # the bias of a call, as the Pallas kernels branch on it


def _flat(x):
  """[B, H, nb, blk] -> [B, H, nb * blk]: the padded sequence."""
  return x.reshape(x.shape[:2] + (-1,))


def _row(x, i):
  """Row i of a block-pair statistic [B, H, nb, nb] -> [B, H, nb] (query block i)."""
  return jax.lax.dynamic_index_in_dim(x, i, axis=2, keepdims=False)


class FPABias:
  """First-passage bias -dip(level_j, min field over (j, i]) from field / level [B, T, H].

  Statistics (`stats`): kst = (level, S), qst = (C, diag), pst = (R,), with S, C [B, H, nb, blk]
  and R [B, H, nb, nb] of `first_passage.block_stats`; diag is (phi,) (in-tile scan) or the
  sub-tile statistics of `_sub_stats` (tiles of n >= 2 * DIAG_SUB tokens).
  """

  kind: Kind = "fpa"

  def __init__(self, field, level):
    self.field, self.level = field, level

  def stats(self, nb, blk):
    phi = blocks(self.field.astype(F32), nb, blk)  # [B, H, nb, blk]
    lvl = blocks(self.level.astype(F32), nb, blk)
    suffix, prefix, r = block_stats(phi)
    sub = _diag_sub(blk)
    diag = (phi,) if sub is None else _sub_stats(phi, sub)
    return (lvl, suffix), (prefix, diag), (r,)

  @staticmethod
  def off_bias(kst, qst, pst):
    (lvl, suffix), (prefix, _), (r,) = kst, qst, pst
    return _fpa_bias(lvl[..., None, :], suffix[..., None, :], prefix[..., :, None], r[..., None, None])

  @staticmethod
  def diag_bias(kst, qst):
    (lvl, _), (_, diag) = kst, qst
    return _diag_bias(lvl, *diag) if len(diag) == 1 else _diag_bias_tiled(lvl, *diag)

  @staticmethod
  def tile_floor(kst, qst, pst):
    """Penalty lower bound per tile [B, H, nb (I), nb (J)]; meaningful for J < I: C_i can only
    deepen the dip, so min_{j in J} dip(level_j, min(S_j, R[I, J]))."""
    (lvl, suffix), (r,) = kst, pst
    # One query block row at a time: O(T) intermediates instead of [B, H, nb, nb, blk].
    row = lambda r_i: dip(lvl, jnp.minimum(suffix, r_i[..., None])).min(-1)
    return jnp.moveaxis(jax.lax.map(row, jnp.moveaxis(r, 2, 0)), 0, 2)

  @staticmethod
  def block_keys(kst, pst, i):
    """What query block i (first query i0) reads of every key: (level, min field over (j, i0)),
    each [B, H, Tp]; meaningful for j < i0 only."""
    (lvl, suffix), (r,) = kst, pst
    return _flat(lvl), _flat(_key_low(suffix, jnp.broadcast_to(_row(r, i)[..., None], suffix.shape)))

  @staticmethod
  def key_floor(keys, qsti):
    """Penalty lower bound [B, H, Tp] of every key for every query of the block (a penalty never
    decreases as the query moves on): dip(level_j, min field over (j, i0))."""
    lvl, low = keys
    return dip(lvl, low)

  @staticmethod
  def key_bias(keys, qsti):
    """Gathered `block_keys` [B, H, C] and the block's query stats [B, H, blk] -> bias [B, H, blk, C]."""
    lvl, low = keys
    prefix = qsti[0]  # min field over [i0, i]
    # The off-diagonal tile bias with R = +inf (low already holds it): its hand-written pullback,
    # so that the key-sparse backward routes cotangents as the chunked one does.
    inf = jnp.full(low.shape[:-1] + (1, 1), jnp.inf, low.dtype)
    return _fpa_bias(lvl[..., None, :], low[..., None, :], prefix[..., :, None], inf)

  def kernel_stats(self, blk, tp):
    """The Pallas layout (`ops.pallas.tile_bias`): krow [B, H, 2 + L, Tp] = (level, S, N_0 .. N_{L-1}),
    qcol [B, H, Tp, 1 + L] = (C, M_0 .. M_{L-1}) and r = R [B, H, nb, nb], for tiles of blk
    tokens over the padded length tp; N, M the sparse table (`first_passage.window_mins`) with
    L = n_levels(blk)."""
    phi, lvl = (_flat(blocks(x.astype(F32), 1, tp)) for x in (self.field, self.level))  # [B, H, Tp]
    suffix, prefix, r = block_stats(phi.reshape(phi.shape[:2] + (tp // blk, blk)))
    ms, ns = window_mins(phi, n_levels(blk))
    krow = jnp.stack([lvl, _flat(suffix)] + ns, 2)
    qcol = jnp.stack([_flat(prefix)] + ms, -1)
    return krow, qcol, r


class FoXBias:
  """Forgetting Attention bias c_i - c_j from c = cumsum(log_fgate) [B, T, H] (kst = qst = (c,))."""

  kind: Kind = "fox"

  def __init__(self, c):
    self.c = c

  def stats(self, nb, blk):
    c = blocks(self.c.astype(F32), nb, blk)
    return (c,), (c,), ()

  @staticmethod
  def off_bias(kst, qst, pst):
    return qst[0][..., :, None] - kst[0][..., None, :]

  diag_bias = staticmethod(lambda kst, qst: FoXBias.off_bias(kst, qst, ()))

  @staticmethod
  def tile_floor(kst, qst, pst):
    """Penalty lower bound per tile [B, H, nb (I), nb (J)]: min_J c - max_I c (c used as given,
    monotone or not)."""
    return kst[0].min(-1)[..., None, :] - qst[0].max(-1)[..., :, None]

  @staticmethod
  def block_keys(kst, pst, i):
    return (_flat(kst[0]),)

  @staticmethod
  def key_floor(keys, qsti):
    """c_j - max_{i in I} c_i (penalty c_j - c_i)."""
    return keys[0] - qsti[0].max(-1)[..., None]

  @staticmethod
  def key_bias(keys, qsti):
    return qsti[0][..., :, None] - keys[0][..., None, :]

  def kernel_stats(self, blk, tp):
    """krow [B, H, 1, Tp] = (c,), qcol [B, H, Tp, 1] = (c,), no block-pair statistic (None)."""
    c = _flat(blocks(self.c.astype(F32), 1, tp))
    return c[:, :, None, :], c[..., None], None


# What the tiled kernels take (`chunked.chunked_attention`, `sparse.key_sparse_attention`,
# `pallas.pallas_attention`).
Bias = FPABias | FoXBias
