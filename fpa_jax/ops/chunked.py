"""Flash-style tiled attention with a first-passage (or FoX) bias; O(T * block) memory.

Tiling identity. For a query block I strictly after a key block J, the range (j, i] splits into
the rest of J after j, the whole blocks strictly between, and the start of I up to i:

    min(field over (j, i]) = min(S_j, R[I, J], C_i)
      S_j     = min of the field in J after j            (key-only, per token)
      R[I, J] = min of the block minima strictly between  (one scalar per block pair, [nb, nb])
      C_i     = min of the field in I up to and incl. i   (query-only, per token)

so an off-diagonal tile's bias is -relu(level_j - min(S_j, R[I, J], C_i)): O(block^2) elementwise
work like FoX's c_i - c_j. A diagonal tile applies the same identity to its sub-tiles of
`DIAG_SUB` tokens, from sub-tile statistics computed for every tile at once outside the tile loop,
and runs a column min-scan only inside its diagonal sub-tiles (small tiles: in the whole tile), so
it also costs O(block^2) elementwise work rather than O(block^2 log block).

Gradients. S, C and R are computed *outside* the custom VJP by plain differentiable JAX; the core
treats them as inputs. In the backward pass each tile re-computes its bias under `jax.vjp` and
pulls the softmax cotangent back to (S, C, R, level) or, on the diagonal, to level and the
field (small tiles) or the sub-tile statistics; JAX autodiff then routes them through the
min-scans to the field. The tile biases carry hand-written pullbacks (`_fpa_bias`, `_diag_bias`,
`_diag_bias_sub`, `_column_min_stat`): autodiff of min/relu and of the scan was the
backward pass's bottleneck. Nothing T x T is ever stored: the forward keeps out and logsumexp,
the backward recomputes tiles (FlashAttention-2 order: outer loop over key blocks, dK/dV local).

Infinite levels. Every tile bias is -dip(level_j, min field) (`common.dip`: the difference where
level > min, else 0), so level = +inf against an empty range or a +inf statistic (S_j, R, the
above-diagonal parts of a diagonal tile) gives 0, not inf - inf, and against a finite one -inf: a
dead key whose weight exp(-inf - m) is exactly 0 (m is finite: the diagonal entry is always live).
The pullbacks route cotangents by compares only (no product with a statistic), so its ds = 0 and
every gradient stays finite; its tiles are dead for the skip bound below (floor = +inf).

Skipping dead tiles (`skip_tolerance` = eps; None = exact). On an off-diagonal tile every penalty
is at least a floor that ignores the query side (C_i can only deepen the dip; FoX's c is used
as given, monotone or not):

    FPA: floor[I, J] = min_{j in J} relu(level_j - min(S_j, R[I, J]))
    FoX: floor[I, J] = min_{j in J} c_j - max_{i in I} c_i             (penalty c_j - c_i)

Every logit obeys scale * q_i.k_j <= |scale| |q|_I |k|_J, and the row's diagonal logit (penalty
0, never masked) is >= -|scale| |q|_I |k|_I, where |x|_X is the largest norm over block X in this
call. So each weight of the tile is <= exp(U[I, J] - floor[I, J]) with U = |scale| |q|_I
(|k|_J + |k|_I) <= 2 |scale| max|q| max|k|. A tile with floor >= U + log T - log eps is dropped
for that (batch, head), in the forward and the backward alike: each row loses total weight
delta <= eps (at most T keys, each <= eps / T), every output component moves by <= 2 eps max|v|,
and the logit cotangent ds_ij by <= 2 A p_ij (dropped) or 4 A p_ij eps / (1 - eps) (kept), with
A = max|do_i| max|v_j| (2-norms); gradients are sums of those. A tile's compute is skipped
(`lax.cond`) when it is dead for every (batch, head); otherwise dead heads are masked in it.

Grouped-query attention. k, v and the gates have KVH heads, q has H = G * KVH, query head h
reading kv head h // G. Inside the core q is [B, Tp, KVH, G, K] and every tile carries the group
axis (logits [B, KVH, G, bq, bk]); the tile bias [B, KVH, bq, bk] is computed once per kv head and
broadcast over G, its cotangent summed over G before the pullback, and dK / dV sum over the group
in their einsums, so k / v are never repeated. |q|_I in the skip bound is the max over the group:
a tile is dropped for a kv head only where it is dead for all G query heads.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fpa_jax.ops.common import F32, dip

DEFAULT_BLOCK = 256
# Finite mask value: exp(NEG - m) == 0 without any inf - inf.
NEG = -1e30


def _min_scan(x, axis, reverse=False):
  return jax.lax.associative_scan(jnp.minimum, x, axis=axis % x.ndim, reverse=reverse)


def _blocks(x, nb, blk):
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


def _scan_stats(phi):
  """Within-block min statistics of phi [..., nb, blk]: (S, C, R) as in the module docstring."""
  nb = phi.shape[-2]
  inf = jnp.full(phi.shape[:-1] + (1,), jnp.inf, F32)
  suffix = jnp.concatenate([_min_scan(phi, -1, reverse=True)[..., 1:], inf], -1)  # S_j, excl. j
  prefix = _min_scan(phi, -1)  # C_i, incl. i
  if nb == 1:
    # One block: no pair has a block between. Built from a zero-size slice of p instead, R's
    # pullback read garbage (NaN field gradients) at --xla_backend_optimization_level=0.
    return suffix, prefix, jnp.full(phi.shape[:-2] + (1, 1), jnp.inf, F32)
  bmin = phi.min(-1)  # [..., nb]
  # P[b, J] = min(bmin over (J, b]); R[I, J] = P[I - 1, J] = min over blocks strictly between.
  ib = jnp.arange(nb)
  p = _min_scan(jnp.where(ib[:, None] > ib[None, :], bmin[..., :, None], jnp.inf), -2)
  r = jnp.concatenate([jnp.full(p.shape[:-2] + (1, nb), jnp.inf, F32), p[..., :-1, :]], -2)
  return suffix, prefix, r


def _column_min(phi):
  """m[..., i, j] = min(phi over (j, i]) for j < i, +inf elsewhere: [..., n] -> [..., n, n]."""
  n = phi.shape[-1]
  below = jnp.arange(n)[:, None] > jnp.arange(n)[None, :]
  return _min_scan(jnp.where(below, phi[..., :, None], jnp.inf), -2)


@jax.custom_vjp
def _diag_bias(lvl, phi):
  """Exact in-tile first-passage bias: [..., n] level, field -> [..., n, n] (query i, key j)."""
  return -dip(lvl[..., None, :], _column_min(phi))


def _diag_bias_fwd(lvl, phi):
  m = _column_min(phi)
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
  """Cotangent of phi [..., n] from dm [..., n, n], the cotangent of `_column_min(phi)`.

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
  """`_column_min` with the hand-written pullback: [..., n] -> [..., n, n]."""
  return _column_min(phi)


