"""Recurrent FPA: a scan over time whose carry is a KV cache plus each key's first-passage state.

The per-step update `decode_step` is exactly what autoregressive decoding with a KV cache does:
every cached key keeps the running min of the field since it was written; a new token first
lowers those minima with its field value, then is appended with an empty range (min = +inf).
A key's penalty dip(level, running_min) therefore never decreases, which is what makes
penalty-threshold eviction safe (the first-passage state and its rules: `ops.first_passage`).

Grouped-query attention: the cache holds KVH heads (k, v, level, run_min per kv head) and each
query head h reads kv head h // G, G = H / KVH. The gates are per kv head, so a slot's penalty is
one number for the whole group and evicting it drops it for all G query heads at once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fpa_jax.ops import first_passage as fp
from fpa_jax.ops import validate as _v
from fpa_jax.ops.common import STATS_DTYPE


class RecurrentCache(NamedTuple):
  """The recurrent form's state: a KV cache that never evicts. Slots [0, length) are filled (the
  decoding cache with eviction policies is `fpa_jax.inference.cache.LayerCache`).

  k: [B, S, KVH, K], v: [B, S, KVH, Kv] cached keys / values (S = capacity).
  level: [B, S, KVH] fp32 key levels.
  run_min: [B, S, KVH] fp32 min of the field over (j, now]; +inf right after key j is written.
  segment: [B, S] int32 segment id of each key (-1 for empty slots).
  length: [] int32 number of filled slots (shared by the batch).
  """

  k: jax.Array
  v: jax.Array
  level: jax.Array
  run_min: jax.Array
  segment: jax.Array
  length: jax.Array

  @property
  def penalty(self) -> jax.Array:
    """[B, S, KVH] fp32 current penalty of every cached key (`cache_penalty`); NaN where a
    disallowed gate value reached the key's state (`decode_step`)."""
    nan = jnp.isnan(self.level) | jnp.isnan(self.run_min)
    return jnp.where(nan, jnp.nan, fp.penalty(self.level, self.run_min))


def init_recurrent_cache(
  batch: int, capacity: int, heads: int, head_dim: int, v_dim: int | None = None, dtype=jnp.float32
) -> RecurrentCache:
  """An empty `RecurrentCache`; `heads` is the number of kv heads (KVH)."""
  v_dim = head_dim if v_dim is None else v_dim
  return RecurrentCache(
    k=jnp.zeros((batch, capacity, heads, head_dim), dtype),
    v=jnp.zeros((batch, capacity, heads, v_dim), dtype),
    level=jnp.zeros((batch, capacity, heads), STATS_DTYPE),
    run_min=jnp.full((batch, capacity, heads), jnp.inf, STATS_DTYPE),
    segment=jnp.full((batch, capacity), -1, jnp.int32),
    length=jnp.zeros((), jnp.int32),
  )


def cache_penalty(cache: RecurrentCache) -> jax.Array:
  """[B, S, KVH] fp32 current penalty of every cached key (0 for the newest, whatever its level:
  run_min is +inf there; +inf for a level of +inf once a finite field value has been seen; NaN where
  a disallowed gate value reached the key's state, see `decode_step`; junk in empty slots)."""
  return cache.penalty


