"""The first-passage KV cache of one attention layer, and attention against it.

Shape legend: B batch, S cache slots, H heads, K head dim, T tokens of a call. The cache is per kv
head: under grouped-query attention (KVH < H) every H of the cache below is KVH, and query head h
reads kv head h // (H / KVH). The gates are per kv head, so a slot's penalty, its eviction and its
threshold are one decision for the whole group.

A slot holds one key of one (row, kv head): its k, v, level, and the running min of the field since it
was written (its first-passage state). Slots are reused once their key is evicted, so the cache has
a fixed capacity and static shapes; a whole generation compiles once. `decode_attend` is one token,
`prefill_attend` a whole prompt through the parallel kernel, `prefill_chunk` a chunk of new tokens
after what the cache holds (a conversation prefilled turn by turn): pure functions of (cache, q, k,
v, field, level, cum). The layer calls none of them directly: it calls `attend(spec, q, k, v, gates)`
on a `CacheView` (a `LayerCache` with a `Decode`, `Prefill` or `Extend`), which calls them with the
layer's spec.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from fpa_jax import ops
from fpa_jax.inference.policies import POLICY_CLASSES, PolicyRule, as_policy, snapkv_scores  # noqa: F401
from fpa_jax.layers import register_nnx_decoding
from fpa_jax.ops import first_passage as fp  # the first-passage state and the eviction rule
from fpa_jax.ops.common import F32


class LayerCache(NamedTuple):
  """Per-layer decode state.

  k, v:      [B, H, S, K] cached keys / values (compute dtype), head-major unlike the fields below:
             each decode step's einsums then read the cache without transposing it.
  level:     [B, S, H] fp32 key levels.
  run_min:   [B, S, H] fp32 min of the field over (key, now]; +inf right after a key is written.
  pos:       [B, S, H] int32 position of the key in its row (-1: the slot never held a key of the
             current sequence).
  alive:     [B, S, H] bool: the slot's key is attended to (False once evicted).
  score:     [B, S, H] fp32 h2o: attention mass the key received so far; snapkv: its prefill score
             (`snapkv_scores`; +inf in the observation window, 0 for generated keys).
  carry:     [B, H] fp32 the gate's running sum of field increments.
  threshold: [H] fp32 eviction threshold on the penalty (+inf: never by threshold); a key's own
             threshold is threshold + min(key_cap, key_coef * ||k||) (the `fpa` policy's per-key
             bound, `policies.key_tolerance_threshold`; key_coef = key_cap = 0 otherwise).
  key_coef:  [H] fp32 scale * (bound on any query's norm) for the per-key threshold.
  key_cap:   [H] fp32 cap on the per-key term (U: the parameter bound on the logit).
  lost:      [B, H] fp32 at the last step, the full-cache attention mass of the evicted keys
             (only when the cache never reuses slots: `measure=True` in `decode_attend`).
  overflow:  [B, H] bool a thresholded policy had to evict below its threshold (cache full).
  """

  k: jax.Array
  v: jax.Array
  level: jax.Array
  run_min: jax.Array
  pos: jax.Array
  alive: jax.Array
  score: jax.Array
  carry: jax.Array
  threshold: jax.Array
  key_coef: jax.Array
  key_cap: jax.Array
  lost: jax.Array
  overflow: jax.Array

  @property
  def penalty(self) -> jax.Array:
    """[B, S, H] current first-passage penalty of each slot's key (0 on empty slots)."""
    return jnp.where(self.pos >= 0, fp.penalty(self.level, self.run_min), 0.0)

  def key_threshold(self, k: jax.Array | None = None) -> jax.Array:
    """[B, S, H] the eviction threshold of each slot's key (of candidates `k` [B, S, H, K] if given)."""
    norm_of = lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(F32)), axis=-1))
    norm = norm_of(self.k).swapaxes(1, 2) if k is None else norm_of(k)  # the cache's k is head-major
    return self.threshold + jnp.minimum(self.key_cap, self.key_coef * norm)


def init_layer_cache(
  batch: int, slots: int, heads: int, head_dim: int, *, dtype=F32, threshold=None, key_coef=None, key_cap=None
) -> LayerCache:
  """An empty `LayerCache` of `slots` slots per (row, kv head) (`heads`: KVH) with the policy's
  per-head threshold terms [KVH] (None: no threshold, no per-key term)."""
  bsh = (batch, slots, heads)
  bhs = (batch, heads, slots)  # k, v: head-major
  thr = jnp.full((heads,), jnp.inf, F32) if threshold is None else jnp.asarray(threshold, F32).reshape(heads)
  per_head = lambda x: jnp.zeros((heads,), F32) if x is None else jnp.asarray(x, F32).reshape(heads)
  return LayerCache(
    k=jnp.zeros(bhs + (head_dim,), dtype),
    v=jnp.zeros(bhs + (head_dim,), dtype),
    level=jnp.zeros(bsh, F32),
    run_min=jnp.full(bsh, jnp.inf, F32),
    pos=jnp.full(bsh, -1, jnp.int32),
    alive=jnp.zeros(bsh, bool),
    score=jnp.zeros(bsh, F32),
    carry=jnp.zeros((batch, heads), F32),
    threshold=thr,
    key_coef=per_head(key_coef),
    key_cap=per_head(key_cap),
    lost=jnp.zeros((batch, heads), F32),
    overflow=jnp.zeros((batch, heads), bool),
  )


