"""Key-sparse attention: the chunked kernel reading, per query block, only the keys that the skip
bound cannot rule out (`skip="keys"`), forward and backward.

Why keys, not tiles. Tile skipping (`chunked`, `skip="tiles"`) drops a [blk x blk] tile only when
every one of its weights is negligible. A head trained to forget keeps a sparse set of keys alive
all over the sequence (a retrieval head of Study 2's passkey models), so almost every tile holds
one live key and none is dropped, while most key reads are wasted (`experiments.forget_speed`
measures both shares). Here the live keys of each query block are gathered into dense chunks.

The bound, per query block I (starting at i0) and key j < i0. Every penalty of the pair is at least
a floor that depends on I through i0 only (a penalty never decreases as the query moves on):

    FPA: floor[I, j] = dip(level_j, min field over (j, i0)) = dip(level_j, min(S_j, R[I, J]))
    FoX: floor[I, j] = c_j - max_{i in I} c_i                  (penalty c_j - c_i)

(S, R: the chunked kernel's key and block-pair statistics). Every logit obeys scale q_i.k_j <=
|scale| |q|_I |k_j|, and a row's logsumexp is at least its own diagonal logit s_ii = scale q_i.k_i
(penalty 0, never masked) >= s_I = min over the block (and the query group) of s_ii, computed
exactly, not bounded. Key j is dropped for block I when

    floor[I, j] >= |scale| |q|_I |k_j| - s_I + log T - log eps,

so each of its weights is <= eps / T and each row loses total weight delta_i <= eps: each output
component moves by <= 2 eps max|v|, the guarantee of tile skipping. Keys j >= i0 (the diagonal
tile) are always read, exactly as in `chunked`.

Backward. The kernel is the exact attention with the dropped keys masked out, and so is its
gradient: a custom VJP whose forward saves the kept-key sets ([nb, B, KVH, Tp] bool, T^2 / blk bytes
per (row, kv head): the backward reads exactly the forward's keys, no re-decided threshold) and the
logsumexp; the backward runs query block by query block, the diagonal tile as in `chunked`, then the
same chunks of the same keys, p recomputed from the logsumexp; dQ stays local to the block, dK, dV
and the cotangents of the gathered key statistics are scatter-added at the keys read, and the bias
pullbacks are `chunked`'s (`ops.bias`: the same subgradients at ties), so the gradients into field
and level (or log_fgate) are the chunked kernel's restricted to the kept keys. Against the exact
gradient (A = max_i |do_i| max_j |v_j|, 2-norms): the logit cotangent ds_ij = p_ij (do_i.v_j -
do_i.o_i) moves by <= 2 A p_ij on a dropped entry and by <= 4 A p_ij eps / (1 - eps) on a kept one
(renormalised by 1 / (1 - delta_i)), so per row sum_j |d ds_ij| <= 6 A eps / (1 - eps); hence
|d dq_i| <= 6 |scale| A max|k| eps / (1 - eps), and dk_j, d level_j, d field_s are the sums of
those per-entry bounds against |scale| |q_i|, 1, 1 over the entries each one enters, dv_j moves
by <= sum_i p_ij |do_i| (1 dropped, eps / (1 - eps) kept) (`tests/ops/test_sparse.py` checks both:
equality with float64 loops masked the same way, and this bound against the unmasked ones).

Reads. Per query block: the floor and the test, O(T) elementwise; the live keys compacted in key
order (a cumulative sum and a scatter, O(T)); then chunks of C = key_chunk keys (a divisor of the
block, default the block), N = B * KVH of them per step (one batched matmul of [G * blk, K] x
[K, C] each), scheduled in one of two ways:
  * shared: step s reads chunk s of every (batch row, kv head): ceil(n / C) steps, n the largest
    live count over (row, kv head) of the block, so the reads follow the densest head;
  * per_head: the chunks of every (row, kv head), ceil(n_bh / C) each, listed one after the other
    and cut into steps of N: keys read = keys kept rounded up to C per head (+ the last step's
    unused items). Its steps gather q / do per item and merge the softmax state by scatter;
  * auto (default, `skip="keys"`): per block, per_head where its steps times PER_HEAD_COST are
    fewer than shared's (a lax.cond), i.e. where the kept counts differ between heads by more than
    that factor. `skip="keys_shared"` / `"keys_per_head"` force one.
The loop lengths are data dependent (while loops): the custom VJP is what makes it differentiable.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fpa_jax.ops.bias import Bias, blocks
from fpa_jax.ops.chunked import F32, NEG, _diag_start, _take, _takes, _tile, _tile_grads, block_for

# How the gathered chunks are scheduled ("reads"): "shared" (one loop for every (row, kv head),
# as long as the densest one needs), "per_head" (each (row, kv head) its own chunks, packed N per
# step) or "auto" (per query block, per_head where it needs fewer steps by PER_HEAD_COST).
READS = ("auto", "shared", "per_head")
# A per_head step costs this many shared steps (its gathers of q / do and the scatter merge of the
# softmax state): 1.0-1.1 measured on XLA:CPU (time ratio over step ratio, both schedules forced on
# the same recorded inputs, `experiments.forget_speed`), rounded up.
PER_HEAD_COST = 1.1


def _block_bounds(q, k, scale, nb, blk):
  """(|q|_I, s_I), each [B, KVH, nb]: the block's largest query norm and smallest diagonal logit,
  over the query group too. q: [B, Tp, KVH, G, K], k: [B, Tp, KVH, K] (zero-padded)."""
  qf, kf = q.astype(F32), k.astype(F32)
  qn = jnp.sqrt(jnp.sum(jnp.square(qf), -1)).max(-1)  # [B, Tp, KVH]
  sii = (jnp.einsum("bthgd,bthd->bthg", qf, kf) * scale).min(-1)
  per_block = lambda x, red: red(blocks(x, nb, blk), -1)
  return per_block(qn, jnp.max), per_block(sii, jnp.min)


def _live(bias, q, k, stats, scale, eps, t, nb, blk):
  """live(i) -> [B, KVH, Tp] bool: block i's keys j < i0 that the bound keeps. Piecewise constant
  in every input (no gradient flows through the choice of keys)."""
  kst, qst, pst = jax.lax.stop_gradient(stats)
  q, k = jax.lax.stop_gradient((q, k))
  qn, s_min = _block_bounds(q, k, scale, nb, blk)
  kn = jnp.sqrt(jnp.sum(jnp.square(k.astype(F32)), -1))  # [B, Tp, KVH]
  kn = jnp.moveaxis(kn, 1, 2)  # [B, KVH, Tp]
  slack = math.log(t) - math.log(eps)
  jpos = jnp.arange(nb * blk)

  def live(i):
    keys = bias.block_keys(kst, pst, i)
    thr = abs(scale) * _take(qn, i)[..., None] * kn - _take(s_min, i)[..., None] + slack
    return (bias.key_floor(keys, _takes(qst, i)) < thr) & (jpos < i * blk)

  return live


def _compact(live):
  """live [B, H, Tp] bool -> (idx [B, H, Tp] int32: the live positions first, in key order; count [B, H])."""
  tp = live.shape[-1]
  pos = jnp.where(live, jnp.cumsum(live, -1) - 1, tp)  # tp: out of range, dropped by the scatter
  scatter = lambda p: jnp.zeros((tp,), jnp.int32).at[p].set(jnp.arange(tp, dtype=jnp.int32), mode="drop")
  idx = jax.vmap(jax.vmap(scatter))(pos)
  return idx, live.sum(-1)


def _flat(x):
  """[B, H, ...] -> [B * H, ...]: (batch row, kv head) pairs, the unit the chunks are read for."""
  return x.reshape((-1,) + x.shape[2:])


def _heads_first(x):
  """A tile [B, n, KVH, ...] -> [B * KVH, ...] with the token axis after the group axis if any:
  [B, n, KVH, K] -> [N, n, K]; [B, n, KVH, G, K] -> [N, G, n, K]."""
  x = jnp.moveaxis(x, 1, 2)  # [B, KVH, n, ...]
  if x.ndim == 5:
    x = jnp.moveaxis(x, 2, 3)  # [B, KVH, G, n, K]
  return _flat(x)


def _unflat_tile(x, b):
  """[N, G, n, K] -> [B, n, KVH, G, K] (the inverse of `_heads_first` on a query tile)."""
  x = x.reshape((b, -1) + x.shape[1:])
  return jnp.moveaxis(x, 3, 1)


class _Schedule:
  """The chunks query block i reads: n_steps steps, each N items (N = B * KVH) of width C;
  item(step) -> (bh [N] the (row, kv head) read, ids [N, C] its keys, valid [N, C]).

  shared: step s reads chunk s of every (row, kv head) (bh = arange(N)): max_bh ceil(count / C)
  steps. per_head: the chunks of all (row, kv head) pairs, ceil(count_bh / C) each, listed one
  after the other and cut into steps of N: ceil(sum_bh ceil(count_bh / C) / N) steps."""

  def __init__(self, live, c, per_head):
    idx, count = _compact(live)
    self.idx, self.count, self.c, self.per_head = _flat(idx), _flat(count), c, per_head
    n = self.count.shape[0]
    chunks = -(-self.count // c)
    if per_head:
      self.end = jnp.cumsum(chunks)
      self.n_steps = -(-self.end[-1] // n)
    else:
      self.n_steps = chunks.max()

  def item(self, step):
    n, c = self.count.shape[0], self.c
    if self.per_head:
      job = step * n + jnp.arange(n)
      bh = jnp.minimum(jnp.searchsorted(self.end, job, side="right"), n - 1)
      first = self.end[bh] - -(-self.count[bh] // c)  # the (row, head)'s first chunk in the list
      pos = (job - first)[:, None] * c + jnp.arange(c)
      valid = (job < self.end[-1])[:, None] & (pos < self.count[bh][:, None])
      ids = jnp.take_along_axis(self.idx[bh], jnp.clip(pos, 0, self.idx.shape[-1] - 1), -1)
    else:
      bh = jnp.arange(n)
      pos = step * c + jnp.arange(c)
      ids = jax.lax.dynamic_slice_in_dim(self.idx, step * c, c, axis=-1)
      valid = pos[None, :] < self.count[:, None]
    return bh, jnp.where(valid, ids, 0), valid

  def take(self, x, bh):
    """x [N, ...] (or a tree of them) at the items' (row, kv head)s: a gather per_head, x itself shared."""
    return jax.tree.map(lambda a: a[bh], x) if self.per_head else x

  def add(self, buf, bh, x):
    """buf [N, ...] += the items' x [N, ...] (a scatter-add per_head: items may share a head)."""
    return buf.at[bh].add(x) if self.per_head else buf + x


