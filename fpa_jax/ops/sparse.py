"""Key-sparse prefill: the chunked forward pass reading, per query block, only the keys that the
skip bound cannot rule out (`skip="keys"`); forward only.

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

so each of its weights is <= eps / T and each row loses total weight <= eps: each output
component moves by <= 2 eps max|v|, the guarantee of tile skipping. Keys j >= i0 (the diagonal
tile) are always read, exactly as in `chunked`.

Cost. Per query block: the floor and the test, O(T) elementwise; the live keys compacted in key
order (a cumulative sum and a scatter, O(T)); then ceil(n / blk) gathered chunks of blk keys, n the
largest live count over (batch row, kv head) of the block: every row and head of a call shares the
chunk loop (one batched matmul per chunk), so the work follows the densest head. The loop length
is data dependent (a while loop), which is why there is no backward pass: differentiating raises a
ValueError (train with `skip="tiles"`, whose backward skips the same tiles as its forward).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fpa_jax.ops.bias import Bias, blocks
from fpa_jax.ops.chunked import F32, NEG, _diag_start, _online_step, _take, _takes, block_for

FORWARD_ONLY = (
  "skip='keys' (key-sparse prefill) is forward only: its loop over live keys has a data-dependent "
  "length. Differentiate with skip='tiles' (the chunked kernel skips dead tiles in its backward too) "
  "or skip_tolerance=None."
)


def _block_bounds(q, k, scale, nb, blk):
  """(|q|_I, s_I), each [B, KVH, nb]: the block's largest query norm and smallest diagonal logit,
  over the query group too. q: [B, Tp, KVH, G, K], k: [B, Tp, KVH, K] (zero-padded)."""
  qf, kf = q.astype(F32), k.astype(F32)
  qn = jnp.sqrt(jnp.sum(jnp.square(qf), -1)).max(-1)  # [B, Tp, KVH]
  sii = (jnp.einsum("bthgd,bthd->bthg", qf, kf) * scale).min(-1)
  per_block = lambda x, red: red(blocks(x, nb, blk), -1)
  return per_block(qn, jnp.max), per_block(sii, jnp.min)


def _live(bias, q, k, stats, scale, eps, t, nb, blk):
  """live(i) -> (live [B, KVH, Tp] bool, keys): block i's keys j < i0 that the bound keeps."""
  kst, qst, pst = stats
  qn, s_min = _block_bounds(q, k, scale, nb, blk)
  kn = jnp.sqrt(jnp.sum(jnp.square(k.astype(F32)), -1))  # [B, Tp, KVH]
  kn = jnp.moveaxis(kn, 1, 2)  # [B, KVH, Tp]
  slack = math.log(t) - math.log(eps)
  jpos = jnp.arange(nb * blk)

  def live(i):
    keys = bias.block_keys(kst, pst, i)
    thr = abs(scale) * _take(qn, i)[..., None] * kn - _take(s_min, i)[..., None] + slack
    return (bias.key_floor(keys, _takes(qst, i)) < thr) & (jpos < i * blk), keys

  return live


def _compact(live):
  """live [B, H, Tp] bool -> (idx [B, H, Tp] int32: the live positions first, in key order; count [B, H])."""
  tp = live.shape[-1]
  pos = jnp.where(live, jnp.cumsum(live, -1) - 1, tp)  # tp: out of range, dropped by the scatter
  scatter = lambda p: jnp.zeros((tp,), jnp.int32).at[p].set(jnp.arange(tp, dtype=jnp.int32), mode="drop")
  idx = jax.vmap(jax.vmap(scatter))(pos)
  return idx, live.sum(-1)


def _gather(x, ids):
  """x [B, H, Tp, ...] at ids [B, H, C] -> [B, H, C, ...]."""
  return jnp.take_along_axis(x, ids.reshape(ids.shape + (1,) * (x.ndim - 3)), axis=2)