_column_min_stat.defvjp(lambda phi: (_column_min(phi), phi), lambda phi, dm: (_colmin_pullback(phi, dm),))

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
  suffix, prefix, r = _scan_stats(ps)
  a = jnp.minimum(suffix[..., None, :, :], r[..., :, :, None]).reshape(lead + (blk // sub, blk))
  return a, prefix, ps


def _diag_bias_tiled(lvl, a, c, ps):
  """A diagonal tile's bias [..., n, n] from `_sub_stats` of that tile; lvl [..., n]."""
  return _diag_bias_sub(lvl, a, c, _column_min_stat(ps))


def _set_diag_blocks(x, blocks):
  """x [..., n, n] with its diagonal sub x sub blocks replaced by blocks [..., ns, sub, sub].

  Static in-place slice updates: a select against a block-diagonal broadcast of `blocks` is
  ~7x slower on XLA:CPU than the min it would wrap."""
  sub = blocks.shape[-1]
  for i in range(blocks.shape[-3]):
    x = x.at[..., i * sub : (i + 1) * sub, i * sub : (i + 1) * sub].set(blocks[..., i, :, :])
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


class FPAGate:
  """First-passage bias from field / level [B, T, H]."""

  def __init__(self, field, level):
    self.field, self.level = field, level

  def stats(self, nb, blk):
    phi = _blocks(self.field.astype(F32), nb, blk)  # [B, H, nb, blk]
    lvl = _blocks(self.level.astype(F32), nb, blk)
    suffix, prefix, r = _scan_stats(phi)
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
    """Penalty lower bound per tile [B, H, nb (I), nb (J)]; meaningful for J < I."""
    (lvl, suffix), (r,) = kst, pst
    # One query block row at a time: O(T) intermediates instead of [B, H, nb, nb, blk].
    row = lambda r_i: dip(lvl, jnp.minimum(suffix, r_i[..., None])).min(-1)
    return jnp.moveaxis(jax.lax.map(row, jnp.moveaxis(r, 2, 0)), 0, 2)


class FoXGate:
  """Forgetting Attention bias c_i - c_j from c = cumsum(log_fgate) [B, T, H]."""

  def __init__(self, c):
    self.c = c

  def stats(self, nb, blk):
    c = _blocks(self.c.astype(F32), nb, blk)
    return (c,), (c,), ()

  @staticmethod
  def off_bias(kst, qst, pst):
    return qst[0][..., :, None] - kst[0][..., None, :]

  diag_bias = staticmethod(lambda kst, qst: FoXGate.off_bias(kst, qst, ()))

  @staticmethod
  def tile_floor(kst, qst, pst):
    """Penalty lower bound per tile [B, H, nb (I), nb (J)]: min_J c - max_I c."""
    return kst[0].min(-1)[..., None, :] - qst[0].max(-1)[..., :, None]


def _take(x, i, axis=2):
  return jax.lax.dynamic_index_in_dim(x, i, axis=axis, keepdims=False)


def _takes(tree, i):
  return jax.tree.map(lambda x: _take(x, i), tree)


def _pair(pst, i, j):
  return jax.tree.map(lambda x: x[:, :, i, j], pst)


def _tile(x, i, blk):
  """Rows [i * blk, (i + 1) * blk) of a [B, T, H, K] array (no transposed copies of q/k/v)."""
  return jax.lax.dynamic_slice_in_dim(x, i * blk, blk, axis=1)


def _logits(q, k, bias, scale, seg, i, j, causal, keep=None):
  """q: [B, bq, KVH, G, K], k: [B, bk, KVH, K], bias: [B, KVH, bq, bk] -> masked logits
  [B, KVH, G, bq, bk] (the bias shared by the group).

  keep: optional [B, KVH] bool; False masks the whole tile for that (batch, kv head) (a dead tile).
  """
  s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=F32) * scale + bias[:, :, None]
  mask = None if keep is None else keep[:, :, None, None, None]
  if causal:  # diagonal tiles only, which are never dead (keep is None)
    n = s.shape[-1]
    mask = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
  if seg is not None:
    sm = _take(seg, i, 1)[:, None, None, :, None] == _take(seg, j, 1)[:, None, None, None, :]
    mask = sm if mask is None else mask & sm
  return s if mask is None else jnp.where(mask, s, NEG)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _core(gate, scale, blk, q, k, v, kst, qst, pst, seg, dead):
  return _forward(gate, scale, blk, q, k, v, kst, qst, pst, seg, dead)[0]


def _visit(dead, i, j, body, skip, *operands):
  """body(*operands) on tile (i, j) unless it is dead for every (batch, head): then skip(*operands).

  dead: None (exact: no cond at all) or [B, KVH, nb, nb] bool. body gets keep [B, KVH] first.
  """
  if dead is None:
    return body(None, *operands)
  keep = ~dead[:, :, i, j]
  return jax.lax.cond(keep.any(), lambda *o: body(keep, *o), skip, *operands)


def _diag_start(gate, scale, blk, q, k, v, kst, qst, seg, i):
  """Query block i's diagonal tile, the first step of its online softmax: (q tile, its query stats,
  (m, l, acc)) with m, l [B, KVH, G, bq] and acc [B, KVH, G, bq, Kv] fp32. Shared with `sparse`."""
  qi, qsti = _tile(q, i, blk), _takes(qst, i)
  s = _logits(qi, _tile(k, i, blk), gate.diag_bias(_takes(kst, i), qsti), scale, seg, i, i, True)
  m = s.max(-1)  # the diagonal entry is always unmasked, so m is finite
  p = jnp.exp(s - m[..., None])
  acc = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), _tile(v, i, blk), preferred_element_type=F32)
  return qi, qsti, (m, p.sum(-1), acc)