class HeadCaches(NamedTuple):
  """One layer's state when each kv head has a cache of its own (`PolicyRule.head_slots`: `FPAHeads`,
  a capacity per head): heads[j] a `LayerCache` of kv head j alone ([B, S_j, 1], S_j its slots), so
  a step reads and updates only that head's keys. carry, lost, overflow: [B, KVH] as a `LayerCache`'s."""

  heads: tuple[LayerCache, ...]

  @property
  def carry(self) -> jax.Array:
    return jnp.concatenate([c.carry for c in self.heads], axis=1)

  @property
  def lost(self) -> jax.Array:
    return jnp.concatenate([c.lost for c in self.heads], axis=1)

  @property
  def overflow(self) -> jax.Array:
    return jnp.concatenate([c.overflow for c in self.heads], axis=1)


def init_layer_state(
  policy: PolicyRule, layer: int, batch: int, slots: int | None, heads: int, head_dim: int, *, dtype=F32, **thresholds
) -> LayerCache | HeadCaches:
  """Layer `layer`'s empty state under `policy`: a `LayerCache` of `slots` (default `policy.capacity`)
  per kv head, or where the policy gives each head slots of its own (`head_slots`) a `HeadCaches`
  (`slots` given: that many for every head, the measuring layout). `thresholds`: threshold,
  key_coef, key_cap [KVH] or None (`init_layer_cache`)."""
  per = policy.head_slots(layer)
  if per is None:
    return init_layer_cache(batch, slots or policy.capacity, heads, head_dim, dtype=dtype, **thresholds)
  if len(per) != heads:
    raise ValueError(f"policy {policy.name!r} gives layer {layer} {len(per)} kv heads' slots; it has {heads}")
  one = lambda x, j: None if x is None else jnp.broadcast_to(jnp.asarray(x, F32).reshape(-1), (heads,))[j : j + 1]
  return HeadCaches(
    tuple(
      init_layer_cache(batch, slots or n, 1, head_dim, dtype=dtype, **{k: one(x, j) for k, x in thresholds.items()})
      for j, n in enumerate(per)
    )
  )


def keys_held(state: LayerCache | HeadCaches) -> jax.Array:
  """[B, KVH] int32 keys each (row, kv head) of one layer's state holds."""
  if isinstance(state, HeadCaches):
    return jnp.concatenate([keys_held(c) for c in state.heads], axis=1)
  return jnp.sum(state.alive, axis=1, dtype=jnp.int32)


def each_cache(fn, state: LayerCache | HeadCaches, *others):
  """fn(cache, *others' caches) on a `LayerCache`, or on each head's of a `HeadCaches` (others alike)."""
  if isinstance(state, HeadCaches):
    return HeadCaches(tuple(fn(c, *(o.heads[j] for o in others)) for j, c in enumerate(state.heads)))
  return fn(state, *others)


def reset_rows(cache: LayerCache, rows: jax.Array) -> LayerCache:
  """Empty the cache of the rows where `rows` [B] is True (a new sequence starts there)."""
  r = rows[:, None, None]
  return cache._replace(
    pos=jnp.where(r, -1, cache.pos),
    alive=jnp.where(r, False, cache.alive),
    run_min=jnp.where(r, jnp.inf, cache.run_min),
    score=jnp.where(r, 0.0, cache.score),
    carry=jnp.where(rows[:, None], 0.0, cache.carry),
  )


# ------------------------------------------------------------------------------------------------
# Which key goes
# ------------------------------------------------------------------------------------------------


def evict_slot(policy: PolicyRule, cache: LayerCache, pen: jax.Array, alive: jax.Array, now: jax.Array) -> jax.Array:
  """[B, H] slot of the key to evict from a full (row, head); `now` [B] is the current position.

  The protected window (`policy.recent` = W): the new key at `now` and the W - 1 before it stay, so
  the candidates are the keys at positions <= now - W (all alive keys if none is; make_policy keeps
  W below the capacity, so a full cache always has one). Every policy evicts in
  `first_passage.oldest_max` order (ties: the oldest) of the rank its `PolicyRule.evict_rank` gives (the
  fpa ones: the largest penalty, `first_passage.victim`).
  """
  pos, now = cache.pos, now[:, None, None]
  rank, cand = policy.evict_rank(cache, pen, fp.candidates(alive, pos, now, policy.recent), now)
  return fp.oldest_max(rank, pos, cand)


def _scatter(x, slot, val, *, head_major=False):
  """x [B, S, H, ...] ([B, H, S, ...] if `head_major`) with x[b, slot[b, h], h] = val[b, h]."""
  b, h = slot.shape
  bi = jnp.arange(b)[:, None]
  hi = jnp.arange(h)[None, :]
  idx = (bi, hi, slot) if head_major else (bi, slot, hi)
  return x.at[idx].set(val.astype(x.dtype))