def _choose(reads, live, c, n_items):
  """Per query block: True where the per_head schedule is used."""
  if reads != "auto":
    return reads == "per_head"
  count = _flat(live.sum(-1))
  chunks = -(-count // c)
  return chunks.sum() * PER_HEAD_COST < chunks.max() * n_items


def _scheduled(reads, live, c, run):
  """run(_Schedule) for block i's live keys under `reads` (a lax.cond between the two for auto)."""
  if reads == "auto":
    per_head = _choose(reads, live, c, _flat(live[..., 0]).shape[0])
    return jax.lax.cond(per_head, lambda: run(_Schedule(live, c, True)), lambda: run(_Schedule(live, c, False)))
  return run(_Schedule(live, c, reads == "per_head"))


class _Block:
  """What every chunk of query block i shares, in the (row, kv head)-first layout."""

  def __init__(self, bias, scale, q, k, v, kst, qst, pst, seg, i, blk):
    b, tp, kvh = k.shape[:3]
    self.bias, self.scale, self.kvh = bias, scale, kvh
    self.q = _heads_first(_tile(q, i, blk))  # [N, G, bq, K]
    self.k, self.v = _heads_first(k), _heads_first(v)  # [N, Tp, K / Kv]
    self.qst = jax.tree.map(lambda x: _flat(x)[:, None], _takes(qst, i))  # [N, 1, ...]
    self.seg_q = None if seg is None else _take(seg, i, 1)  # [B, bq]
    self.seg_k = None if seg is None else seg.reshape(b, tp)

  def keys_of(self, keys, bh, ids):
    """`bias.block_keys` ([B, KVH, Tp] each) at the items' keys -> [N, 1, C] each."""
    return [_flat(x)[bh[:, None], ids][:, None] for x in keys]

  def logits(self, sched, bh, ids, valid, kb):
    """Masked logits [N, G, bq, C] of the items against their keys; kb: key bias [N, 1, bq, C]."""
    qg, kg = sched.take(self.q, bh), self.k[bh[:, None], ids]
    s = jnp.einsum("ngqd,nkd->ngqk", qg, kg, preferred_element_type=F32) * self.scale + kb
    mask = valid[:, None, None, :]
    if self.seg_q is not None:
      row = bh // self.kvh
      mask = mask & (self.seg_q[row][:, None, :, None] == self.seg_k[row[:, None], ids][:, None, None, :])
    return jnp.where(mask, s, NEG)


def _forward(bias, scale, blk, eps, t, reads, chunk, q, k, v, kst, qst, pst, seg, live_all=None):
  """q: [B, Tp, KVH, G, K], k: [B, Tp, KVH, K], v: [B, Tp, KVH, Kv] -> (o [B, Tp, KVH, G, Kv],
  logsumexp [nb, N, G, blk]). live_all: None (computed per block) or [nb, B, KVH, Tp] bool."""
  b, tp, kvh, grp, _ = q.shape
  nb = tp // blk
  live_of = _live(bias, q, k, (kst, qst, pst), scale, eps, t, nb, blk)

  def q_block(i, carry):
    o_buf, lse_buf = carry
    _, _, (m, l, acc) = _diag_start(bias, scale, blk, q, k, v, kst, qst, seg, i)
    live = live_of(i) if live_all is None else live_all[i]
    keys = bias.block_keys(kst, pst, i)
    blkx = _Block(bias, scale, q, k, v, kst, qst, pst, seg, i, blk)

    def run(sched):
      def step(s, state):
        m, l, acc = state
        bh, ids, valid = sched.item(s)
        kb = bias.key_bias(blkx.keys_of(keys, bh, ids), sched.take(blkx.qst, bh))
        sc = blkx.logits(sched, bh, ids, valid, kb)
        m_new = m.at[bh].max(sc.max(-1)) if sched.per_head else jnp.maximum(m, sc.max(-1))
        p = jnp.exp(sc - sched.take(m_new, bh)[..., None])
        pv = jnp.einsum("ngqk,nkd->ngqd", p.astype(v.dtype), blkx.v[bh[:, None], ids], preferred_element_type=F32)
        corr = jnp.exp(m - m_new)
        zero = lambda x: jnp.zeros(x.shape, F32)
        return m_new, l * corr + sched.add(zero(l), bh, p.sum(-1)), acc * corr[..., None] + sched.add(zero(acc), bh, pv)

      return jax.lax.fori_loop(0, sched.n_steps, step, (_flat(m), _flat(l), _flat(acc)))

    m, l, acc = _scheduled(reads, live, chunk, run)
    o_i = _unflat_tile(acc / l[..., None], b).astype(q.dtype)  # [B, bq, KVH, G, Kv]
    o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_i, i * blk, 1)
    return o_buf, jax.lax.dynamic_update_index_in_dim(lse_buf, m + jnp.log(l), i, 0)

  init = (jnp.zeros((b, tp, kvh, grp, v.shape[-1]), q.dtype), jnp.zeros((nb, b * kvh, grp, blk), F32))
  return jax.lax.fori_loop(0, nb, q_block, init)