def decode_step(cache: RecurrentCache, q, k, v, field, level, *, scale, segment=None):
  """One token: update the cache with (k, v, field, level), then attend with q.

  Args:
    cache: a `RecurrentCache` with length < capacity. A full cache raises ValueError where its length is
      concrete; under jit a step on a full cache writes nothing: it returns the cache unchanged
      (length stays at the capacity) and an output of NaN, never a key over the last slot.
    q: [B, H, K]; k: [B, KVH, K]; v: [B, KVH, Kv]; field, level: [B, KVH]; segment: optional [B] int.
  Returns:
    (out [B, H, Kv] in q's dtype, new cache).

  Non-finite gates (`validate.ALLOWED`: field finite or +inf, level not NaN): a concrete field or
  level with a disallowed entry raises ValueError. Under jit the cache remembers it as NaN state (a
  bad level: the new key's level; a bad field: the running min of every key held and of the new
  one) and every step of a (row, kv head) whose cache holds NaN state outputs NaN in that kv head's
  query heads, whatever the segments: the steps at and after the bad token, as `fpa_attention`'s
  rows (the `recurrent` impl is this scan).
  """
  b, h, d = q.shape
  capacity, kvh = cache.k.shape[1], cache.k.shape[2]
  if not isinstance(cache.length, jax.core.Tracer) and int(cache.length) >= capacity:
    raise ValueError(
      f"decode_step: the cache is full (length {int(cache.length)} = capacity {capacity}): make it with "
      f"init_recurrent_cache(..., capacity=N) for N >= the number of tokens to decode"
    )
  _v.check_gate_values("field", field, ("batch", "kv head"))
  _v.check_gate_values("level", level, ("batch", "kv head"))
  seg = jnp.zeros((b,), jnp.int32) if segment is None else segment.astype(jnp.int32)
  pos = cache.length
  full = pos >= capacity  # only reachable under jit
  slot = jnp.minimum(pos, capacity - 1)
  # Disallowed gate values become NaN state: jnp.minimum carries a NaN field into every running min.
  f, l = field.astype(STATS_DTYPE), level.astype(STATS_DTYPE)
  f_bad = ~_v.allowed("field", f)
  f = jnp.where(f_bad, jnp.nan, f)
  l = jnp.where(_v.allowed("level", l), l, jnp.nan)
  # Keys already cached see this token inside their range (j, now]; the new key sees none.
  run_min = jnp.where(full, cache.run_min, fp.advance(cache.run_min, f[:, None, :]))

  def put(buf, new):  # write slot `slot` unless the cache is full
    old = jax.lax.dynamic_slice_in_dim(buf, slot, 1, 1)
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(full, old, new.astype(buf.dtype)), slot, 1)

  cache = RecurrentCache(
    k=put(cache.k, k[:, None]),
    v=put(cache.v, v[:, None]),
    level=put(cache.level, l[:, None]),
    run_min=put(run_min, jnp.where(f_bad, jnp.nan, jnp.inf)[:, None]),
    segment=put(cache.segment, seg[:, None]),
    length=jnp.where(full, pos, pos + 1),
  )
  s_idx = jnp.arange(capacity)
  valid = (s_idx <= slot)[None, :] & (cache.segment == seg[:, None])  # [B, S]
  qg = q.reshape(b, kvh, h // kvh, d)  # query head h reads kv head h // G
  s = jnp.einsum("bhgd,bshd->bhgs", qg, cache.k, preferred_element_type=STATS_DTYPE) * scale
  pen = jnp.where(valid[:, :, None], cache_penalty(cache), 0.0).transpose(0, 2, 1)  # [B, KVH, S]
  logits = jnp.where(valid[:, None, None, :], s - pen[:, :, None], -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgs,bshd->bhgd", p.astype(cache.v.dtype), cache.v, preferred_element_type=STATS_DTYPE)
  held = (s_idx < cache.length)[None, :, None]
  poisoned = jnp.any(held & (jnp.isnan(cache.level) | jnp.isnan(cache.run_min)), axis=1)  # [B, KVH]
  out = jnp.where(poisoned[:, :, None, None] | full, jnp.nan, out)
  return out.reshape(b, h, -1).astype(q.dtype), cache


def recurrent_attention(q, k, v, field, level, *, scale, segment_ids=None):
  """Causal FPA by scanning `decode_step` over time. q: [B, T, H, K]; k: [B, T, KVH, K];
  v: [B, T, KVH, Kv]; field, level: [B, T, KVH] -> [B, T, H, Kv].

  O(T) state per step, O(T^2) total work. Differentiable (scan autodiff, each step rematerialised).
  """
  b, t, h, d = q.shape
  if b == 0 or t == 0:  # nothing to scan (and decode_step's -1 reshape would divide by zero)
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  cache = init_recurrent_cache(b, t, k.shape[2], d, v.shape[-1], dtype=k.dtype)
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

  @jax.checkpoint
  def step(cache, xs):
    q_t, k_t, v_t, f_t, l_t, s_t = xs
    out, cache = decode_step(cache, q_t, k_t, v_t, f_t, l_t, scale=scale, segment=s_t)
    return cache, out

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, field, level, seg))
  _, out = jax.lax.scan(step, cache, xs)
  return jnp.moveaxis(out, 0, 1)