def _forward(bias, scale, blk, eps, t, q, k, v, kst, qst, pst, seg):
  """q: [B, Tp, KVH, G, K], k: [B, Tp, KVH, K], v: [B, Tp, KVH, Kv] -> o [B, Tp, KVH, G, Kv]."""
  b, tp, kvh, grp, _ = q.shape
  nb = tp // blk
  live_of = _live(bias, q, k, (kst, qst, pst), scale, eps, t, nb, blk)
  k_t, v_t = jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2)  # [B, KVH, Tp, .]: gathered per head
  seg_k = None if seg is None else jnp.broadcast_to(seg.reshape(b, 1, tp), (b, kvh, tp))

  def q_block(i, o_buf):
    qi, qsti, state = _diag_start(bias, scale, blk, q, k, v, kst, qst, seg, i)
    live, keys = live_of(i)
    idx, count = _compact(live)

    def chunk(c, state):
      ids = jax.lax.dynamic_slice_in_dim(idx, c * blk, blk, axis=-1)  # [B, KVH, blk]
      valid = (c * blk + jnp.arange(blk)) < count[..., None]
      kb = bias.key_bias([jnp.take_along_axis(x, ids, -1) for x in keys], qsti)
      s = jnp.einsum("bqhgd,bhkd->bhgqk", qi, _gather(k_t, ids), preferred_element_type=F32) * scale
      mask = valid[:, :, None, None, :]
      if seg is not None:
        sq = _take(seg, i, 1)
        mask = mask & (sq[:, None, None, :, None] == jnp.take_along_axis(seg_k, ids, -1)[:, :, None, None, :])
      s = jnp.where(mask, s + kb[:, :, None], NEG)
      return _online_step(state, s, _gather(v_t, ids), "bhkd")

    n_chunks = (count.max() + blk - 1) // blk
    _, l, acc = jax.lax.fori_loop(0, n_chunks, chunk, state)
    o_i = jnp.moveaxis(acc / l[..., None], 3, 1).astype(q.dtype)  # [B, bq, KVH, G, Kv]
    return jax.lax.dynamic_update_slice_in_dim(o_buf, o_i, i * blk, 1)

  return jax.lax.fori_loop(0, nb, q_block, jnp.zeros((b, tp, kvh, grp, v.shape[-1]), q.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _core(bias, scale, blk, eps, t, q, k, v, kst, qst, pst, seg):
  return _forward(bias, scale, blk, eps, t, q, k, v, kst, qst, pst, seg)


def _core_fwd(*args):
  raise ValueError(FORWARD_ONLY)


def _core_bwd(*args):  # never reached: _core_fwd raises when a gradient is traced
  raise ValueError(FORWARD_ONLY)


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


def key_sparse_attention(q, k, v, bias: Bias, *, scale, skip_tolerance, segment_ids=None, block_size=None):
  """Causal attention with an FPA or FoX bias reading only the keys the bound keeps (module
  docstring). q: [B, T, H, K], k: [B, T, KVH, K], v: [B, T, KVH, Kv] -> [B, T, H, Kv]; bias:
  `ops.bias.FPABias` or `FoXBias` over [B, T, KVH]; skip_tolerance eps in (0, 1): each row loses <= eps of
  its attention. Forward only (a gradient raises ValueError)."""
  b, t, h, _ = q.shape
  if b == 0 or t == 0:
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  blk, nb, qg, kp, vp, seg, (kst, qst, pst) = _prepare(q, k, v, bias, segment_ids, block_size)
  o = _core(type(bias), float(scale), blk, float(skip_tolerance), t, qg, kp, vp, kst, qst, pst, seg)
  return o.reshape(b, nb * blk, h, -1)[:, :t]


def live_keys(q, k, bias: Bias, *, skip_tolerance, scale=None, block_size=None):
  """The keys `key_sparse_attention` reads besides each diagonal tile: [B, KVH, nb, T] bool, True
  where key j (< the block's first query) is kept for query block I. q: [B, T, H, K], k: [B, T,
  KVH, K]; scale defaults to K ** -0.5."""
  b, t, h, d = q.shape
  scale = d**-0.5 if scale is None else float(scale)
  blk, nb, qg, kp, _, _, stats = _prepare(q, k, k, bias, None, block_size)
  live_of = _live(type(bias), qg, kp, stats, scale, float(skip_tolerance), t, nb, blk)
  return jnp.moveaxis(jax.lax.map(lambda i: live_of(i)[0], jnp.arange(nb)), 0, 2)[..., :t]


def live_key_stats(q, k, bias: Bias, *, skip_tolerance, scale=None, block_size=None) -> dict:
  """How much of the off-diagonal key reads `key_sparse_attention` keeps, on these inputs (floats):
  kept_per_head: kept keys / keys before each query block, summed over blocks, mean over (batch,
  kv head); read: what the shared chunk loop reads (blk x chunks, the densest head of each block)
  over the same total: its off-diagonal work against the exact kernel's."""
  blk = block_for(q.shape[1], block_size)
  counts = live_keys(q, k, bias, skip_tolerance=skip_tolerance, scale=scale, block_size=block_size).sum(-1)
  nb = counts.shape[-1]
  total = max(blk * nb * (nb - 1) // 2, 1)  # keys before block I: I * blk
  read = -(-counts.max((0, 1)) // blk) * blk
  return {"kept_per_head": float(counts.sum(-1).mean()) / total, "read": float(read.sum()) / total}
