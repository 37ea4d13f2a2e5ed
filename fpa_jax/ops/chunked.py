"""Flash-style tiled attention with a first-passage (or FoX) bias; O(T * block) memory.

Tiling identity. For a query block I strictly after a key block J, the range (j, i] splits into
the rest of J after j, the whole blocks strictly between, and the start of I up to i:

    min(field over (j, i]) = min(S_j, R[I, J], C_i)
      S_j     = min of the field in J after j            (key-only, per token)
      R[I, J] = min of the block minima strictly between  (one scalar per block pair, [nb, nb])
      C_i     = min of the field in I up to and incl. i   (query-only, per token)

(`first_passage.block_stats`), so an off-diagonal tile's bias is -dip(level_j, min(S_j, R[I, J],
C_i)): O(block^2) elementwise work like FoX's c_i - c_j. A diagonal tile applies the same identity
to its sub-tiles (`ops.bias.DIAG_SUB`), so it also costs O(block^2) elementwise work rather than
O(block^2 log block). The tile biases and their statistics are the bias protocol (`ops.bias`:
`FPABias` / `FoXBias`), which the key-sparse and Pallas kernels read too.

Gradients. The statistics (`bias.stats`) are computed *outside* the custom VJP by plain
differentiable JAX; the core treats them as inputs. In the backward pass each tile re-computes its
bias under `jax.vjp` and pulls the softmax cotangent back to the statistics (`ops.bias`: the tile
biases' hand-written pullbacks); JAX autodiff then routes them through the min-scans to the
field. Nothing T x T is ever stored: the forward keeps out and logsumexp, the backward recomputes
tiles (FlashAttention-2 order: outer loop over key blocks, dK/dV local). One tile's backward is
`_tile_grads`, which the key-sparse kernel (`ops.sparse`) runs on its diagonal tiles too.

Infinite levels (`ops.bias`): a key with level +inf has bias 0 on an empty range and -inf (weight
exactly 0) on a finite one; gradients stay finite and its tiles are dead for the skip bound below
(floor = +inf).

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

from fpa_jax.ops.bias import Bias, blocks
from fpa_jax.ops.common import F32

DEFAULT_BLOCK = 256
# Finite mask value: exp(NEG - m) == 0 without any inf - inf.
NEG = -1e30


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
def _core(bias, scale, blk, q, k, v, kst, qst, pst, seg, dead):
  return _forward(bias, scale, blk, q, k, v, kst, qst, pst, seg, dead)[0]


def _visit(dead, i, j, body, skip, *operands):
  """body(*operands) on tile (i, j) unless it is dead for every (batch, head): then skip(*operands).

  dead: None (exact: no cond at all) or [B, KVH, nb, nb] bool. body gets keep [B, KVH] first.
  """
  if dead is None:
    return body(None, *operands)
  keep = ~dead[:, :, i, j]
  return jax.lax.cond(keep.any(), lambda *o: body(keep, *o), skip, *operands)


def _diag_start(bias, scale, blk, q, k, v, kst, qst, seg, i):
  """Query block i's diagonal tile, the first step of its online softmax: (q tile, its query stats,
  (m, l, acc)) with m, l [B, KVH, G, bq] and acc [B, KVH, G, bq, Kv] fp32. Shared with `sparse`."""
  qi, qsti = _tile(q, i, blk), _takes(qst, i)
  s = _logits(qi, _tile(k, i, blk), bias.diag_bias(_takes(kst, i), qsti), scale, seg, i, i, True)
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


def _forward(bias, scale, blk, q, k, v, kst, qst, pst, seg, dead):
  """q: [B, Tp, KVH, G, K], k: [B, Tp, KVH, K], v: [B, Tp, KVH, Kv] -> (o [B, Tp, KVH, G, Kv],
  logsumexp [B, KVH, G, nb, blk])."""
  b, tp, kvh, grp, _ = q.shape
  nb = tp // blk

  def q_block(i, carry):
    o_buf, lse_buf = carry
    qi, qsti, (m, l, acc) = _diag_start(bias, scale, blk, q, k, v, kst, qst, seg, i)

    def kv_block(j, c):
      def tile(keep, *state):
        tb = bias.off_bias(_takes(kst, j), qsti, _pair(pst, i, j))
        s = _logits(qi, _tile(k, j, blk), tb, scale, seg, i, j, False, keep)
        return _online_step(state, s, _tile(v, j, blk), "bkhd")

      return _visit(dead, i, j, tile, lambda *c: c, *c)

    m, l, acc = jax.lax.fori_loop(0, i, kv_block, (m, l, acc))
    o_i = jnp.moveaxis(acc / l[..., None], 3, 1).astype(q.dtype)  # [B, bq, KVH, G, Kv]
    o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_i, i * blk, 1)
    lse_buf = jax.lax.dynamic_update_index_in_dim(lse_buf, m + jnp.log(l), i, 3)
    return o_buf, lse_buf

  init = (jnp.zeros((b, tp, kvh, grp, v.shape[-1]), q.dtype), jnp.zeros((b, kvh, grp, nb, blk), F32))
  return jax.lax.fori_loop(0, nb, q_block, init)


def _core_fwd(bias, scale, blk, q, k, v, kst, qst, pst, seg, dead):
  o, lse = _forward(bias, scale, blk, q, k, v, kst, qst, pst, seg, dead)
  return o, (q, k, v, kst, qst, pst, seg, dead, o, lse)


def _tile_grads(bias, scale, seg, i, j, diag, keep, ops, rows, stats):
  """One tile's backward: the body of this kernel's backward loop and of `sparse`'s diagonal tiles.

  ops = (qi [B, bq, KVH, G, K], kj [B, bk, KVH, K], vj [B, bk, KVH, Kv], doi [B, bq, KVH, G, Kv]);
  rows = (lse_i, delta_i), [B, KVH, G, bq] each: the forward's logsumexp and do_i . o_i;
  stats = (kst_j, qst_i, pst_ij): the tile's bias statistics (pst_ij unused on the diagonal tile,
  diag: i == j); keep as in `_logits`. -> (dq [B, bq, KVH, G, K], dk [B, bk, KVH, K], dv [B, bk,
  KVH, Kv], all fp32; the cotangents of stats, () for pst_ij on the diagonal).
  """
  qi, kj, vj, doi = ops
  lse_i, delta_i = rows
  kst_j, qst_i, pst_ij = stats
  if diag:
    tb, pull = jax.vjp(bias.diag_bias, kst_j, qst_i)
  else:
    tb, pull = jax.vjp(bias.off_bias, kst_j, qst_i, pst_ij)
  s = _logits(qi, kj, tb, scale, seg, i, j, diag, keep)
  p = jnp.exp(s - lse_i[..., None])  # masked entries: exactly 0
  # dK / dV (and the bias cotangent below) sum over the group: k, v, bias are shared by it.
  dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(doi.dtype), doi, preferred_element_type=F32)
  dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=F32)
  ds = p * (dp - delta_i[..., None])  # d loss / d logit (= d loss / d bias)
  # Stored once: else XLA re-derives ds from p and dp inside each of its four consumers (the dQ /
  # dK matmuls, the bias pullback's passes), FPA's main extra backward cost over FoX's in the profile.
  ds = jax.lax.optimization_barrier(ds)
  dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj, preferred_element_type=F32) * scale
  dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qi, preferred_element_type=F32) * scale
  g = pull(ds.sum(2))
  return dq, dk, dv, (g[0], g[1], () if diag else g[2])


def _core_bwd(bias, scale, blk, res, do):
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
        ops = (_tile(q, i, blk), kj, vj, _tile(do, i, blk))
        rows = (_take(lse, i, 3), _take(delta, i, 3))
        dqt, dkt, dvt, (gk, gq, gp) = _tile_grads(bias, scale, seg, i, j, diag, keep, ops, rows, (kstj, qsti, pij))
        return dq_i + dqt, dkj + dkt, dvj + dvt, jax.tree.map(jnp.add, dkstj, gk), gq, gp

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


def _dead_tiles(q, k, bias, stats, scale, skip_tolerance, nb, blk):
  """[B, KVH, nb, nb] bool: tiles (I, J), J < I, that the bound in the module docstring drops.
  q: [B, T, H, K]; k: [B, T, KVH, K]."""
  b, t, h, _ = q.shape
  kvh = k.shape[2]
  norms = lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(F32)), -1))  # [B, T, heads]
  # The group's largest query norm: a kv head's tile is dead only if it is for all G query heads.
  qn = blocks(norms(q).reshape(b, t, kvh, h // kvh).max(-1), nb, blk).max(-1)  # [B, KVH, nb]
  kn = blocks(norms(k), nb, blk).max(-1)
  u = abs(scale) * qn[..., :, None] * (kn[..., None, :] + kn[..., :, None])
  floor = bias.tile_floor(*stats)
  below = jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :]
  # Piecewise constant in every input: no gradient flows through the choice of tiles.
  return jax.lax.stop_gradient(below & (floor >= u + (math.log(t) - math.log(skip_tolerance))))


def chunked_attention(q, k, v, bias: Bias, *, scale, segment_ids=None, block_size=None, skip_tolerance=None):
  """Tiled causal attention with an FPA or FoX bias. q: [B, T, H, K], k: [B, T, KVH, K],
  v: [B, T, KVH, Kv] -> [B, T, H, Kv]; KVH divides H (query head h reads kv head h // G).

  `bias` is an `ops.bias.FPABias` or `FoXBias` over [B, T, KVH] gates (one bias per kv head). Any
  T: the sequence is padded to a multiple of the block at the end, where causality alone keeps padding out of every real query. skip_tolerance: None
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
  kst, qst, pst = bias.stats(nb, blk)
  seg = None
  if segment_ids is not None:
    seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, nb * blk - t)], constant_values=-1)
    seg = seg.reshape(b, nb, blk)
  dead = None
  if skip_tolerance is not None:
    dead = _dead_tiles(q, k, bias, (kst, qst, pst), scale, skip_tolerance, nb, blk)
  qg = pad(q).reshape(b, nb * blk, kvh, h // kvh, d)  # a view: no copy of k / v per group
  o = _core(type(bias), float(scale), blk, qg, pad(k), pad(v), kst, qst, pst, seg, dead)
  return o.reshape(b, nb * blk, h, -1)[:, :t]


def dead_tiles(q, k, bias: Bias, *, skip_tolerance, scale=None, block_size=None):
  """The tiles `chunked_attention(..., skip_tolerance=...)` drops: [B, KVH, nb, nb] bool (query block
  I, key block J; only J < I can be True). q: [B, T, H, K], k: [B, T, KVH, K]; scale defaults to
  K ** -0.5."""
  t, d = q.shape[1], q.shape[-1]
  blk = block_for(t, block_size)
  nb = -(-t // blk)
  scale = d**-0.5 if scale is None else float(scale)
  return _dead_tiles(q, k, bias, bias.stats(nb, blk), scale, skip_tolerance, nb, blk)


def skipped_tile_fraction(q, k, bias: Bias, *, skip_tolerance, scale=None, block_size=None):
  """(per_head, all_heads): the fraction of off-diagonal (J < I) tiles dropped per (batch, kv head),
  and the fraction dropped for every (batch, head) at once, whose compute is skipped. Floats."""
  dead = dead_tiles(q, k, bias, skip_tolerance=skip_tolerance, scale=scale, block_size=block_size)
  nb = dead.shape[-1]
  n_off = max(nb * (nb - 1) // 2, 1)
  return float(dead.sum(axis=(-2, -1)).mean()) / n_off, float(dead.all(axis=(0, 1)).sum()) / n_off