def pick_rows(rows: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """rows [B] bool; new, old [B, ...] -> new[b] where rows[b], else old[b]."""
  return jnp.where(rows.reshape(rows.shape + (1,) * (new.ndim - 1)), new, old)


def select_rows(rows: jax.Array, new: LayerCache, old: LayerCache, *, skip: tuple[str, ...] = ()) -> LayerCache:
  """Per row b: new if rows[b] else old (`pick_rows`), field by field but `skip` (taken from new)
  and the per-head threshold terms [H], which every row shares."""
  keep = ("threshold", "key_coef", "key_cap") + skip
  return new._replace(
    **{f: pick_rows(rows, getattr(new, f), getattr(old, f)) for f in LayerCache._fields if f not in keep}
  )


def _sanitize(field, level):
  """(field, level) [B, ..., H] fp32 with the entries `ops.validate.ALLOWED` does not allow replaced
  by +inf (a field that lowers no minimum, a dead key), and the bad mask [B, ..., H] bool."""
  f, l = field.astype(F32), level.astype(F32)
  bad_f, bad_l = ~ops.validate.allowed("field", f), ~ops.validate.allowed("level", l)
  return (jnp.where(bad_f, jnp.inf, f), jnp.where(bad_l, jnp.inf, l)), bad_f | bad_l


# ------------------------------------------------------------------------------------------------
# One token
# ------------------------------------------------------------------------------------------------


def decode_attend(
  cache: LayerCache,
  q,
  k,
  v,
  field,
  level,
  cum,
  *,
  policy: PolicyRule,
  scale: float,
  positions: jax.Array,
  step: jax.Array | None = None,
  measure: bool = False,
  active: jax.Array | None = None,
):
  """One token per row against the cache: update first-passage state, evict, insert, attend.

  Args:
    q: [B, 1, H, K]; k, v: [B, 1, KVH, K]; field, level, cum: [B, 1, KVH] (cum: the gate's running
      sum through it). The cache is [B, S, KVH] (k, v [B, KVH, S, K]); `score` (h2o) adds the
      attention mass of the group's query heads, `lost` is the group's largest.
    positions: [B] the token's position in its row. step: [] slot to write when `measure`.
    measure: never reuse a slot (slot = `step`; capacity >= sequence), keep evicted keys' data
      and report in `cache.lost` the full-cache attention mass the evicted keys would get.
    active: [B] bool, the rows that take this token (None: all); the others keep their cache as it
      was (a decode prefill's rows past their prompt) and get an output to ignore.
  Returns:
    (out [B, 1, H, K], new cache).

  Room: a cache of fewer slots than `policy.capacity` raises ValueError (its first free slot would be
  a taken one); with `measure`, a concrete `step` >= the slots raises, and under jit such a step
  writes nothing, sets `overflow` and returns NaN. Gate values `ops.validate.ALLOWED` does not allow
  (NaN; a field of -inf): ValueError where concrete; under jit this step's output is NaN in the
  kv head's query heads and the cache stores the token as dead (level +inf) and lowering no minimum
  (field +inf), the values `ops.fpa_attention` computes with (in a model, a NaN field increment
  stays NaN in the gate's running sum, so every later step is NaN too).
  """
  slots = cache.pos.shape[1]
  if not measure and slots < policy.capacity:
    raise ValueError(
      f"the cache has {slots} slots per (row, head), fewer than the {policy.capacity} keys policy {policy.name!r} "
      f"may hold: make it with init_layer_cache(batch, slots >= {policy.capacity}, ...)"
    )
  if measure and step is not None and not isinstance(step, jax.core.Tracer) and int(step) >= slots:
    raise ValueError(f"measure=True writes slot step={int(step)}, but the cache has {slots} slots: use slots >= steps")
  ops.validate.check_gate_values("field", field)
  ops.validate.check_gate_values("level", level)
  entry = cache
  (f, l), bad = _sanitize(field[:, 0], level[:, 0])  # [B, H]
  occupied = cache.pos >= 0
  run_min = jnp.where(occupied, fp.advance(cache.run_min, f[:, None, :]), jnp.inf)
  cache = cache._replace(run_min=run_min)
  pen = cache.penalty  # [B, S, H]
  cache = policy.rescore(cache, q[:, 0], f, pen)  # a policy of your own scores the keys for this step's query
  alive = cache.alive
  if policy.thresholded:
    alive = alive & fp.survives(pen, cache.key_threshold())
  # Room for the new key: capacity eviction when this (row, head) already holds `capacity` keys.
  full = jnp.sum(alive, axis=1) >= policy.capacity  # [B, H]
  out_slot = evict_slot(policy, cache, pen, alive, positions)  # [B, H]
  s_idx = jnp.arange(alive.shape[1])[None, :, None]
  alive = alive & ~(full[:, None, :] & (s_idx == out_slot[:, None, :]))
  overflow = cache.overflow | (full if policy.thresholded else False)
  if measure:
    slot = jnp.broadcast_to(step, full.shape).astype(jnp.int32)
    no_room = slot >= slots  # only reachable under jit: the scatters below drop the write
    overflow = overflow | no_room
  else:
    slot = jnp.argmin(alive, axis=1).astype(jnp.int32)  # first free slot
  if active is not None:  # an inactive row rewrites its slot's own k, v: no pass over the whole cache
    bi, hi = jnp.arange(slot.shape[0])[:, None], jnp.arange(slot.shape[1])[None, :]
    own = lambda x, new: jnp.where(active[:, None, None], new, x[bi, hi, jnp.minimum(slot, x.shape[2] - 1)])
    k, v = own(cache.k, k[:, 0])[:, None], own(cache.v, v[:, 0])[:, None]
  cache = cache._replace(
    k=_scatter(cache.k, slot, k[:, 0], head_major=True),
    v=_scatter(cache.v, slot, v[:, 0], head_major=True),
    level=_scatter(cache.level, slot, l),
    run_min=_scatter(cache.run_min, slot, jnp.full_like(l, jnp.inf)),
    pos=_scatter(cache.pos, slot, jnp.broadcast_to(positions[:, None], l.shape)),
    alive=_scatter(alive, slot, jnp.ones_like(full)),
    score=_scatter(cache.score, slot, jnp.zeros_like(l)),
    carry=cum[:, 0].astype(F32),
    overflow=overflow,
  )
  b, _, h, dk = q.shape
  kvh = cache.k.shape[1]
  qg = q[:, 0].reshape(b, kvh, h // kvh, dk)  # query head h -> kv head h // G
  # (b, h) lead in both operands (head-major k, v): no per-step transpose of the cache.
  s = jnp.einsum("bhgk,bhsk->bhgs", qg, cache.k, preferred_element_type=F32) * scale
  logits = s - cache.penalty.transpose(0, 2, 1)[:, :, None]  # [B, KVH, G, S]
  live = cache.alive.transpose(0, 2, 1)[:, :, None]
  p = jax.nn.softmax(jnp.where(live, logits, -jnp.inf), axis=-1)
  out = jnp.einsum("bhgs,bhsk->bhgk", p.astype(cache.v.dtype), cache.v, preferred_element_type=F32)
  lost = cache.lost
  if measure:
    seen = (cache.pos >= 0).transpose(0, 2, 1)[:, :, None]
    p_full = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
    lost = jnp.sum(jnp.where(seen & ~live, p_full, 0.0), axis=-1).max(-1)
  cache = policy.observe(cache, p)  # h2o: the attention mass each key received
  cache = cache._replace(lost=lost)
  if active is not None:  # the [B, S, KVH] fields (K times smaller than k, v) of inactive rows as they were
    cache = select_rows(active, cache, entry, skip=("k", "v"))
  nan_rows = bad | no_room if measure else bad  # [B, KVH]
  out = jnp.where(nan_rows[:, :, None, None], jnp.nan, out)
  return out.reshape(b, h, -1).astype(q.dtype)[:, None], cache


# ------------------------------------------------------------------------------------------------
# A whole prompt
# ------------------------------------------------------------------------------------------------


def _keep_order(policy: PolicyRule, pen, pos, valid, thr, lengths, score=None):
  """[B, T, H] -> slot order (most wanted first) and whether each token is kept at all.

  The protected window: the prompt's last W = `policy.recent` keys (positions >= L - W) come first.
  """
  keep = valid
  if policy.thresholded:
    keep = keep & fp.survives(pen, thr)
  primary = policy.keep_rank(pen, pos, score)  # the most wanted first
  if policy.recent:
    primary = jnp.where(pos >= lengths[:, None, None] - policy.recent, jnp.inf, primary)
  # Sort by (kept, primary, newer) descending; lax.sort is ascending over its keys.
  t_idx = jnp.broadcast_to(jnp.arange(pen.shape[1])[None, :, None], pen.shape)
  _, _, _, order = jax.lax.sort((~keep, -primary, -pos, t_idx), dimension=1, num_keys=3)
  return order, keep


def prefill_attend(
  cache: LayerCache,
  q,
  k,
  v,
  field,
  level,
  cum,
  *,
  policy: PolicyRule,
  scale: float,
  lengths: jax.Array,
  block_size: int | None = None,
  out: jax.Array | None = None,
):
  """A right-padded prompt through the parallel kernel, then the cache built from it directly.

  A key's running min after a prompt of length L is min(field_{j+1..L-1}), a reverse cumulative
  min, so no decode steps are needed. Then the policy picks which keys to keep (the prompt's own
  attention above used every key: see `generate(prefill=...)`). h2o needs per-key attention mass
  and is prefilled by decode steps instead; snapkv ranks the keys by `snapkv_scores`.

  Args:
    q: [B, T, H, K]; k, v: [B, T, KVH, K]; field, level, cum: [B, T, KVH] (cum: the gate's running
    sums); lengths: [B] prompt length of each row (1 <= L <= T), right padding.
    out: the prompt's attention output [B, T, H, K] where the caller ran it (a layer's prefill,
    `Prefill`: the layer's own impl and skipping, `AttentionSpec.parallel`); None: run here by
    `ops.fpa_attention`'s chunked kernel with `block_size`.
  Disallowed gate values (`ops.validate.ALLOWED`): as in `decode_attend`; the op makes the rows from
  the bad token on NaN.
  """
  b, t, h = k.shape[:3]  # the cache's heads: kv heads
  if out is None:
    out = ops.fpa_attention(q, k, v, field, level, scale=scale, block_size=block_size)
  ops.validate.check_gate_values("field", field)
  ops.validate.check_gate_values("level", level)
  (field, level), _ = _sanitize(field, level)
  t_idx = jnp.arange(t)[None, :, None]
  valid = t_idx < lengths[:, None, None]  # [B, T, 1]
  f = jnp.where(valid, field.astype(F32), jnp.inf)
  run_min = fp.suffix_min(f, axis=1)  # min over (j, L)
  pen = fp.penalty(level, run_min)
  pos = jnp.broadcast_to(t_idx, (b, t, h)).astype(jnp.int32)
  valid = jnp.broadcast_to(valid, (b, t, h))
  score = policy.prompt_scores(q, k, field, level, pen, pos, lengths, scale=scale)  # snapkv, a policy of your own
  last = jnp.take_along_axis(cum.astype(F32), (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
  return out, _keep_best(cache, policy, k, v, level, run_min, pen, pos, valid, lengths, last, score)


def _keep_best(
  cache: LayerCache, policy: PolicyRule, k, v, level, run_min, pen, pos, valid, lengths, carry, score=None
):
  """The cache of the keys the policy keeps among N candidates: k, v [B, N, KVH, K]; level, run_min,
  pen, score [B, N, KVH] fp32; pos [B, N, KVH] int; valid [B, N, KVH] bool (a real key); lengths [B]
  the keys each row has seen (positions >= lengths - W are protected); carry [B, KVH] the gate's
  running sum after them. Its S slots get the most wanted candidates (`_keep_order`); the rest go."""
  b, t, h = pen.shape
  thr = cache.key_threshold(k) if policy.thresholded else None
  order, keep = _keep_order(policy, pen, pos, valid, thr, lengths, score)
  score = jnp.zeros_like(pen) if score is None else score
  s = cache.pos.shape[1]
  if t < s:  # fewer candidates than slots: pad them with never-kept entries
    pad = lambda x, c: jnp.concatenate([x, jnp.full((b, s - t) + x.shape[2:], c, x.dtype)], axis=1)
    order = jnp.concatenate([order, jnp.broadcast_to(jnp.arange(t, s)[None, :, None], (b, s - t, h))], 1)
    k, v, level, run_min, pos, keep, score = (
      pad(k, 0),
      pad(v, 0),
      pad(level.astype(F32), 0),
      pad(run_min, jnp.inf),
      pad(pos, -1),
      pad(keep, False),
      pad(score, 0),
    )
  idx = order[:, :s]  # [B, S, H]
  take = lambda x: jnp.take_along_axis(x, idx if x.ndim == 3 else idx[..., None], axis=1)
  kept = take(keep)
  head_major = lambda x, like: take(x).swapaxes(1, 2).astype(like.dtype)  # the kept S, not the N candidates
  return cache._replace(
    k=head_major(k, cache.k),
    v=head_major(v, cache.v),
    level=take(level.astype(F32)),
    run_min=take(run_min),
    pos=jnp.where(kept, take(pos), -1),
    alive=kept,
    score=jnp.where(kept, take(score), 0.0),
    carry=carry,
    overflow=cache.overflow | (policy.thresholded & (jnp.sum(keep, 1) > s)),
  )


# ------------------------------------------------------------------------------------------------
# A chunk after the cache
# ------------------------------------------------------------------------------------------------

CHUNKABLE = tuple(name for name, cls in POLICY_CLASSES.items() if cls.chunkable)


def check_chunk_policy(policy: PolicyRule) -> None:
  """The policies `prefill_chunk` runs: those that rank keys by their penalty, position or nothing.
  h2o (attention mass received), snapkv (a prompt's last window) and fpa_global (a budget across
  layers) rank by what one chunk cannot see: ValueError naming what to use."""
  if not policy.chunkable:
    raise ValueError(
      f"policy {policy.name!r} cannot prefill chunk by chunk (it ranks keys by what a chunk does not see: "
      f"attention mass, a prompt's last window or every layer's penalties): use one of {CHUNKABLE}, or "
      "prefill the whole prompt (generate(prefill='parallel'))"
    )


def dead_for_chunk(cache: LayerCache, q, k, field, lengths, *, scale: float, skip_tolerance: float) -> jax.Array:
  """[B, S, KVH] bool: the cached keys that every real query of a chunk gives at most eps / N of
  its weight (eps = skip_tolerance, N = S + T, the most keys a query sees), by `ops.chunked`'s
  skip bound with the cache as one key block: a query's diagonal logit (penalty 0) is >= -|scale|
  |q| |k_own|, every cached logit <= |scale| |q| |k_j| - penalty, and a cached key's penalty for
  the chunk's query i, dip(level_j, min(m_j, C_i)), is least at i = 0 (C_i only falls). So each
  row loses at most eps in all. q [B, T, H, K], k [B, T, KVH, K], field [B, T, KVH] fp32 (allowed
  values), lengths [B] the chunk's real tokens."""
  b, t, h, _ = q.shape
  kvh = k.shape[2]
  norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x.astype(F32)), axis=-1))
  real = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
  qn = jnp.max(jnp.where(real, norm(q).reshape(b, t, kvh, h // kvh).max(-1), 0.0), axis=1)  # [B, KVH]
  kn = jnp.max(jnp.where(real, norm(k), 0.0), axis=1)  # [B, KVH] the largest own key of a query
  u = abs(scale) * qn[:, None, :] * (norm(cache.k).swapaxes(1, 2) + kn[:, None, :])  # [B, S, KVH]
  floor = fp.penalty(cache.level, jnp.minimum(cache.run_min, field[:, :1]))  # at the chunk's first query
  n = cache.pos.shape[1] + t
  return cache.alive & (floor >= u + (math.log(n) - math.log(skip_tolerance)))


def prefill_chunk(
  cache: LayerCache,
  q,
  k,
  v,
  field,
  level,
  cum,
  *,
  policy: PolicyRule,
  scale: float,
  lengths: jax.Array,
  offsets: jax.Array,
  block_size: int | None = None,
  skip_tolerance: float | None = None,
  alone=None,
):
  """A chunk of new tokens per row after the cache: attend, then keep what the policy keeps.

  Each query of the chunk attends to the cache's alive keys with their first-passage state and to
  the chunk's keys up to itself (`ops.prefix.prefix_attention`: exact, as if the cached keys' tokens
  were in the same parallel call). Then every cached key's running min is lowered by the chunk's
  field, the chunk's keys get theirs (a reverse cumulative min, as in `prefill_attend`), and the
  policy keeps the cache's S best of the cached and the new keys by `prefill_attend`'s rule (the
  last W positions protected). A whole prompt as one chunk into an empty cache gives exactly the
  cache `prefill_attend` builds. Under the `fpa` tolerance policy every evicted key carried <= eps
  of each later query's attention (penalties never decrease, `policies.tolerance_threshold`); under
  a budget each query of a chunk sees at most the budget of cached keys plus its chunk's keys.

  Args:
    q: [B, T, H, K]; k, v: [B, T, KVH, K]; field, level, cum: [B, T, KVH] (cum: the gate's running
      sums, continued from `cache.carry`).
    lengths: [B] the chunk's tokens per row (0 <= L <= T; right padding, never attended to by a real
      query nor kept). offsets: [B] the position of each row's first chunk token (tokens seen so far).
    block_size: cached slots per online-softmax step of the attention (a layer's: its tile).
    skip_tolerance: None (exact) or eps in (0, 1): the cached keys that the skip bound of
      `ops.chunked` shows dead for every query of the chunk are left out of its attention
      (`dead_for_chunk`: each query loses at most eps of its weight, as a layer's parallel forward
      with that tolerance); they stay in the cache.
    alone: None, or a function () -> [B, T, H, K], the chunk's attention to itself by the layer's
      own parallel kernel (`layers.AttentionSpec.parallel`: its impl, tiles and skipping), run
      instead of the prefix attention when the cache holds no key (a conversation's first chunk),
      so that chunk's outputs are exactly the parallel forward's (one program: `lax.cond`).
  Returns:
    (out [B, T, H, K], the cache after the chunk). Policies: `CHUNKABLE` (`check_chunk_policy`).
    Disallowed gate values (`ops.validate.ALLOWED`): as in `prefill_attend`.
  """
  check_chunk_policy(policy)
  b, t, h = k.shape[:3]
  ck, cv = cache.k.swapaxes(1, 2), cache.v.swapaxes(1, 2)  # slot-major, as CachedKeys and the candidates
  (f, l), _ = _sanitize(field, level)
  seen = cache.alive
  if skip_tolerance is not None:
    seen = seen & ~dead_for_chunk(cache, q, k, f, lengths, scale=scale, skip_tolerance=skip_tolerance)
  cached = ops.prefix.CachedKeys(ck, cv, cache.level, cache.run_min, seen)
  prefix = lambda: ops.prefix.prefix_attention(q, k, v, field, level, cached, scale=scale, block_size=block_size)
  out = prefix() if alone is None else jax.lax.cond(jnp.any(cache.alive), prefix, lambda: alone().astype(q.dtype))
  t_idx = jnp.arange(t, dtype=jnp.int32)[None, :, None]
  real = t_idx < lengths[:, None, None]  # [B, T, 1]
  f = jnp.where(real, f, jnp.inf)  # padding lowers no minimum
  run_old = jnp.where(cache.pos >= 0, fp.advance(cache.run_min, f.min(axis=1)[:, None, :]), jnp.inf)
  cat = lambda a, c: jnp.concatenate([a, c], axis=1)
  k, v = cat(ck, k.astype(ck.dtype)), cat(cv, v.astype(cv.dtype))
  level = cat(cache.level, l)
  run_min = cat(run_old, fp.suffix_min(f, axis=1))
  pos = cat(cache.pos, jnp.broadcast_to(offsets[:, None, None] + t_idx, (b, t, h)).astype(jnp.int32))
  valid = cat(cache.alive, jnp.broadcast_to(real, (b, t, h)))
  last = jnp.take_along_axis(cum.astype(F32), jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  carry = jnp.where((lengths > 0)[:, None], last, cache.carry)
  pen = fp.penalty(level, run_min)
  score = policy.chunk_scores(q, k, f, level, pen, pos, lengths)  # a policy of your own: for the last chunk query
  return out, _keep_best(cache, policy, k, v, level, run_min, pen, pos, valid, offsets + lengths, carry, score)


# ------------------------------------------------------------------------------------------------
# fpa_global on per-layer caches
# ------------------------------------------------------------------------------------------------


def global_evict(caches, policy: PolicyRule, now: jax.Array, slots: int) -> tuple[LayerCache, ...]:
  """fpa_global on per-layer caches (`cached_logits`' measuring layout and a parallel prefill's
  candidates; `pool.pool_evict` is the same rule on the pool): evict across all layers and heads
  of a row down to G - L*KVH keys.

  G = `slots`, the pool's slots per row (`FPAGlobal.pool_slots`). The keys that may go are those outside every head's protected window
  (positions <= now + 1 - W: the next step's new key and the W - 1 before it stay); they go largest
  penalty first (plus the policy's `head_offset`), ties oldest, then lower (layer, head). `now` [B]:
  the position of the last key written. Per row, the excess over the limit is evicted in one sort of the L * S * KVH slots (after
  a decode step it is at most L * KVH keys). Only `alive` changes (slots are reused by the next step).
  """
  caches = tuple(caches)
  n_l = len(caches)
  b, s, h = caches[0].pos.shape
  limit = slots - n_l * h
  pen = jnp.stack([c.penalty for c in caches], 1)  # [B, L, S, H]
  alive = jnp.stack([c.alive for c in caches], 1)
  pos = jnp.stack([c.pos for c in caches], 1)
  cand = alive & (pos <= now[:, None, None, None] + 1 - policy.recent)
  excess = jnp.maximum(jnp.sum(alive, axis=(1, 2, 3)) - limit, 0)  # [B]
  head = jnp.broadcast_to((jnp.arange(n_l)[:, None, None] * h + jnp.arange(h)[None, None, :])[None], pen.shape)
  flat = lambda x: x.reshape(b, n_l * s * h)
  rank = policy.evict_order(flat(pen), flat(head))
  evict = fp.evict_largest(rank, flat(pos), flat(head), flat(cand), excess).reshape(b, n_l, s, h)
  return tuple(c._replace(alive=c.alive & ~evict[:, i]) for i, c in enumerate(caches))


# ------------------------------------------------------------------------------------------------
# What a call does, and what the layers attend against (`layers.AttentionCache`, `models.ModelCache`)
# ------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decode:
  """One token per row (`decode_attend`; fpa_global's pool: `pool.pool_decode_attend`): the policy
  (static), positions [B] of the tokens, for the measuring layout the slot `step` [] and `measure`
  (static), and the rows that take the token, `active` [B] (None: all; see `decode_attend`)."""

  policy: PolicyRule = dataclasses.field(metadata=dict(static=True))
  positions: jax.Array
  step: jax.Array | None = None
  measure: bool = dataclasses.field(default=False, metadata=dict(static=True))
  active: jax.Array | None = None

  def attend(self, state: LayerCache, spec, q, k, v, gates):
    kw = dict(policy=self.policy, scale=spec.scale, positions=self.positions, step=self.step, measure=self.measure)
    return decode_attend(state, q, k, v, gates.field, gates.level, gates.cum, active=self.active, **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefill:
  """A right-padded prompt (`prefill_attend`), `lengths` [B]: its attention is the layer's parallel
  kernel (`spec.parallel`: the impl, tiles and skipping of the parallel forward), then the cache
  the policy keeps."""

  policy: PolicyRule = dataclasses.field(metadata=dict(static=True))
  lengths: jax.Array

  def attend(self, state: LayerCache, spec, q, k, v, gates):
    out = spec.parallel(q, k, v, gates)
    kw = dict(policy=self.policy, scale=spec.scale, lengths=self.lengths, out=out)
    return prefill_attend(state, q, k, v, gates.field, gates.level, gates.cum, **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Extend:
  """A chunk of new tokens per row after the cache (`prefill_chunk`): the policy (static), the
  chunk's `lengths` [B] and `offsets` [B] (the position of its first token in each row). The
  layer's spec is honoured as in its parallel forward: a chunk with nothing cached runs the layer's
  kernel (`spec.parallel`: impl, tiles, skipping); otherwise the cached slots are read in blocks of
  its tile and, with a skip tolerance, the keys dead for the whole chunk are left out
  (`dead_for_chunk`)."""

  policy: PolicyRule = dataclasses.field(metadata=dict(static=True))
  lengths: jax.Array
  offsets: jax.Array

  def attend(self, state: LayerCache, spec, q, k, v, gates):
    # The layer's spec as in its parallel forward: its kernel for a chunk with nothing cached, its
    # tile for the cached slots' blocks, its skip tolerance for the cached keys.
    kw = dict(policy=self.policy, scale=spec.scale, lengths=self.lengths, offsets=self.offsets)
    kw.update(block_size=spec.block_size, skip_tolerance=spec.skip_tolerance)
    return prefill_chunk(
      state, q, k, v, gates.field, gates.level, gates.cum, alone=lambda: spec.parallel(q, k, v, gates), **kw
    )


Run = Decode | Prefill | Extend


@dataclasses.dataclass(frozen=True)
class HeadsView:
  """One layer's `HeadCaches` with what this call does: the `layers.AttentionCache` the layer calls
  where each kv head has a cache of its own. `attend` runs the call's `CacheView` per kv head j on
  its query heads (j G .. (j + 1) G - 1, G = H / KVH), its k, v and gates, under the head's rule
  (`policy.for_head(layer, j)`), and joins the outputs along the heads."""

  state: HeadCaches
  run: Run
  layer: int

  @property
  def carry(self) -> jax.Array:
    return self.state.carry

  def attend(self, spec, q, k, v, gates):
    kvh = len(self.state.heads)
    g = q.shape[2] // kvh
    outs, heads = [], []
    for j, c in enumerate(self.state.heads):
      run = dataclasses.replace(self.run, policy=self.run.policy.for_head(self.layer, j))
      mine = type(gates)(*(x[..., j : j + 1] for x in gates))  # GateTerms [B, T, 1] each
      out, view = CacheView(c, run).attend(
        spec, q[:, :, j * g : (j + 1) * g], k[:, :, j : j + 1], v[:, :, j : j + 1], mine
      )
      outs.append(out)
      heads.append(view.state)
    return jnp.concatenate(outs, axis=2), dataclasses.replace(self, state=HeadCaches(tuple(heads)))


def layer_view(state: LayerCache | HeadCaches, run: Run, layer: int) -> CacheView | HeadsView:
  """What layer `layer` attends against for `run`: its `CacheView`, or its `HeadsView` (a cache per kv head)."""
  return HeadsView(state, run, layer) if isinstance(state, HeadCaches) else CacheView(state, run)


@dataclasses.dataclass(frozen=True)
class CacheView:
  """One layer's `LayerCache` with what this call does (`Decode`, `Prefill` or `Extend`): the
  `layers.AttentionCache` the layer calls."""

  state: LayerCache
  run: Run

  @property
  def carry(self) -> jax.Array:
    return self.state.carry

  def attend(self, spec, q, k, v, gates):
    out, state = self.run.attend(self.state, spec, q, k, v, gates)
    return out, dataclasses.replace(self, state=state)


class DecodeState(Protocol):
  """A decoder's state between calls, whatever its layout: one `LayerCache` per layer
  (`LayerCaches`) or fpa_global's slot pool shared by every layer (`pool.GlobalCache`). The decoder
  (`decode.Decoder`) and everything built on it call only these methods, never ask which layout it is.

  As the model's cache for one call (`models.ModelCache`): `with_run(run)` (a `Decode`, `Prefill` or
  `Extend`), then the model calls `layer(i)` and `update(i, new)` layer by layer, then
  `settle(entry)` ends the call (fpa_global: its eviction between steps; rows that did not take
  the token (`Decode.active`) back to `entry`, the state before the call).
  Between calls: `occupancy()` -> (max keys held by any (layer, row, kv head) [], keys held
  [L, B, KVH]) fp32; `overflow()` [] bool (a thresholded policy ran out of room); `lost()` [] the
  largest measured lost mass; `select_rows(rows [B], old)` (row b from self where rows[b], else
  from old); `reset_rows(rows [B])` (empty those rows: a new sequence starts there); `nbytes()`
  (bytes every array allocates).
  """

  def with_run(self, run: Run) -> DecodeState: ...

  def layer(self, i: int): ...

  def update(self, i: int, new) -> DecodeState: ...

  def settle(self, entry: DecodeState, *, repack: bool = True) -> DecodeState: ...

  def occupancy(self) -> tuple[jax.Array, jax.Array]: ...

  def overflow(self) -> jax.Array: ...

  def lost(self) -> jax.Array: ...

  def select_rows(self, rows: jax.Array, old: DecodeState) -> DecodeState: ...

  def reset_rows(self, rows: jax.Array) -> DecodeState: ...

  def nbytes(self) -> int: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCaches:
  """Every layer's `LayerCache` (`layers`, in decoding order): the `DecodeState` of every policy but
  fpa_global, and, with a call's `run`, the `models.ModelCache` the model attends against
  (`LayerCaches(caches, Decode(...))`; `.layers` after). Iterating it gives the layers' caches."""

  layers: tuple[LayerCache | HeadCaches, ...]  # HeadCaches: a cache per kv head (`PolicyRule.head_slots`)
  run: Run | None = None

  def __iter__(self):
    return iter(self.layers)

  def __len__(self) -> int:
    return len(self.layers)

  def __getitem__(self, i: int) -> LayerCache:
    return self.layers[i]

  # ------------------------------------------------------------------ one call (`models.ModelCache`)
  def with_run(self, run: Run) -> LayerCaches:
    return dataclasses.replace(self, run=run)

  def layer(self, i: int) -> CacheView | HeadsView:
    return layer_view(self.layers[i], self.run, i)

  def update(self, i: int, new: CacheView) -> LayerCaches:
    return dataclasses.replace(self, layers=self.layers[:i] + (new.state,) + self.layers[i + 1 :])

  def settle(self, entry: LayerCaches, *, repack: bool = True) -> LayerCaches:
    """The call's end: fpa_global measured on per-layer caches (`cached_logits`) evicts across the
    layers (`global_evict`); rows a decode step skipped (`Decode.active`) keep their `entry` state
    (each layer already kept its own, so only the eviction across layers needs undoing)."""
    run, done = self.run, dataclasses.replace(self, run=None)
    if isinstance(run, Decode) and run.policy.is_global:
      c = done.layers[0]  # the pool this layout measures: one of the policy's for these layers
      g = run.policy.pool_slots(len(done.layers), c.pos.shape[2], c.k.shape[-1], c.k.dtype.itemsize)
      evicted = LayerCaches(global_evict(done.layers, run.policy, run.positions, g))
      done = evicted if run.active is None else evicted.select_rows(run.active, done)
    return done

  # ------------------------------------------------------------------ between calls
  def occupancy(self) -> tuple[jax.Array, jax.Array]:
    """(max keys held [], keys held [L, B, KVH]) fp32; layers with fewer kv heads than the most (a
    model of your own may mix them) padded with NaN."""
    per = [keys_held(c).astype(F32) for c in self.layers]  # [B, KVH] each
    kvh = max(h.shape[-1] for h in per)
    if any(h.shape[-1] != kvh for h in per):
      held = jnp.stack([jnp.pad(h, ((0, 0), (0, kvh - h.shape[-1])), constant_values=jnp.nan) for h in per])
      return jnp.nanmax(held), held
    held = jnp.stack(per)
    return jnp.max(held), held

  def overflow(self) -> jax.Array:
    return jnp.any(jnp.stack([jnp.any(c.overflow) for c in self.layers]))

  def lost(self) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(c.lost) for c in self.layers]))

  def select_rows(self, rows: jax.Array, old: LayerCaches) -> LayerCaches:
    pick = lambda n, o: select_rows(rows, n, o)  # noqa: E731
    return dataclasses.replace(self, layers=tuple(each_cache(pick, n, o) for n, o in zip(self.layers, old.layers)))

  def reset_rows(self, rows: jax.Array) -> LayerCaches:
    return dataclasses.replace(self, layers=tuple(each_cache(lambda c: reset_rows(c, rows), c) for c in self.layers))

  def nbytes(self) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.layers)))


# ------------------------------------------------------------------------------------------------
# Flax's decode convention: a layer's cache in its own nnx.Cache state
# ------------------------------------------------------------------------------------------------


class NNXDecoding:
  """`layers.NNXDecoding`: a `FirstPassageAttention` decoding the NNX way (`init_cache`,
  `decode=True`) keeps one `LayerCache` in its `nnx.Cache` state under a per-layer policy; a call
  of one token is a `Decode` step, of T > 1 tokens an `Extend` chunk (a prompt at once: the layer's
  own kernel while the cache is empty)."""

  def init(self, layer, batch: int, max_len: int, dtype, policy, policy_kw: dict):
    if isinstance(policy, PolicyRule) and policy.resolved and not policy_kw:
      pol = policy
    else:
      pol = as_policy(policy, **policy_kw).resolve(max_len)
    if pol.is_global:
      raise ValueError(
        "fpa_global shares one slot pool across every layer, which a layer's own cache (init_cache, decode=True) "
        "cannot: decode the model in the threaded form (its __call__ hands cache= to its layers; "
        "fpa_jax.inference.generate / Decoder), or give each layer fpa_budget"
      )
    pol.check_prefill("decode")  # token by token: snapkv ranks a whole prompt's keys and cannot
    pol.check_model(layer)
    (thr, coef, cap), *_ = pol.layer_thresholds(layer, max_len)
    cfg = layer.cfg
    cache = init_layer_state(
      pol, 0, batch, None, cfg.kv_heads, cfg.head_dim, dtype=dtype, threshold=thr, key_coef=coef, key_cap=cap
    )  # the layer is the whole model here (FPAHeads: a split of one layer)
    return cache, pol

  def attend(self, state: LayerCache | HeadCaches, policy: PolicyRule, start, spec, q, k, v, gates):
    b, t = q.shape[:2]
    at = jnp.full((b,), start, jnp.int32)
    run = Decode(policy, at) if t == 1 else Extend(policy, jnp.full((b,), t, jnp.int32), at)
    out, view = layer_view(state, run, 0).attend(spec, q, k, v, gates)
    return out, view.state


register_nnx_decoding(NNXDecoding())
