"""Flash-style tiled attention with a first-passage (or FoX) bias; O(T * block) memory.

Tiling identity. For a query block I strictly after a key block J, the range (j, i] splits into
the rest of J after j, the whole blocks strictly between, and the start of I up to i:

    min(field over (j, i]) = min(S_j, R[I, J], C_i)
      S_j     = min of the field in J after j            (key-only, per token)
      R[I, J] = min of the block minima strictly between  (one scalar per block pair, [nb, nb])
      C_i     = min of the field in I up to and incl. i   (query-only, per token)

so an off-diagonal tile's bias is -relu(level_j - min(S_j, R[I, J], C_i)): O(block^2) elementwise
work like FoX's c_i - c_j. Diagonal tiles use an in-tile associative min-scan down each column.

Gradients. S, C and R are computed *outside* the custom VJP by plain differentiable JAX; the core
treats them as inputs. In the backward pass each tile re-computes its bias under `jax.vjp` and
pulls the softmax cotangent back to (S, C, R, level) or, on the diagonal, to (level, field); JAX
autodiff then routes S, C, R through the min-scans to the field. Both tile biases carry
hand-written pullbacks (`_fpa_bias`, `_diag_bias`): autodiff of min/relu and of the scan was the
backward pass's bottleneck. Nothing T x T is ever stored: the forward keeps out and logsumexp,
the backward recomputes tiles (FlashAttention-2 order: outer loop over key blocks, dK/dV local).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fpa_jax.ops.validate import STATS_DTYPE

DEFAULT_BLOCK = 256
# Finite mask value: exp(NEG - m) == 0 without any inf - inf.
NEG = -1e30
F32 = STATS_DTYPE


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
  R[I, J]) -> [B, H, bq, bk]. With A_j = min(S_j, R) the bias is -max(relu(level_j - A_j),
  level_j - C_i): two elementwise passes, fused into the logits.
  """
  a = jnp.minimum(suffix, r)
  return -jnp.maximum(jax.nn.relu(lvl - a), lvl - prefix)


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
  # The penalty is level_j - A_j where C_i >= A_j and level_j > A_j ...
  d_a = jnp.where(lvl > a, jnp.where(prefix >= a, g, 0.0).sum(-2, keepdims=True), 0.0)
  # ... and level_j - C_i where C_i < min(A_j, level_j).
  g_c = jnp.where(prefix < jnp.minimum(a, lvl), g, 0.0)
  to_s = suffix <= r
  return (-(d_a + g_c.sum(-2, keepdims=True)), jnp.where(to_s, d_a, 0.0), g_c.sum(-1, keepdims=True),
          jnp.where(to_s, 0.0, d_a).sum(-1, keepdims=True))


_fpa_bias.defvjp(_fpa_bias_fwd, _fpa_bias_bwd)

def _scan_stats(phi):
  """Within-block min statistics of phi [..., nb, blk]: (S, C, R) as in the module docstring."""
  nb = phi.shape[-2]
  inf = jnp.full(phi.shape[:-1] + (1,), jnp.inf, F32)
  suffix = jnp.concatenate([_min_scan(phi, -1, reverse=True)[..., 1:], inf], -1)  # S_j, excl. j
  prefix = _min_scan(phi, -1)  # C_i, incl. i
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
  return -jax.nn.relu(lvl[..., None, :] - _column_min(phi))


def _diag_bias_fwd(lvl, phi):
  m = _column_min(phi)
  # The pullback runs in the same tile iteration of the backward loop, so keeping the tile-sized
  # m costs no extra peak memory and saves re-running the scan.
  return -jax.nn.relu(lvl[..., None, :] - m), (lvl, phi, m)


def _diag_bias_bwd(res, g):
  # Autodiff through the associative scan costs ~100 tile-sized passes; this is a handful.
  # Column j's running min is phi_s exactly for rows s <= i < nse(s) (the next *strictly*
  # smaller field value after s) and keys pse(s) <= j < s (pse: the last earlier position with
  # field <= phi_s; ties go to the earliest position, a valid subgradient), so
  #   d phi_s = sum_{j = pse(s)}^{s-1} sum_{i = s}^{nse(s) - 1} dm[i, j]
  # a difference of column prefix sums.
  lvl, phi, m = res
  n = phi.shape[-1]
  dm = jnp.where(lvl[..., None, :] > m, g, 0.0)  # bias = m - level where the penalty is active
  idx = jnp.arange(n)
  after = idx[None, :] > idx[:, None]  # [s, t]: t after s
  nse = jnp.where(after & (phi[..., None, :] < phi[..., :, None]), idx, n).min(-1)  # [..., n]
  pse = jnp.where(after.T & (phi[..., None, :] <= phi[..., :, None]), idx, -1).max(-1)
  cum = jax.lax.associative_scan(jnp.add, dm, axis=dm.ndim - 2)  # 2x faster than jnp.cumsum on CPU
  end = jnp.take_along_axis(cum, jnp.broadcast_to((nse - 1)[..., :, None], cum.shape), axis=-2)
  rows = end - cum + dm  # [s, j] = sum_{i = s}^{nse(s) - 1} dm[i, j]
  took = (idx[None, :] < idx[:, None]) & (idx[None, :] >= pse[..., :, None])  # [s, j]
  return -dm.sum(-2), jnp.where(took, rows, 0.0).sum(-1)


