"""Chunked prefill against a cache: a chunk of new tokens attends to the cached keys (with their
first-passage state) and, causally, to each other. Exact; fp32 statistics.

The chunk continues the cached sequence: its T queries and keys come after every cached key. For a
cached key j and the chunk's query i (0-based in the chunk), the range (j, i] is the rest of the
cached sequence after j and the chunk up to i, so

    min(field over (j, i]) = min(m_j, C_i)
      m_j  the cached running min of the field over (j, last cached token]  (`recurrent.
           RecurrentCache.run_min`, `fpa_jax.inference.cache.LayerCache.run_min`; +inf for the
           newest key)
      C_i  the min of the chunk's field over [0, i]                          (a prefix min)

and penalty[i, j] = dip(level_j, min(m_j, C_i)): the tiling identity of `chunked` with the whole
cache as one key block (A_j = m_j) and the chunk as the query block. A chunk key j' <= i has the
first-passage penalty inside the chunk (`penalty.penalty_matrix`). After the chunk a cached key's
running min is min(m_j, min of the chunk's field) and a chunk key's the suffix min after it
(`first_passage.advance`, `first_passage.suffix_min`): the caller's cache update.

FoX (`fox_prefix_attention`) is the monotone special case field = level = c, the running sum of
the log forget gate continued from the cache's `carry`; a cached key's running min is then the
carry itself and the bias c_i - c_j.

Cost. The chunk's own attention is materialised, [T, T] per (row, kv head) (a chunk is a turn of a
conversation, not a book: prefill a long prompt in several chunks); the cached slots are read in
blocks of `block_size` with an online softmax, up to the last valid slot of any row and head (a
data-dependent loop length: the op is for inference, forward only), so the cache adds
O(T * block_size) memory and O(T * held slots) work, never an [S, S] or a re-run over the cached
tokens. `inference.cache` fills its slots from the first, so that bound is about the keys it holds.

Non-finite values (`validate.ALLOWED`): the chunk's gates as in `attention.fpa_attention` (NaN
rows from a bad token on); a NaN in a valid slot's cached level or running min makes every row of
the chunk in that kv head's query heads NaN (the cache's rows at and after the bad token: as
`recurrent.decode_step`, which stores a bad value as NaN state). Concrete arrays raise ValueError.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fpa_jax.ops import validate as _v
from fpa_jax.ops.common import F32
from fpa_jax.ops.first_passage import dip, min_scan
from fpa_jax.ops.penalty import penalty_matrix

DEFAULT_BLOCK = 256  # cached slots per online-softmax step
NEG = -1e30  # finite mask value: exp(NEG - m) == 0 without any inf - inf


class CachedKeys(NamedTuple):
  """The keys a chunk attends to besides its own, per kv head (the slots of a decode cache).

  k: [B, S, KVH, K], v: [B, S, KVH, Kv] in the chunk's dtype.
  level: [B, S, KVH] the keys' levels (FoX: their running sum c_j).
  run_min: [B, S, KVH] the min of the field over (j, last cached token] (+inf for the newest key;
    ignored by `fox_prefix_attention`).
  valid: [B, S, KVH] bool, True where the slot holds a key the chunk attends to (alive, same
    sequence); the other slots' values are never read.
  """

  k: jax.Array
  v: jax.Array
  level: jax.Array
  run_min: jax.Array
  valid: jax.Array


def _check(q, k, v, cached: CachedKeys, gates: dict) -> tuple[int, int, int, int, int]:
  b, t, h, kvh, d = _v.check_qkv(q, k, v)
  for name, x in gates.items():
    _v.check_gate(name, x, (b, t, kvh))
  if getattr(cached.k, "ndim", None) != 4 or cached.k.shape[0] != b or cached.k.shape[2:] != (kvh, d):
    raise ValueError(
      f"cached.k must be [batch, slots, kv_heads, head_dim] = [{b}, S, {kvh}, {d}] (the chunk's k "
      f"{tuple(k.shape)}), got {getattr(cached.k, 'shape', None)}"
    )
  s = cached.k.shape[1]
  if getattr(cached.v, "shape", None) != (b, s, kvh, v.shape[-1]):
    raise ValueError(
      f"cached.v must be [batch, slots, kv_heads, v_dim] = {(b, s, kvh, v.shape[-1])}, got {cached.v.shape}"
    )
  if cached.k.dtype != k.dtype or cached.v.dtype != v.dtype:
    raise ValueError(
      f"cached.k / cached.v must have the chunk's dtype {k.dtype}, got {cached.k.dtype}, {cached.v.dtype}"
    )
  for name in ("level", "run_min", "valid"):
    x = getattr(cached, name)
    if getattr(x, "shape", None) != (b, s, kvh):
      raise ValueError(
        f"cached.{name} must be [batch, slots, kv_heads] = {(b, s, kvh)}, got {getattr(x, 'shape', None)}"
      )
  if cached.valid.dtype != jnp.bool_:
    raise ValueError(f"cached.valid must be a bool array (True: the slot holds a key), got dtype {cached.valid.dtype}")
  axes = ("batch", "slot", "kv head")
  _v.check_gate_values("level", cached.level, axes, label="cached.level", mask=cached.valid)
  _v.check_gate_values("field", cached.run_min, axes, label="cached.run_min", mask=cached.valid)
  for name, x in gates.items():
    _v.check_gate_values(name, x)
  return b, t, h, kvh, d


def prefix_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  field: jax.Array,
  level: jax.Array,
  cached: CachedKeys,
  *,
  scale: float | None = None,
  block_size: int | None = None,
) -> jax.Array:
  """First Passage Attention of a chunk that continues a cached sequence.

      out_i = softmax over {cached j: valid} and {chunk j' <= i} of
              scale q_i.k_j - dip(level_j, min(m_j, C_i))  and  scale q_i.k_j' - penalty_chunk[i, j']

  Args:
    q: [batch, chunk, heads, head_dim]; k: [batch, chunk, kv_heads, head_dim]; v: [batch, chunk,
      kv_heads, v_dim]; field, level: [batch, chunk, kv_heads] the chunk's gates (a right-padded chunk
      is fine: padding comes after every real query and never reaches its rows).
    cached: `CachedKeys` of S slots per kv head (S = 0: plain `fpa_attention` of the chunk).
    scale: logit scale, default head_dim ** -0.5. block_size: cached slots per online-softmax step.
  Returns:
    [batch, chunk, heads, v_dim] in q's dtype. Equal, up to fp32 reduction order, to the chunk's
    rows of `fpa_attention` over the whole sequence when `cached` holds every earlier key with its
    running min (tests/ops/test_prefix.py).
  """
  b, t, h, _, d = _check(q, k, v, cached, {"field": field, "level": level})
  if _v.is_empty(b, t):
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
    raise ValueError(f"block_size must be a positive int (cached slots per step), got {block_size!r}")
  return _prefix_core(q, k, v, field, level, cached, scale=_v.default_scale(scale, d), block_size=block_size)


def fox_prefix_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_fgate: jax.Array,
  cached: CachedKeys,
  carry: jax.Array,
  *,
  scale: float | None = None,
  block_size: int | None = None,
) -> jax.Array:
  """Forgetting Attention (FoX) of a chunk that continues a cached sequence: logit_ij = scale
  q_i.k_j + c_i - c_j with c the running sum of log_fgate, c_i = carry + sum of the chunk's
  log_fgate through i.

  Args:
    log_fgate: [batch, chunk, kv_heads] <= 0 (positive entries: ValueError where concrete, clamped
      to 0 under jit, as `fox_attention`).
    cached: `CachedKeys` whose `level` is each key's c_j (its run_min is not read).
    carry: [batch, kv_heads] c of the last cached token (0 for an empty cache).
    Others as in `prefix_attention`.
  """
  b, t, h, kvh, d = _check(q, k, v, cached, {"log_fgate": log_fgate})
  _v.check_log_fgate(log_fgate)
  if getattr(carry, "shape", None) != (b, kvh):
    raise ValueError(f"carry must be [batch, kv_heads] = {(b, kvh)}, got {getattr(carry, 'shape', None)}")
  if _v.is_empty(b, t):
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  return _fox_prefix_core(q, k, v, log_fgate, cached, carry, scale=_v.default_scale(scale, d), block_size=block_size)


@functools.partial(jax.jit, static_argnames=("scale", "block_size"))
def _fox_prefix_core(q, k, v, log_fgate, cached, carry, *, scale, block_size):
  gates, bad = _v.sanitize_gates({"log_fgate": log_fgate})
  c = carry.astype(F32)[:, None] + jnp.cumsum(_v.clamp_log_fgate(gates["log_fgate"]), axis=1)
  # monotone c: a cached key's running min is the carry (c only falls), so the penalty is c_j - c_i
  cached = cached._replace(run_min=jnp.broadcast_to(carry.astype(F32)[:, None], cached.level.shape))
  return _v.poison_rows(_attend(q, k, v, c, c, cached, scale=scale, block_size=block_size), bad)


@functools.partial(jax.jit, static_argnames=("scale", "block_size"))
def _prefix_core(q, k, v, field, level, cached, *, scale, block_size):
  gates, bad = _v.sanitize_gates({"field": field, "level": level})
  return _v.poison_rows(
    _attend(q, k, v, gates["field"], gates["level"], cached, scale=scale, block_size=block_size), bad
  )


def _attend(q, k, v, field, level, cached: CachedKeys, *, scale, block_size):
  """The chunk's causal attention, then the cached slots block by block into the same online
  softmax. field, level: fp32 [B, T, KVH] with allowed values only."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d)
  # The chunk's own keys: causal, diagonal always live (so the running max is finite from here on).
  bias = -penalty_matrix(jnp.swapaxes(field, 1, 2), jnp.swapaxes(level, 1, 2))  # [B, KVH, T, T]
  s = jnp.einsum("bihgd,bjhd->bhgij", qg, k, preferred_element_type=F32) * scale
  causal = jnp.tril(jnp.ones((t, t), bool))
  s = jnp.where(causal, s + jnp.where(causal, bias, 0.0)[:, :, None], NEG)
  m = s.max(-1)
  p = jnp.exp(s - m[..., None])
  state = (m, p.sum(-1), jnp.einsum("bhgij,bjhd->bhgid", p.astype(v.dtype), v, preferred_element_type=F32))

  # The cached slots: a NaN level / running min in a valid slot poisons the kv head (module docstring).
  lvl, rmin = cached.level.astype(F32), cached.run_min.astype(F32)
  nan_state = cached.valid & (jnp.isnan(lvl) | ~_v.allowed("field", rmin))
  poisoned = jnp.any(nan_state, axis=1)  # [B, KVH]
  valid = cached.valid & ~nan_state
  slots = cached.k.shape[1]
  if slots:
    blk = min(block_size or DEFAULT_BLOCK, slots)
    nb = -(-slots // blk)
    pad = lambda x, c: jnp.pad(x, [(0, 0), (0, nb * blk - slots)] + [(0, 0)] * (x.ndim - 2), constant_values=c)
    ck, cv, lvl, rmin, valid = pad(cached.k, 0), pad(cached.v, 0), pad(lvl, 0.0), pad(rmin, jnp.inf), pad(valid, False)
    prefix = min_scan(field, axis=1)  # [B, T, KVH]: C_i, the chunk's min through i

    def block(c, state):
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, c * blk, blk, axis=1)
      low = jnp.minimum(take(rmin)[:, None], prefix[:, :, None])  # [B, T, blk, KVH]: min(m_j, C_i)
      pen = jnp.moveaxis(dip(take(lvl)[:, None], low), 3, 1)  # [B, KVH, T, blk]
      sc = jnp.einsum("bihgd,bjhd->bhgij", qg, take(ck), preferred_element_type=F32) * scale - pen[:, :, None]
      sc = jnp.where(jnp.moveaxis(take(valid), 2, 1)[:, :, None, None, :], sc, NEG)
      m, l, acc = state
      m_new = jnp.maximum(m, sc.max(-1))
      corr = jnp.exp(m - m_new)
      p = jnp.exp(sc - m_new[..., None])
      pv = jnp.einsum("bhgij,bjhd->bhgid", p.astype(cv.dtype), take(cv), preferred_element_type=F32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    # Only the blocks up to the last valid slot (of any row and head): an empty or half-full cache
    # costs what it holds, not its capacity (a decode cache keeps its keys in the first slots).
    last = jnp.max(jnp.where(valid, jnp.arange(nb * blk)[None, :, None] + 1, 0))
    state = jax.lax.fori_loop(0, (last + blk - 1) // blk, block, state)
  _, l, acc = state
  out = jnp.moveaxis(acc / l[..., None], 3, 1)  # [B, T, KVH, G, Kv]
  out = jnp.where(poisoned[:, None, :, None, None], jnp.nan, out)
  return out.reshape(b, t, h, -1).astype(q.dtype)