def _online_step(state, s, vt, v_layout: str):
  """One more key tile into the online softmax state (m, l, acc): masked logits s [B, KVH, G, bq, bk]
  and their values vt, laid out "bkhd" (a tile of v) or "bhkd" (keys gathered per head)."""
  m, l, acc = state
  m_new = jnp.maximum(m, s.max(-1))
  corr = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new[..., None])
  pv = jnp.einsum(f"bhgqk,{v_layout}->bhgqd", p.astype(vt.dtype), vt, preferred_element_type=F32)
  return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def _forward(gate, scale, blk, q, k, v, kst, qst, pst, seg, dead):
  """q: [B, Tp, KVH, G, K], k: [B, Tp, KVH, K], v: [B, Tp, KVH, Kv] -> (o [B, Tp, KVH, G, Kv],
  logsumexp [B, KVH, G, nb, blk])."""
  b, tp, kvh, grp, _ = q.shape
  nb = tp // blk

  def q_block(i, carry):
    o_buf, lse_buf = carry
    qi, qsti, (m, l, acc) = _diag_start(gate, scale, blk, q, k, v, kst, qst, seg, i)

    def kv_block(j, c):
      def tile(keep, *state):
        bias = gate.off_bias(_takes(kst, j), qsti, _pair(pst, i, j))
        s = _logits(qi, _tile(k, j, blk), bias, scale, seg, i, j, False, keep)
        return _online_step(state, s, _tile(v, j, blk), "bkhd")

      return _visit(dead, i, j, tile, lambda *c: c, *c)

    m, l, acc = jax.lax.fori_loop(0, i, kv_block, (m, l, acc))
    o_i = jnp.moveaxis(acc / l[..., None], 3, 1).astype(q.dtype)  # [B, bq, KVH, G, Kv]
    o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_i, i * blk, 1)
    lse_buf = jax.lax.dynamic_update_index_in_dim(lse_buf, m + jnp.log(l), i, 3)
    return o_buf, lse_buf

  init = (jnp.zeros((b, tp, kvh, grp, v.shape[-1]), q.dtype), jnp.zeros((b, kvh, grp, nb, blk), F32))
  return jax.lax.fori_loop(0, nb, q_block, init)