def _live_all(bias, scale, blk, eps, t, q, k, kst, qst, pst):
  """[nb, B, KVH, Tp] bool: every query block's kept keys, saved for the backward pass (one bit
  of decision per (block, key), so that it reads exactly the forward's keys)."""
  nb = q.shape[1] // blk
  live_of = _live(bias, q, k, (kst, qst, pst), scale, eps, t, nb, blk)
  return jax.lax.map(live_of, jnp.arange(nb))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _core(bias, scale, blk, eps, t, reads, chunk, q, k, v, kst, qst, pst, seg):
  return _forward(bias, scale, blk, eps, t, reads, chunk, q, k, v, kst, qst, pst, seg)[0]


def _core_fwd(bias, scale, blk, eps, t, reads, chunk, q, k, v, kst, qst, pst, seg):
  live_all = _live_all(bias, scale, blk, eps, t, q, k, kst, qst, pst)
  o, lse = _forward(bias, scale, blk, eps, t, reads, chunk, q, k, v, kst, qst, pst, seg, live_all)
  return o, (q, k, v, kst, qst, pst, seg, o, lse, live_all)


def _core_bwd(bias, scale, blk, eps, t, reads, chunk, res, do):
  """Query block by query block (the forward's order): its diagonal tile as in `chunked`, then
  the same schedule over the same saved keys, p recomputed from the saved logsumexp; dQ is local
  to the block, dK / dV and the key statistics' cotangents are scatter-added at the read keys."""
  q, k, v, kst, qst, pst, seg, o, lse, live_all = res
  b, tp, kvh, grp, _ = q.shape
  nb = tp // blk
  # delta_i = do_i . o_i, [N, G, Tp]
  delta = _heads_first(jnp.sum(do.astype(F32) * o.astype(F32), -1)[..., None])[..., 0]
  zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, F32), t)

  def q_block(i, carry):
    dq, dk, dv, dkst, dqst, dpst = carry
    lse_i = lse[i]  # [N, G, bq]
    delta_i = jax.lax.dynamic_slice_in_dim(delta, i * blk, blk, axis=-1)
    # The diagonal tile: `chunked`'s tile backward, in its layout.
    doi = _tile(do, i, blk)
    unf = lambda x: x.reshape((b, kvh) + x.shape[1:])  # [N, ...] -> [B, KVH, ...]
    ops = (_tile(q, i, blk), _tile(k, i, blk), _tile(v, i, blk), doi)
    stats = (_takes(kst, i), _takes(qst, i), ())
    dq_i, dk_i, dv_i, (g_kst, g_qst, _) = _tile_grads(
      bias, scale, seg, i, i, True, None, ops, (unf(lse_i), unf(delta_i)), stats
    )
    rows = i * blk + jnp.arange(blk)
    dk = dk.at[:, rows].add(_heads_first(dk_i))
    dv = dv.at[:, rows].add(_heads_first(dv_i))
    dkst = jax.tree.map(lambda a, x: a.at[:, :, i].add(x), dkst, g_kst)

    # The kept keys before the block.
    keys, pull_keys = jax.vjp(lambda a, c: bias.block_keys(a, c, i), kst, pst)
    blkx = _Block(bias, scale, q, k, v, kst, qst, pst, seg, i, blk)
    do_f = _heads_first(doi)  # [N, G, bq, Kv]

    def run(sched):
      def step(s, c):
        dq_f, dk, dv, dkeys, dqst_f = c
        bh, ids, valid = sched.item(s)
        kb, pull_kb = jax.vjp(bias.key_bias, blkx.keys_of(keys, bh, ids), sched.take(blkx.qst, bh))
        sc = blkx.logits(sched, bh, ids, valid, kb)
        p = jnp.exp(sc - sched.take(lse_i, bh)[..., None])  # masked entries: exactly 0
        dog, at = sched.take(do_f, bh), (bh[:, None], ids)
        dv = dv.at[at].add(jnp.einsum("ngqk,ngqd->nkd", p.astype(do.dtype), dog, preferred_element_type=F32))
        dp = jnp.einsum("ngqd,nkd->ngqk", dog, blkx.v[at], preferred_element_type=F32)
        ds = jax.lax.optimization_barrier(p * (dp - sched.take(delta_i, bh)[..., None]))
        dq_f = sched.add(dq_f, bh, jnp.einsum("ngqk,nkd->ngqd", ds, blkx.k[at], preferred_element_type=F32) * scale)
        dqg = jnp.einsum("ngqk,ngqd->nkd", ds, sched.take(blkx.q, bh), preferred_element_type=F32) * scale
        dk = dk.at[at].add(dqg)
        g_keys, g_q = pull_kb(ds.sum(1, keepdims=True))
        dkeys = [d.at[at].add(g[:, 0]) for d, g in zip(dkeys, g_keys)]
        dqst_f = jax.tree.map(lambda a, x: sched.add(a, bh, x), dqst_f, g_q)
        return dq_f, dk, dv, dkeys, dqst_f

      init = (jnp.zeros(blkx.q.shape, F32), dk, dv, [jnp.zeros(_flat(x).shape, F32) for x in keys], zeros(blkx.qst))
      return jax.lax.fori_loop(0, sched.n_steps, step, init)

    dq_f, dk, dv, dkeys, dqst_f = _scheduled(reads, live_all[i], chunk, run)
    g_kst2, g_pst = pull_keys(tuple(d.reshape(x.shape) for d, x in zip(dkeys, keys)))
    dkst = jax.tree.map(jnp.add, dkst, g_kst2)
    dpst = jax.tree.map(jnp.add, dpst, g_pst)
    g_qst = jax.tree.map(lambda a, x: a + x.reshape(a.shape), g_qst, dqst_f)
    dqst = jax.tree.map(lambda a, x: a.at[:, :, i].add(x), dqst, g_qst)
    dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_i + _unflat_tile(dq_f, b), i * blk, 1)
    return dq, dk, dv, dkst, dqst, dpst

  n = b * kvh
  init = (
    jnp.zeros(q.shape, F32),
    jnp.zeros((n, tp, k.shape[-1]), F32),
    jnp.zeros((n, tp, v.shape[-1]), F32),
    zeros(kst),
    zeros(qst),
    zeros(pst),
  )
  dq, dk, dv, dkst, dqst, dpst = jax.lax.fori_loop(0, nb, q_block, init)
  back = lambda x, like: jnp.moveaxis(x.reshape((b, kvh) + x.shape[1:]), 1, 2).astype(like.dtype)
  return (dq.astype(q.dtype), back(dk, k), back(dv, v), dkst, dqst, dpst, None)