_diag_bias.defvjp(_diag_bias_fwd, _diag_bias_bwd)


class FPAGate:
  """First-passage bias from field / level [B, T, H]."""

  def __init__(self, field, level):
    self.field, self.level = field, level

  def stats(self, nb, blk):
    phi = _blocks(self.field.astype(F32), nb, blk)  # [B, H, nb, blk]
    lvl = _blocks(self.level.astype(F32), nb, blk)
    suffix, prefix, r = _scan_stats(phi)
    return (lvl, suffix), (prefix, phi), (r,)

  @staticmethod
  def off_bias(kst, qst, pst):
    (lvl, suffix), (prefix, _), (r,) = kst, qst, pst
    return _fpa_bias(lvl[..., None, :], suffix[..., None, :], prefix[..., :, None], r[..., None, None])

  @staticmethod
  def diag_bias(kst, qst):
    (lvl, _), (_, phi) = kst, qst
    return _diag_bias(lvl, phi)


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


def _take(x, i, axis=2):
  return jax.lax.dynamic_index_in_dim(x, i, axis=axis, keepdims=False)


def _takes(tree, i):
  return jax.tree.map(lambda x: _take(x, i), tree)


def _pair(pst, i, j):
  return jax.tree.map(lambda x: x[:, :, i, j], pst)


def _tile(x, i, blk):
  """Rows [i * blk, (i + 1) * blk) of a [B, T, H, K] array (no transposed copies of q/k/v)."""
  return jax.lax.dynamic_slice_in_dim(x, i * blk, blk, axis=1)