def _core_fwd(gate, scale, blk, q, k, v, kst, qst, pst, seg, dead):
  o, lse = _forward(gate, scale, blk, q, k, v, kst, qst, pst, seg, dead)
  return o, (q, k, v, kst, qst, pst, seg, dead, o, lse)


def _core_bwd(gate, scale, blk, res, do):
  q, k, v, kst, qst, pst, seg, dead, o, lse = res
  b, tp, kvh, grp, _ = q.shape
  nb = tp // blk
  # delta_i = do_i . o_i, in the logsumexp layout [B, KVH, G, nb, blk].
  delta = jnp.moveaxis(jnp.sum(do.astype(F32) * o.astype(F32), -1), 1, 3).reshape(b, kvh, grp, nb, blk)
  zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, F32), t)

  def k_block(j, carry):
    dq, dqst, dpst, dk, dv, dkst = carry
    kj, vj, kstj = _tile(k, j, blk), _tile(v, j, blk), _takes(kst, j)

    def tile(i, c, diag):
      dq, dqst, dpst, dkj, dvj, dkstj = c
      qsti, pij = _takes(qst, i), (() if diag else _pair(pst, i, j))

      def body(keep, dq_i, dkj, dvj, dkstj):
        # Tile-sized operands and results only: a cond carrying the full dQ buffer would copy it.
        qi, doi = _tile(q, i, blk), _tile(do, i, blk)
        if diag:
          bias, pull = jax.vjp(gate.diag_bias, kstj, qsti)
        else:
          bias, pull = jax.vjp(gate.off_bias, kstj, qsti, pij)
        s = _logits(qi, kj, bias, scale, seg, i, j, diag, keep)
        p = jnp.exp(s - _take(lse, i, 3)[..., None])  # masked entries: exactly 0
        # dK / dV (and the bias cotangent below) sum over the group: k, v, bias are shared by it.
        dvj = dvj + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), doi, preferred_element_type=F32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=F32)
        ds = p * (dp - _take(delta, i, 3)[..., None])  # d loss / d logit (= d loss / d bias)
        # Stored once: else XLA re-derives ds from p and dp inside each of its four consumers
        # (the dQ / dK matmuls, the bias pullback's passes), FPA's main extra backward cost
        # over FoX's in the profile.
        ds = jax.lax.optimization_barrier(ds)
        dq_i = dq_i + jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj, preferred_element_type=F32) * scale
        dkj = dkj + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qi, preferred_element_type=F32) * scale
        g = pull(ds.sum(2))
        dkstj = jax.tree.map(jnp.add, dkstj, g[0])
        return dq_i, dkj, dvj, dkstj, g[1], (() if diag else g[2])

      skip = lambda dq_i, dkj, dvj, dkstj: (dq_i, dkj, dvj, dkstj, zeros(qsti), zeros(pij))
      dq_i, dkj, dvj, dkstj, gq, gp = _visit(
        None if diag else dead, i, j, body, skip, _tile(dq, i, blk), dkj, dvj, dkstj
      )
      dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * blk, 1)
      dqst = jax.tree.map(lambda a, x: a.at[:, :, i].add(x), dqst, gq)
      if not diag:
        dpst = jax.tree.map(lambda a, x: a.at[:, :, i, j].add(x), dpst, gp)
      return dq, dqst, dpst, dkj, dvj, dkstj

    c = (dq, dqst, dpst, jnp.zeros(kj.shape, F32), jnp.zeros(vj.shape, F32), zeros(kstj))
    c = tile(j, c, True)
    c = jax.lax.fori_loop(j + 1, nb, lambda i, c: tile(i, c, False), c)
    dq, dqst, dpst, dkj, dvj, dkstj = c
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj.astype(dk.dtype), j * blk, 1)
    dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj.astype(dv.dtype), j * blk, 1)
    dkst = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, j, 2), dkst, dkstj)
    return dq, dqst, dpst, dk, dv, dkst

  # dK / dV tiles are final when written (each key block is visited once), so they are stored in
  # the input dtype; dQ accumulates across key blocks and stays fp32 until the end.
  init = (
    jnp.zeros(q.shape, F32),
    zeros(qst),
    zeros(pst),
    jnp.zeros(k.shape, k.dtype),
    jnp.zeros(v.shape, v.dtype),
    zeros(kst),
  )
  dq, dqst, dpst, dk, dv, dkst = jax.lax.fori_loop(0, nb, k_block, init)
  return (dq.astype(q.dtype), dk, dv, dkst, dqst, dpst, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def _round_up(x, m):
  return -(-x // m) * m


def block_for(t: int, block_size: int | None) -> int:
  """The tile size used for length t: the requested size, shrunk for short sequences."""
  blk = DEFAULT_BLOCK if block_size is None else int(block_size)
  if blk < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size}")
  return min(blk, _round_up(t, 8))


def _dead_tiles(q, k, gate, stats, scale, skip_tolerance, nb, blk):
  """[B, KVH, nb, nb] bool: tiles (I, J), J < I, that the bound in the module docstring drops.
  q: [B, T, H, K]; k: [B, T, KVH, K]."""
  b, t, h, _ = q.shape
  kvh = k.shape[2]
  norms = lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(F32)), -1))  # [B, T, heads]
  # The group's largest query norm: a kv head's tile is dead only if it is for all G query heads.
  qn = _blocks(norms(q).reshape(b, t, kvh, h // kvh).max(-1), nb, blk).max(-1)  # [B, KVH, nb]
  kn = _blocks(norms(k), nb, blk).max(-1)
  u = abs(scale) * qn[..., :, None] * (kn[..., None, :] + kn[..., :, None])
  floor = gate.tile_floor(*stats)
  below = jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :]
  # Piecewise constant in every input: no gradient flows through the choice of tiles.
  return jax.lax.stop_gradient(below & (floor >= u + (math.log(t) - math.log(skip_tolerance))))


def chunked_attention(q, k, v, gate, *, scale, segment_ids=None, block_size=None, skip_tolerance=None):
  """Tiled causal attention with a gate bias. q: [B, T, H, K], k: [B, T, KVH, K],
  v: [B, T, KVH, Kv] -> [B, T, H, Kv]; KVH divides H (query head h reads kv head h // G).

  `gate` is an `FPAGate` or `FoXGate` over [B, T, KVH] gates (one bias per kv head). Any T: the sequence is padded to a multiple of the block
  at the end, where causality alone keeps padding out of every real query. skip_tolerance: None
  (exact) or eps in (0, 1): drop the tiles whose weights the module docstring's bound puts below
  eps / T, in the forward and the backward (each row loses total weight <= eps).
  """
  b, t, h, d = q.shape
  kvh = k.shape[2]
  blk = block_for(t, block_size)
  if b == 0 or t == 0:  # no tiles (and a -1 reshape would divide by zero)
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  nb = -(-t // blk)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, nb * blk - t), (0, 0), (0, 0)]) if nb * blk != t else x
  kst, qst, pst = gate.stats(nb, blk)
  seg = None
  if segment_ids is not None:
    seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, nb * blk - t)], constant_values=-1)
    seg = seg.reshape(b, nb, blk)
  dead = None
  if skip_tolerance is not None:
    dead = _dead_tiles(q, k, gate, (kst, qst, pst), scale, skip_tolerance, nb, blk)
  qg = pad(q).reshape(b, nb * blk, kvh, h // kvh, d)  # a view: no copy of k / v per group
  o = _core(type(gate), float(scale), blk, qg, pad(k), pad(v), kst, qst, pst, seg, dead)
  return o.reshape(b, nb * blk, h, -1)[:, :t]


def dead_tiles(q, k, gate, *, skip_tolerance, scale=None, block_size=None):
  """The tiles `chunked_attention(..., skip_tolerance=...)` drops: [B, KVH, nb, nb] bool (query block
  I, key block J; only J < I can be True). q: [B, T, H, K], k: [B, T, KVH, K]; scale defaults to
  K ** -0.5."""
  t, d = q.shape[1], q.shape[-1]
  blk = block_for(t, block_size)
  nb = -(-t // blk)
  scale = d**-0.5 if scale is None else float(scale)
  return _dead_tiles(q, k, gate, gate.stats(nb, blk), scale, skip_tolerance, nb, blk)


def skipped_tile_fraction(q, k, gate, *, skip_tolerance, scale=None, block_size=None):
  """(per_head, all_heads): the fraction of off-diagonal (J < I) tiles dropped per (batch, kv head),
  and the fraction dropped for every (batch, head) at once, whose compute is skipped. Floats."""
  dead = dead_tiles(q, k, gate, skip_tolerance=skip_tolerance, scale=scale, block_size=block_size)
  nb = dead.shape[-1]
  n_off = max(nb * (nb - 1) // 2, 1)
  return float(dead.sum(axis=(-2, -1)).mean()) / n_off, float(dead.all(axis=(0, 1)).sum()) / n_off