_core.defvjp(_core_fwd, _core_bwd)


def _prepare(q, k, v, bias, segment_ids, block_size):
  b, t, h, d = q.shape
  kvh = k.shape[2]
  blk = block_for(t, block_size)
  nb = -(-t // blk)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, nb * blk - t), (0, 0), (0, 0)]) if nb * blk != t else x
  seg = None
  if segment_ids is not None:
    seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, nb * blk - t)], constant_values=-1)
    seg = seg.reshape(b, nb, blk)  # the chunked kernel's layout (its diagonal tile reads it)
  qg = pad(q).reshape(b, nb * blk, kvh, h // kvh, d)
  return blk, nb, qg, pad(k), pad(v), seg, bias.stats(nb, blk)


def _check(reads, key_chunk, blk):
  if reads not in READS:
    raise ValueError(f"reads={reads!r}: must be one of {READS}")
  chunk = blk if key_chunk is None else int(key_chunk)
  if chunk < 1 or blk % chunk:
    raise ValueError(f"key_chunk={key_chunk!r} must divide the block size {blk} (or be None: the block size)")
  return chunk


def key_sparse_attention(
  q, k, v, bias: Bias, *, scale, skip_tolerance, segment_ids=None, block_size=None, reads="auto", key_chunk=None
):
  """Causal attention with an FPA or FoX bias reading only the keys the bound keeps (module
  docstring), differentiable. q: [B, T, H, K], k: [B, T, KVH, K], v: [B, T, KVH, Kv] -> [B, T, H, Kv];
  bias: `ops.bias.FPABias` or `FoXBias` over [B, T, KVH]; skip_tolerance eps in (0, 1): each row
  loses <= eps of its attention. reads: how the kept keys are scheduled, "auto" (default),
  "shared" or "per_head" (module docstring, "Reads"); key_chunk: keys per gathered chunk, a
  divisor of the block size (default: the block size)."""
  b, t, h, _ = q.shape
  if b == 0 or t == 0:
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  blk, nb, qg, kp, vp, seg, (kst, qst, pst) = _prepare(q, k, v, bias, segment_ids, block_size)
  chunk = _check(reads, key_chunk, blk)
  o = _core(type(bias), float(scale), blk, float(skip_tolerance), t, reads, chunk, qg, kp, vp, kst, qst, pst, seg)
  return o.reshape(b, nb * blk, h, -1)[:, :t]


def live_keys(q, k, bias: Bias, *, skip_tolerance, scale=None, block_size=None):
  """The keys `key_sparse_attention` reads besides each diagonal tile: [B, KVH, nb, T] bool, True
  where key j (< the block's first query) is kept for query block I. q: [B, T, H, K], k: [B, T,
  KVH, K]; scale defaults to K ** -0.5."""
  b, t, h, d = q.shape
  scale = d**-0.5 if scale is None else float(scale)
  blk, nb, qg, kp, _, _, (kst, qst, pst) = _prepare(q, k, k, bias, None, block_size)
  live = _live_all(type(bias), scale, blk, float(skip_tolerance), t, qg, kp, kst, qst, pst)
  return jnp.moveaxis(live, 0, 2)[..., :t]


def live_key_stats(q, k, bias: Bias, *, skip_tolerance, scale=None, block_size=None, key_chunk=None) -> dict:
  """How much of the off-diagonal key reads `key_sparse_attention` keeps and reads, on these
  inputs (floats, shares of the keys before each query block summed over blocks, per (batch row,
  kv head)): kept_per_head: kept, mean over (row, kv head); read (= read_shared): what the shared
  schedule reads (C x the densest head's chunks, every head); read_per_head: the per_head
  schedule (its steps x C: each head's own chunks, rounded up to C, plus the last step's unused
  items); read_auto: the schedule `reads="auto"` picks per block; per_head_blocks: the share of
  blocks where it picks per_head."""
  blk = block_for(q.shape[1], block_size)
  c = _check("auto", key_chunk, blk)
  counts = live_keys(q, k, bias, skip_tolerance=skip_tolerance, scale=scale, block_size=block_size).sum(-1)
  counts = counts.reshape((-1,) + counts.shape[2:])  # [N, nb]
  n, nb = counts.shape
  total = max(blk * nb * (nb - 1) // 2, 1)  # keys before block I: I * blk
  chunks = -(-counts // c)
  shared = chunks.max(0) * c  # [nb], per head
  per_head = -(-chunks.sum(0) // n) * c
  pick = chunks.sum(0) * PER_HEAD_COST < chunks.max(0) * n
  return {
    "kept_per_head": float(counts.sum(-1).mean()) / total,
    "read": float(shared.sum()) / total,
    "read_shared": float(shared.sum()) / total,
    "read_per_head": float(per_head.sum()) / total,
    "read_auto": float(jnp.where(pick, per_head, shared).sum()) / total,
    "per_head_blocks": float(pick[1:].mean()) if nb > 1 else 0.0,
  }