def _logits(q, k, bias, scale, seg, i, j, causal):
  """q: [B, bq, H, K], k: [B, bk, H, K], bias: [B, H, bq, bk] -> masked logits [B, H, bq, bk]."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) * scale + bias
  mask = None
  if causal:
    n = s.shape[-1]
    mask = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
  if seg is not None:
    sm = _take(seg, i, 1)[:, None, :, None] == _take(seg, j, 1)[:, None, None, :]
    mask = sm if mask is None else mask & sm
  return s if mask is None else jnp.where(mask, s, NEG)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _core(gate, scale, blk, q, k, v, kst, qst, pst, seg):
  return _forward(gate, scale, blk, q, k, v, kst, qst, pst, seg)[0]


def _forward(gate, scale, blk, q, k, v, kst, qst, pst, seg):
  """q, k: [B, Tp, H, K], v: [B, Tp, H, Kv] -> (o [B, Tp, H, Kv], logsumexp [B, H, nb, blk])."""
  b, tp, h, _ = q.shape
  nb = tp // blk

  def q_block(i, carry):
    o_buf, lse_buf = carry
    qi, qsti = _tile(q, i, blk), _takes(qst, i)
    s = _logits(qi, _tile(k, i, blk), gate.diag_bias(_takes(kst, i), qsti), scale, seg, i, i, True)
    m = s.max(-1)  # [B, H, bq]; the diagonal entry is always unmasked, so m is finite
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    acc = jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), _tile(v, i, blk), preferred_element_type=F32)

    def kv_block(j, c):
      m, l, acc = c
      bias = gate.off_bias(_takes(kst, j), qsti, _pair(pst, i, j))
      s = _logits(qi, _tile(k, j, blk), bias, scale, seg, i, j, False)
      m_new = jnp.maximum(m, s.max(-1))
      corr = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[..., None])
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum(
          "bhqk,bkhd->bhqd", p.astype(v.dtype), _tile(v, j, blk), preferred_element_type=F32)
      return m_new, l, acc

    m, l, acc = jax.lax.fori_loop(0, i, kv_block, (m, l, acc))
    o_i = jnp.swapaxes(acc / l[..., None], 1, 2).astype(q.dtype)  # [B, bq, H, Kv]
    o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_i, i * blk, 1)
    lse_buf = jax.lax.dynamic_update_index_in_dim(lse_buf, m + jnp.log(l), i, 2)
    return o_buf, lse_buf

  init = (jnp.zeros((b, tp, h, v.shape[-1]), q.dtype), jnp.zeros((b, h, nb, blk), F32))
  return jax.lax.fori_loop(0, nb, q_block, init)


def _core_fwd(gate, scale, blk, q, k, v, kst, qst, pst, seg):
  o, lse = _forward(gate, scale, blk, q, k, v, kst, qst, pst, seg)
  return o, (q, k, v, kst, qst, pst, seg, o, lse)


def _core_bwd(gate, scale, blk, res, do):
  q, k, v, kst, qst, pst, seg, o, lse = res
  b, tp, h, _ = q.shape
  nb = tp // blk
  # delta_i = do_i . o_i, in the stats layout [B, H, nb, blk].
  delta = jnp.moveaxis(jnp.sum(do.astype(F32) * o.astype(F32), -1), 2, 1).reshape(b, h, nb, blk)
  zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, F32), t)

  def k_block(j, carry):
    dq, dqst, dpst, dk, dv, dkst = carry
    kj, vj, kstj = _tile(k, j, blk), _tile(v, j, blk), _takes(kst, j)

    def tile(i, c, diag):
      dq, dqst, dpst, dkj, dvj, dkstj = c
      qi, doi, qsti = _tile(q, i, blk), _tile(do, i, blk), _takes(qst, i)
      if diag:
        bias, pull = jax.vjp(gate.diag_bias, kstj, qsti)
      else:
        bias, pull = jax.vjp(gate.off_bias, kstj, qsti, _pair(pst, i, j))
      s = _logits(qi, kj, bias, scale, seg, i, j, diag)
      p = jnp.exp(s - _take(lse, i)[..., None])  # masked entries: exactly 0
      dvj = dvj + jnp.einsum("bhqk,bqhd->bkhd", p.astype(do.dtype), doi, preferred_element_type=F32)
      dp = jnp.einsum("bqhd,bkhd->bhqk", doi, vj, preferred_element_type=F32)
      ds = p * (dp - _take(delta, i)[..., None])  # d loss / d logit (= d loss / d bias)
      dq_i = jnp.einsum("bhqk,bkhd->bqhd", ds, kj, preferred_element_type=F32) * scale
      dq = jax.lax.dynamic_update_slice_in_dim(dq, _tile(dq, i, blk) + dq_i, i * blk, 1)
      dkj = dkj + jnp.einsum("bhqk,bqhd->bkhd", ds, qi, preferred_element_type=F32) * scale
      g = pull(ds)
      dkstj = jax.tree.map(jnp.add, dkstj, g[0])
      dqst = jax.tree.map(lambda a, x: a.at[:, :, i].add(x), dqst, g[1])
      if not diag:
        dpst = jax.tree.map(lambda a, x: a.at[:, :, i, j].add(x), dpst, g[2])
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
  init = (jnp.zeros(q.shape, F32), zeros(qst), zeros(pst), jnp.zeros(k.shape, k.dtype),
          jnp.zeros(v.shape, v.dtype), zeros(kst))
  dq, dqst, dpst, dk, dv, dkst = jax.lax.fori_loop(0, nb, k_block, init)
  return (dq.astype(q.dtype), dk, dv, dkst, dqst, dpst, None)


_core.defvjp(_core_fwd, _core_bwd)


def _round_up(x, m):
  return -(-x // m) * m


def block_for(t: int, block_size: int | None) -> int:
  """The tile size used for length t: the requested size, shrunk for short sequences."""
  blk = DEFAULT_BLOCK if block_size is None else int(block_size)
  if blk < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size}")
  return min(blk, _round_up(t, 8))


def chunked_attention(q, k, v, gate, *, scale, segment_ids=None, block_size=None):
  """Tiled causal attention with a gate bias. q, k: [B, T, H, K], v: [B, T, H, Kv] -> [B, T, H, Kv].

  `gate` is an `FPAGate` or `FoXGate`. Any T: the sequence is padded to a multiple of the block
  at the end, where causality alone keeps padding out of every real query.
  """
  b, t, h, _ = q.shape
  blk = block_for(t, block_size)
  nb = -(-t // blk)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, nb * blk - t), (0, 0), (0, 0)]) if nb * blk != t else x
  kst, qst, pst = gate.stats(nb, blk)
  seg = None
  if segment_ids is not None:
    seg = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, nb * blk - t)], constant_values=-1)
    seg = seg.reshape(b, nb, blk)
  o = _core(type(gate), float(scale), blk, pad(q), pad(k), pad(v), kst, qst, pst, seg)
  return o[:, :t]
