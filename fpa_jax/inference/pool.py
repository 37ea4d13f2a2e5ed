"""fpa_global's cache: one slot pool per row shared by every layer and kv head (as paged attention).

Shape legend: B batch, G pool slots per row, L layers, KVH kv heads, H query heads, K head dim.

The global budget is policy.keys * L * KVH keys per row for the whole cache, and the pool is sized
to fit in their bytes: G slots per row (`FPAGlobal.pool_slots`), the most whose pool with its int32
owner tags, the gate carries and the packed index fits in the bytes of that many cached keys, so it
allocates at most what `fpa_budget`'s per-head caches allocate at the same budget
(`decode.cache_bytes`); between steps it holds up to G - L * KVH keys. A slot holds one key of one
(layer, kv head), its owner = layer * KVH + kv head (-1: the slot holds no key).

Cost per token (`FPAGlobal.pool_impl`; every implementation keeps the same keys and decodes the same
tokens): "packed" (default) sorts the pool by owner every N = `policy.pack_steps` steps (`repack`,
between blocks of N steps: `scan_steps`), so each head's keys lie side by side in a range
[start, start + count) (`PackIndex`); a layer reads, per kv head, a window of the least static
width C >= its widest range (`_widths`, steps of 2 ** (1/4), picked by `lax.switch`) plus the N
slots its keys of the steps since went to, in one gather: attention O(KVH * (C + N)) per layer,
about the keys each head holds, and the sort costs O(G log G) / N per step. Keys evicted inside a
range stay masked until the next repack; new keys go to any free slot and are found through the
lists. "masked" attends each query head over the whole pool masked to its own slots, so a layer
reads all G slots, O(G) per head (no index, no repack). "gather" lists each head's slots every
step and gathers them into the least of a few static capacities that holds them
(`_attend_gathered`): attention O(keys the head holds), plus O(G) to list them, slower than both
on CPU. Eviction takes the step's at most L * KVH keys by three top-k passes over the pool
(`evict_few`); "reference" is the masked attention with eviction by one sort of the pool (the
original implementation, kept to test against).

A decode step, per layer l (`pool_decode_attend`, what the layer's `PoolView.attend` runs):
advance the running min of the slots layer l owns with their head's field (gathered by owner),
evict a head's victim if it is at its optional per-head limit (`policy.head_cap`), write the KVH
new keys into free slots, attend. After the whole step `pool_evict` frees slots across all layers
and heads (largest penalty first, ties oldest, then lower owner; never the last W keys of a head)
down to G - L * KVH keys, so the next step's L * KVH new keys always find free slots.

Per-layer state that is not per key (the gate's running sum `carry` [B, KVH]) stays per layer in
`GlobalCache.carry`. The model's cached loop threads the pool from one layer's attend to the next
(`GlobalCache.with_run`: layer l's view holds the pool layer l - 1 left), so the L views of one step
share one pool; `GlobalCache.settle` runs `pool_evict` after the step. `GlobalCache` is a
`cache.DecodeState`, as the per-layer caches are: the decoder never asks which one it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from fpa_jax.inference.cache import Decode, LayerCache, _sanitize, pick_rows
from fpa_jax.inference.policies import PolicyRule
from fpa_jax.ops import first_passage as fp
from fpa_jax.ops.common import F32

_EXACT = 2**24  # float32 holds every integer below it: slots, positions, owners compared as floats


class SlotPool(NamedTuple):
  """G slots per row for all layers and kv heads together.

  k, v:    [B, G, K] keys / values (compute dtype).
  level:   [B, G] fp32 key levels.
  run_min: [B, G] fp32 min of the owner's field over (key, now]; +inf right after a key is written.
  pos:     [B, G] int32 position of the key in its row (-1: never written).
  alive:   [B, G] bool the slot holds a key (owner >= 0 exactly then).
  score:   [B, G] fp32 unused by fpa_global (kept so the per-slot bytes match `LayerCache`'s).
  owner:   [B, G] int32 layer * KVH + kv head of the slot's key; -1 when it holds none.
  """

  k: jax.Array
  v: jax.Array
  level: jax.Array
  run_min: jax.Array
  pos: jax.Array
  alive: jax.Array
  score: jax.Array
  owner: jax.Array

  @property
  def penalty(self) -> jax.Array:
    """[B, G] current first-passage penalty of each slot's key (0 on free slots)."""
    return jnp.where(self.alive, fp.penalty(self.level, self.run_min), 0.0)


class PackIndex(NamedTuple):
  """Where each owner's keys lie in a repacked pool (`FPAGlobal.pool_impl` "packed"); O = L * KVH owners,
  N = `policy.pack_steps` steps between repacks.

  start, count: [B, O] int32 owner o's range [start, start + count): its keys at the last repack,
                side by side (`repack`); the range's slots evicted since are masked, not reused by o's range.
  since:        [B] int32 the first position after the last repack: a slot holds one of the range's own
                keys exactly while it is alive with pos < since (newer keys are in `new_slot`).
  new_slot:     [B, O, N] int32 the slot owner o's key of the i-th step since the repack went to (G: none).
  new_pos:      [B, N] int32 that step's position: an entry is live while its slot still holds that key.
  step:         [B] int32 steps since the repack (< N between steps).
  """

  start: jax.Array
  count: jax.Array
  since: jax.Array
  new_slot: jax.Array
  new_pos: jax.Array
  step: jax.Array


class GlobalCache(NamedTuple):
  """fpa_global's `cache.DecodeState`: the pool, each layer's gate carry [B, KVH] and, for
  `pool_impl="packed"`, where each owner's keys lie (`PackIndex`; None otherwise). With a call's
  `run` (a `cache.Decode`) it is also the `models.ModelCache` of the step: layer i's view
  (`PoolView`) holds the pool the layers before it left."""

  pool: SlotPool
  carry: tuple[jax.Array, ...]
  index: PackIndex | None = None
  run: Decode | None = None

  @property
  def n_layers(self) -> int:
    return len(self.carry)

  @property
  def kv_heads(self) -> int:
    return self.carry[0].shape[1]

  # ------------------------------------------------------------------ one step (`models.ModelCache`)
  def with_run(self, run) -> GlobalCache:
    if not isinstance(run, Decode):
      raise ValueError(
        "fpa_global's slot pool runs decode steps only: its parallel prefill builds per-layer candidates "
        "(decode.prefill_parallel), and it cannot extend chunk by chunk (use a per-layer policy, e.g. fpa_budget)"
      )
    return self._replace(run=run)

  def layer(self, i: int) -> PoolView:
    run = self.run
    return PoolView(self.pool, self.carry[i], i, run.policy, run.positions, self.index)

  def update(self, i: int, new: PoolView) -> GlobalCache:
    carry = self.carry[:i] + (new.carry,) + self.carry[i + 1 :]
    return self._replace(pool=new.pool, carry=carry, index=new.index)

  def settle(self, entry: GlobalCache, *, repack: bool = True) -> GlobalCache:
    """The step's end: `pool_evict` across every layer and head (with `repack`, the repack when
    due); rows that did not take the token (`Decode.active`) get `entry`'s pool back whole (the
    eviction spans their layers)."""
    run = self.run
    done = pool_evict(self._replace(run=None), run.policy, run.positions, repack_due=repack)
    return done if run.active is None else done.select_rows(run.active, entry)

  # ------------------------------------------------------------------ between steps
  def occupancy(self) -> tuple[jax.Array, jax.Array]:
    held_ = held(self).astype(F32)
    return jnp.max(held_), held_

  def overflow(self) -> jax.Array:
    return jnp.zeros((), bool)  # fpa_global has no threshold: it never overflows

  def lost(self) -> jax.Array:
    return jnp.zeros((), F32)  # the pool reuses slots: no lost mass is measured (cached_logits measures it per layer)

  def select_rows(self, rows: jax.Array, old: GlobalCache) -> GlobalCache:
    return jax.tree.map(functools.partial(pick_rows, rows), self._replace(run=None), old._replace(run=None))

  def reset_rows(self, rows: jax.Array) -> GlobalCache:
    r = rows[:, None]
    pool = self.pool._replace(
      pos=jnp.where(r, -1, self.pool.pos),
      alive=jnp.where(r, False, self.pool.alive),
      owner=jnp.where(r, -1, self.pool.owner),
      run_min=jnp.where(r, jnp.inf, self.pool.run_min),
    )
    return self._replace(pool=pool, carry=tuple(jnp.where(r, 0.0, c) for c in self.carry))

  def nbytes(self) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self._replace(run=None))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolView:
  """The cache one layer sees during a step (a `layers.AttentionCache`): the shared pool, its own
  carry and (static) index, and the step's policy (static) and positions [B]."""

  pool: SlotPool
  carry: jax.Array  # [B, KVH] the gate's running sum of field increments
  layer: int = dataclasses.field(metadata=dict(static=True))
  policy: PolicyRule | None = dataclasses.field(default=None, metadata=dict(static=True))
  positions: jax.Array | None = None  # [B] the step's token positions
  index: PackIndex | None = None  # pool_impl "packed": where each owner's keys lie

  def attend(self, spec, q, k, v, gates):
    """`pool_decode_attend` at the layer's `spec.scale` -> (out [B, 1, H, K], the view after it)."""
    kw = dict(policy=self.policy, scale=spec.scale, positions=self.positions)
    return pool_decode_attend(self, q, k, v, gates.field, gates.level, gates.cum, **kw)


def init_pool(batch: int, slots: int, head_dim: int, *, dtype=F32) -> SlotPool:
  bg = (batch, slots)
  return SlotPool(
    k=jnp.zeros(bg + (head_dim,), dtype),
    v=jnp.zeros(bg + (head_dim,), dtype),
    level=jnp.zeros(bg, F32),
    run_min=jnp.full(bg, jnp.inf, F32),
    pos=jnp.full(bg, -1, jnp.int32),
    alive=jnp.zeros(bg, bool),
    score=jnp.zeros(bg, F32),
    owner=jnp.full(bg, -1, jnp.int32),
  )


def init_global_cache(batch: int, slots: int, n_layers: int, kv_heads: int, head_dim: int, *, dtype=F32):
  """An empty `GlobalCache`: a pool of `slots` (= G) slots per row and L zero carries."""
  carry = tuple(jnp.zeros((batch, kv_heads), F32) for _ in range(n_layers))
  return GlobalCache(init_pool(batch, slots, head_dim, dtype=dtype), carry)


def held(cache: GlobalCache) -> jax.Array:
  """[L, B, KVH] int32 keys each (layer, row, kv head) holds."""
  n = cache.n_layers * cache.kv_heads
  b = cache.pool.pos.shape[0]
  tag = jnp.where(cache.pool.alive, cache.pool.owner, n)  # free slots -> out of range, dropped
  count = jnp.zeros((b, n), jnp.int32).at[jnp.arange(b)[:, None], tag].add(1, mode="drop")
  return count.reshape(b, cache.n_layers, cache.kv_heads).transpose(1, 0, 2)


def _head_mask(pool: SlotPool, layer: int, kv_heads: int) -> jax.Array:
  """[B, KVH, G] slot g holds a key of (layer, kv head j)."""
  tags = layer * kv_heads + jnp.arange(kv_heads, dtype=jnp.int32)
  return pool.alive[:, None, :] & (pool.owner[:, None, :] == tags[None, :, None])


def _free_slots(free: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """The first n free slots of each row, in slot order: free [B, G] -> (slots [B, n] int32, no room
  [B, n] bool; a slot without room is G, which the scatters drop)."""
  b, g = free.shape
  if g < _EXACT:  # one top_k of n (the slot index as a float) instead of a cumsum and n compares over G
    val, slot = jax.lax.top_k(jnp.where(free, -jnp.arange(g, dtype=F32), -jnp.inf), n)
    no_room = val == -jnp.inf
  else:
    rank = jnp.cumsum(free, axis=1) - 1  # [B, G] index of each free slot among the free ones
    pick = free[:, None, :] & (rank[:, None, :] == jnp.arange(n)[None, :, None])  # [B, n, G]
    no_room = ~jnp.any(pick, axis=2)
    slot = jnp.argmax(pick, axis=2)
  return jnp.where(no_room, g, slot).astype(jnp.int32), no_room


def _head_limit(policy: PolicyRule, slots: int) -> int:
  """The most keys one (layer, kv head) can hold during a step: its per-head limit, the sequence
  length (`policy.capacity` without one) or the whole pool, whichever is least."""
  return min(policy.capacity, slots)


def _buckets(limit: int) -> tuple[int, ...]:
  """Static per-head capacities (ascending, the last `limit`) a step picks the least sufficient of:
  halvings of `limit`, so a head never gathers more than twice what it holds (above 16 keys)."""
  out, c = [limit], limit
  while c > 16:
    c = -(-c // 2)
    out.append(c)
  return tuple(sorted(set(out)))


def _widths(limit: int) -> tuple[int, ...]:
  """ "packed"'s static window widths, ascending: `limit` over 2 ** (i / 4), i = 0..20 (down to
  limit / 32), so a layer reads at most 1.19x the slots of its widest range: ranges hover around
  the mean budget, where halvings (`_buckets`) would often read twice that. 21 branches at most."""
  return tuple(sorted({max(1, math.ceil(limit / 2 ** (i / 4))) for i in range(21)}))


def _attend_masked(qg, pool: SlotPool, mine, scale: float, limit: int):
  """Every query head over the whole pool [B, G], masked to its own slots: O(G) per head (the
  reference layout, `FPAGlobal.pool_impl` "masked", "reference"). qg [B, KVH, H/KVH, K]; mine [B, KVH, G]."""
  s = jnp.einsum("bhgk,bsk->bhgs", qg, pool.k, preferred_element_type=F32) * scale  # [B, KVH, G/H, G]
  logits = s - pool.penalty[:, None, None, :]
  p = jax.nn.softmax(jnp.where(mine[:, :, None, :], logits, -jnp.inf), axis=-1)
  return jnp.einsum("bhgs,bsk->bhgk", p.astype(pool.v.dtype), pool.v, preferred_element_type=F32)


def _attend_gathered(qg, pool: SlotPool, mine, scale: float, limit: int):
  """Each kv head's query heads over its own slots only, gathered from the pool: O(keys it holds).

  Per kv head j, the least capacity C of `_buckets(limit)` that holds its keys in every row is
  picked at run time (`lax.switch`: shapes stay static, only the chosen branch runs), its slots are
  listed in pool order (ranks of a cumsum, scattered into C entries) and gathered. Heads pick
  separately, so a head that holds few keys costs little while another holds many.
  """
  caps = _buckets(limit)
  n = jnp.sum(mine, axis=-1)  # [B, KVH]
  pen = pool.penalty
  outs = []
  for j in range(qg.shape[1]):
    pick = jnp.searchsorted(jnp.asarray(caps), jnp.max(n[:, j]))  # the least capacity >= its keys
    branches = [functools.partial(_attend_slots, c, scale) for c in caps]
    outs.append(jax.lax.switch(pick, branches, qg[:, j], pool.k, pool.v, pen, mine[:, j]))
  return jnp.stack(outs, axis=1)


def _attend_slots(c: int, scale: float, q, k, v, pen, mine):
  """q [B, H/KVH, K] over the (at most c) slots `mine` [B, G] marks in k, v [B, G, K], pen [B, G]
  -> [B, H/KVH, K] fp32."""
  b, g = mine.shape
  rank = jnp.where(mine, jnp.cumsum(mine, axis=1) - 1, c)  # [B, G]; c: not this head's, dropped
  idx = (
    jnp.full((b, c), g, jnp.int32)
    .at[jnp.arange(b)[:, None], rank]
    .set(jnp.arange(g, dtype=jnp.int32)[None], mode="drop")
  )
  held = idx < g  # [B, C]
  idx = jnp.where(held, idx, 0)
  kk = jnp.take_along_axis(k, idx[..., None], axis=1)  # [B, C, K]
  vv = jnp.take_along_axis(v, idx[..., None], axis=1)
  s = jnp.einsum("bgk,bck->bgc", q, kk, preferred_element_type=F32) * scale
  logits = s - jnp.take_along_axis(pen, idx, axis=1)[:, None, :]
  p = jax.nn.softmax(jnp.where(held[:, None, :], logits, -jnp.inf), axis=-1)
  return jnp.einsum("bgc,bck->bgk", p.astype(vv.dtype), vv, preferred_element_type=F32)


def _attend_packed(qg, pool: SlotPool, index: PackIndex, layer: int, scale: float, limit: int):
  """Each kv head's query heads over its range of the repacked pool plus the keys it wrote since:
  O(C_h + N) per kv head, C_h its range's width (rounded up, steps of 2^1/4), no per-step listing.

  Per kv head, the least width C_h of `_widths(limit)` that holds its range in every row is picked
  at run time (`lax.switch`: static shapes, only the chosen branch runs): the C_h slots from the
  range's start (a window that may reach into its neighbours' ranges, masked) and the N slots its
  keys of the steps since the repack went to. Each head has its own width because a global budget
  makes the ranges unequal (a retrieval head may hold most of the pool): one width per layer, its
  widest head's, made every head read as much (on a trained model, 1.42x `full`'s time per token;
  per head about 1.0x, docs/inference.md), for a little more per token where heads are alike.
  What does not depend on the width is done once per layer, outside the switch: each slot's
  penalty with the masks folded in (+inf: not a range's own key), and the N new keys of every head
  (a branch then slices three arrays: k, v and that penalty; op count, not flops, is the CPU's cost).
  qg [B, KVH, H/KVH, K] -> [B, KVH, H/KVH, K] fp32.
  """
  b, g = pool.pos.shape
  kvh = qg.shape[1]
  lo = layer * kvh
  pen = fp.penalty(pool.level, pool.run_min)  # [B, G]
  # A range's own keys: its slots alive with pos < since (they have not moved since the repack; a
  # key written since sits in a free slot anywhere, its own range's included, and is listed in ns).
  own = jnp.where(pool.alive & (pool.pos < index.since[:, None]), pen, jnp.inf)  # [B, G]
  ns = index.new_slot[:, lo : lo + kvh]  # [B, KVH, N]: the slots the layer's keys since went to
  idx = jnp.minimum(ns, g - 1).reshape(b, kvh * ns.shape[-1])
  new = lambda x: jnp.take_along_axis(x, idx if x.ndim == 2 else idx[..., None], axis=1).reshape(ns.shape + x.shape[2:])
  tags = (lo + jnp.arange(kvh, dtype=jnp.int32))[None, :, None]
  live = (ns < g) & (new(pool.owner) == tags) & (new(pool.pos) == index.new_pos[:, None, :])
  new_pen, new_k, new_v = jnp.where(live, new(pen), jnp.inf), new(pool.k), new(pool.v)  # [B, KVH, N, ...]
  widths = _widths(limit)
  branches = [functools.partial(_attend_window, c, scale) for c in widths]
  count = index.count[:, lo : lo + kvh]  # [B, KVH]
  pick = jnp.searchsorted(jnp.asarray(widths), jnp.max(count, axis=0))  # [KVH] each head's least width >= its ranges
  start = index.start[:, lo : lo + kvh]
  outs = []
  for h in range(kvh):  # kv head h's part of each per-head array; the pool's k, v, own go whole
    hs = [x[:, h : h + 1] for x in (qg, start, count, new_k, new_v, new_pen)]
    outs.append(jax.lax.switch(pick[h], branches, hs[0], pool.k, pool.v, own, *hs[1:]))
  return jnp.concatenate(outs, axis=1)


def _window(x: jax.Array, start: jax.Array, c: int) -> jax.Array:
  """x [B, G, ...], start [B, KVH] -> [B, KVH, c, ...]: each (row, kv head)'s c slots from its start,
  one contiguous slice each (a gather of B * KVH slices: far cheaper on CPU than c * B * KVH
  single-slot gathers)."""
  one = lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, c, axis=0)
  return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(x, start)


def _attend_window(c: int, scale: float, qg, k, v, own, start, count, new_k, new_v, new_pen):
  """`_attend_packed` at window width c for kv heads qg [B, KVH', H/KVH, K]: k, v [B, G, K] and own
  [B, G] the pool's (own: penalty, +inf where no range's own key), start, count [B, KVH'] their
  ranges, new_k, new_v [B, KVH', N, K] and new_pen [B, KVH', N] (+inf: not held) their keys since."""
  g = own.shape[1]
  s0 = jnp.clip(start, 0, g - c)  # the window stays inside the pool; it then starts before the range
  win = s0[..., None] + jnp.arange(c, dtype=jnp.int32)  # [B, KVH', C]
  inside = (win >= start[..., None]) & (win < (start + count)[..., None])  # not a neighbour's range
  pen = jnp.concatenate([jnp.where(inside, _window(own, s0, c), jnp.inf), new_pen], axis=-1)  # [B, KVH', C + N]
  kk = jnp.concatenate([_window(k, s0, c), new_k], axis=2)
  vv = jnp.concatenate([_window(v, s0, c), new_v], axis=2)
  s = jnp.einsum("bhgk,bhck->bhgc", qg, kk, preferred_element_type=F32) * scale
  logits = jnp.where((pen < jnp.inf)[:, :, None, :], s - pen[:, :, None, :], -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhgc,bhck->bhgk", p.astype(vv.dtype), vv, preferred_element_type=F32)


def repack(cache: GlobalCache, policy: PolicyRule) -> GlobalCache:
  """The pool sorted by owner (free slots last) and a fresh `PackIndex`: each owner's keys side by
  side in [start, start + count), nothing written since (since: one past the newest key held,
  positions only grow). One sort of the G slots per row, every `policy.pack_steps` steps
  (`scan_steps`, or `pool_evict` when due). Only slots move: every (layer, kv head) holds the same
  keys."""
  pool = cache.pool
  b, g = pool.pos.shape
  n_own = cache.n_layers * cache.kv_heads
  key = jnp.where(pool.alive, pool.owner, n_own)  # free slots sort last
  iota = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[None], (b, g))
  key, perm = jax.lax.sort((key, iota), dimension=1, num_keys=1, is_stable=True)
  take = lambda x: jnp.take_along_axis(x, perm if x.ndim == 2 else perm[..., None], axis=1)
  pool = SlotPool(*(take(x) for x in pool))
  tags = jnp.arange(n_own, dtype=jnp.int32)
  start = jax.vmap(lambda r: jnp.searchsorted(r, tags, side="left"))(key).astype(jnp.int32)
  end = jax.vmap(lambda r: jnp.searchsorted(r, tags, side="right"))(key).astype(jnp.int32)
  n = policy.pack_steps
  index = PackIndex(
    start=start,
    count=end - start,
    since=jnp.max(jnp.where(pool.alive, pool.pos, -1), axis=1).astype(jnp.int32) + 1,
    new_slot=jnp.full((b, n_own, n), g, jnp.int32),
    new_pos=jnp.full((b, n), -1, jnp.int32),
    step=jnp.zeros((b,), jnp.int32),
  )
  return cache._replace(pool=pool, index=index)


def prepare(cache: GlobalCache, policy: PolicyRule) -> GlobalCache:
  """A `GlobalCache` ready for `policy`'s implementation: "packed" repacks it and adds its
  `PackIndex`; the other implementations need no index (None)."""
  if policy.pool_impl == "packed":
    return repack(cache, policy)
  return cache._replace(index=None)


def scan_steps(body, init, xs, policy: PolicyRule):
  """`lax.scan(body, init, xs)` for a decode loop whose carry's first element is the step's cache
  (per-layer caches or a `GlobalCache`); `body(carry, x, repack=...)` passes `repack` on to
  `pool_evict`. pool_impl "packed": the steps run in blocks of `policy.pack_steps`, the pool
  repacked before each block, outside the loop's step (a repack under a condition inside the step
  would copy the whole pool at every step: the carry cannot stay in place through a conditional).
  -> (carry, stacked outputs) as `lax.scan`."""
  n = jax.tree.leaves(xs)[0].shape[0]
  if not (policy.is_global and policy.pool_impl == "packed") or n == 0:
    return jax.lax.scan(functools.partial(body, repack=True), init, xs)
  every = policy.pack_steps
  step = functools.partial(body, repack=False)  # at most pack_steps steps after each repack

  def block(carry, xb):
    carry = (repack(carry[0], policy),) + tuple(carry[1:])
    return jax.lax.scan(step, carry, xb)

  full, rest = divmod(n, every)
  ys = []
  carry = init
  if full:
    xb = jax.tree.map(lambda x: x[: full * every].reshape((full, every) + x.shape[1:]), xs)
    carry, y = jax.lax.scan(block, carry, xb)
    ys.append(jax.tree.map(lambda a: a.reshape((full * every,) + a.shape[2:]), y))
  if rest:
    carry, y = block(carry, jax.tree.map(lambda x: x[full * every :], xs))
    ys.append(y)
  return carry, jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *ys)


def pool_decode_attend(view: PoolView, q, k, v, field, level, cum, *, policy: PolicyRule, scale: float, positions):
  """One token per row for layer `view.layer` against the shared pool: advance, cap, insert, attend.

  Args as `cache.decode_attend`: q [B, 1, H, K]; k, v [B, 1, KVH, K]; field, level, cum [B, 1, KVH];
  positions [B]. The KVH new keys go to the first KVH free slots of the row: `pool_evict` after
  the previous step (or `pool_from_caches` after a prefill) left at most G - L * KVH keys, so
  there are always enough; were there not (a pool built by hand), a kv head without a free slot
  writes nothing and its query heads get NaN: no key is ever overwritten.
  Returns (out [B, 1, H, K], the view with the new pool and this layer's carry).
  """
  pool, layer = view.pool, view.layer
  b, g = pool.pos.shape
  kvh = k.shape[2]

  (f, lv), bad = _sanitize(field[:, 0], level[:, 0])  # [B, KVH]; disallowed values as in decode_attend
  head = pool.owner - layer * kvh  # the slot's kv head if this layer owns it
  mine = pool.alive & (head >= 0) & (head < kvh)  # [B, G]
  f_slot = sum(
    jnp.where(head == j, f[:, j : j + 1], 0.0) for j in range(kvh)
  )  # [B, G] its head's field (a select: CPU gathers are slow)
  run_min = jnp.where(mine, fp.advance(pool.run_min, f_slot), pool.run_min)
  pool = pool._replace(run_min=run_min)
  if policy.head_cap is not None:  # a head at its limit drops its victim (fpa_budget's rule, per head)
    own = _head_mask(pool, layer, kvh)  # [B, KVH, G]
    full = jnp.sum(own, axis=-1) >= policy.capacity  # [B, KVH]
    pen, pos = (jnp.broadcast_to(x[:, None, :], own.shape) for x in (pool.penalty, pool.pos))
    out_slot = fp.victim(pen, pos, own, positions[:, None, None], policy.recent, axis=2)  # [B, KVH]
    gone = jnp.any(full[:, :, None] & (jnp.arange(g)[None, None, :] == out_slot[:, :, None]), axis=1)  # [B, G]
    pool = pool._replace(alive=pool.alive & ~gone, owner=jnp.where(gone, -1, pool.owner))
  slot, no_room = _free_slots(~pool.alive, kvh)  # [B, KVH]; no_room: fewer free slots than kv heads
  index = view.index
  if policy.pool_impl == "packed":
    if index is None:
      raise ValueError(
        "pool_impl='packed' needs the pool's PackIndex: build the cache with decode.init_caches / "
        "prefill_parallel, or pass it through pool.prepare(cache, policy)"
      )
    col = jnp.arange(policy.pack_steps)[None] == index.step[:, None]  # [B, N] this step's column
    lo = layer * kvh
    ns = index.new_slot.at[:, lo : lo + kvh].set(
      jnp.where(col[:, None], slot[:, :, None], index.new_slot[:, lo : lo + kvh])
    )
    index = index._replace(new_slot=ns, new_pos=jnp.where(col, positions[:, None], index.new_pos))
  bi = jnp.arange(b)[:, None]
  put = lambda x, val: x.at[bi, slot].set(val.astype(x.dtype))
  tags = jnp.broadcast_to(layer * kvh + jnp.arange(kvh, dtype=jnp.int32)[None], (b, kvh))
  pool = SlotPool(
    k=put(pool.k, k[:, 0]),
    v=put(pool.v, v[:, 0]),
    level=put(pool.level, lv),
    run_min=put(pool.run_min, jnp.full_like(lv, jnp.inf)),
    pos=put(pool.pos, jnp.broadcast_to(positions[:, None], (b, kvh))),
    alive=put(pool.alive, jnp.ones((b, kvh), bool)),
    score=put(pool.score, jnp.zeros_like(lv)),
    owner=put(pool.owner, tags),
  )
  _, _, h, dk = q.shape
  qg = q[:, 0].reshape(b, kvh, h // kvh, dk)  # query head h -> kv head h // (H / KVH)
  if policy.pool_impl == "packed":
    out = _attend_packed(qg, pool, index, layer, scale, _head_limit(policy, g))
  else:
    attend = _attend_gathered if policy.pool_impl == "gather" else _attend_masked
    out = attend(qg, pool, _head_mask(pool, layer, kvh), scale, _head_limit(policy, g))  # mine [B, KVH, G]
  out = jnp.where((no_room | bad)[:, :, None, None], jnp.nan, out)
  new = dataclasses.replace(view, pool=pool, carry=cum[:, 0].astype(F32), index=index)
  return out.reshape(b, h, dk).astype(q.dtype)[:, None], new


def pool_evict(cache: GlobalCache, policy: PolicyRule, now: jax.Array, *, repack_due: bool = True) -> GlobalCache:
  """Between steps: evict across all layers and heads of a row down to G - L * KVH keys.

  The rule of `decode.global_evict` on the pool: the keys that may go are those outside every
  head's protected window (positions <= now + 1 - W), largest penalty (plus `head_offset`) first,
  ties oldest, then lower owner (layer, head); `now` [B] is the position of the last key written. Evicted slots are
  freed (alive False, owner -1) for the next step's new keys. pool_impl "packed": the step is
  counted and, with `repack_due`, the pool repacked once `policy.pack_steps` steps have been
  written since the last repack (a loop that repacks itself, `scan_steps`, passes False).
  """
  pool = cache.pool
  limit = pool.pos.shape[1] - cache.n_layers * cache.kv_heads  # G - L * KVH: room for the next step's keys
  cand = pool.alive & (pool.pos <= now[:, None] + 1 - policy.recent)
  excess = jnp.maximum(jnp.sum(pool.alive, axis=1) - limit, 0)  # [B]
  pen = policy.evict_order(pool.penalty, pool.owner)
  if policy.pool_impl == "reference":
    gone = fp.evict_largest(pen, pool.pos, pool.owner, cand, excess)
  else:
    gone = evict_few(pen, pool.pos, pool.owner, cand, excess, cache.n_layers * cache.kv_heads)
  cache = cache._replace(pool=pool._replace(alive=pool.alive & ~gone, owner=jnp.where(gone, -1, pool.owner)))
  if policy.pool_impl != "packed":
    return cache
  cache = cache._replace(index=cache.index._replace(step=cache.index.step + 1))
  if not repack_due:
    return cache
  due = jnp.max(cache.index.step) >= policy.pack_steps  # the new-key lists are full: repack every row
  return jax.lax.cond(due, lambda c: repack(c, policy), lambda c: c, cache)


def evict_few(pen, pos, owner, cand, count, most: int) -> jax.Array:
  """`fp.evict_largest` (largest penalty first, ties oldest, then lower owner) when each row
  evicts at most `most` keys, as after a decode step (L * KVH new keys): a `lax.top_k` of `most`
  over the row by penalty, and a second by age and owner (one float, pos * O + owner, O one past
  the largest owner) only when a row's cut falls inside a tie, instead of one sort of all of it.
  pen, pos, owner, cand [B, N]; count [B] -> bool [B, N]. Rows evicting more, NaN penalties, or
  pos * O + owner from 2**24 on take the sort, so the result is always `fp.evict_largest`'s.
  """
  n = pen.shape[1]
  k = min(most, n)
  span = jnp.max(jnp.where(cand, owner, 0)) + 1  # O
  age = pos.astype(F32) * span.astype(F32) + owner.astype(F32)  # unique per key, exact below 2**24
  ok = (jnp.max(count) <= k) & ~jnp.any(cand & jnp.isnan(pen))
  ok &= jnp.all(~cand | ((pos >= 0) & (owner >= 0) & (pos < _EXACT // span) & (age < _EXACT)))

  def one_pass(gone, tie, need, key):
    # Keeps the larger-is-first key's need-th best value v: keys above v go, those at v are tied
    # and the next key decides among them; (pos, owner) is unique, so two passes do.
    x = jnp.where(tie, key, -jnp.inf)
    top = jax.lax.top_k(x, k)[0]  # [B, k] descending
    v = jnp.take_along_axis(top, jnp.clip(need - 1, 0, k - 1)[:, None], axis=1)
    above = tie & (x > v) & (need > 0)[:, None]
    need = need - jnp.sum(above, axis=1)
    return gone | above, tie & (x == v) & (need > 0)[:, None], need

  def few(pen, pos, owner, cand, count):
    gone, tie, need = one_pass(jnp.zeros_like(cand), cand, count, pen)

    def ties(gone, tie, need):
      gone, tie, need = one_pass(gone, tie, need, -age)  # oldest first, then lower owner
      return gone | tie

    # Where every key tied at the row's cut is needed (distinct penalties: the usual case), the
    # penalty pass alone decides: the age pass runs only when a row has more.
    more = jnp.any(jnp.sum(tie, axis=1) > need)
    return jax.lax.cond(more, ties, lambda gone, tie, need: gone | tie, gone, tie, need)

  return jax.lax.cond(ok, few, fp.evict_largest, pen, pos, owner, cand, count)


def pool_from_caches(caches: Sequence[LayerCache], slots: int) -> GlobalCache:
  """Per-layer, per-head caches (a parallel prefill's candidates, already cut to the global limit
  by `decode.global_evict`) -> a `GlobalCache` of `slots` slots per row holding their alive keys.

  The caches hold at most slots - L * KVH alive keys per row (the global limit), so all fit.
  """
  n_l = len(caches)
  b, s, kvh = caches[0].pos.shape
  n = n_l * s * kvh
  slot_major = lambda f, x: x.swapaxes(1, 2) if f in ("k", "v") else x  # LayerCache k, v: [B, KVH, S, K]
  stack = lambda f: jnp.stack([slot_major(f, getattr(c, f)) for c in caches], 1)  # [B, L, S, KVH, ...]
  flat = lambda x: x.reshape((b, n) + x.shape[4:])
  alive = flat(stack("alive"))
  tag = jnp.broadcast_to(
    (jnp.arange(n_l)[:, None, None] * kvh + jnp.arange(kvh)[None, None, :])[None], (b, n_l, s, kvh)
  )
  fields = dict(
    k=flat(stack("k")),
    v=flat(stack("v")),
    level=flat(stack("level")),
    run_min=flat(stack("run_min")),
    pos=flat(stack("pos")),
    alive=alive,
    score=jnp.zeros((b, n), F32),
    owner=jnp.where(alive, flat(tag).astype(jnp.int32), -1),
  )
  if n < slots:  # fewer candidates than slots: pad with free ones
    pad = init_pool(b, slots - n, fields["k"].shape[-1], dtype=fields["k"].dtype)
    fields = {f: jnp.concatenate([x, getattr(pad, f)], axis=1) for f, x in fields.items()}
    alive = fields["alive"]
  order = jnp.argsort(~alive, axis=1, stable=True)[:, :slots]  # the alive candidates first
  take = lambda x: jnp.take_along_axis(x, order if x.ndim == 2 else order[..., None], axis=1)
  pool = SlotPool(**{f: take(x) for f, x in fields.items()})
  pool = pool._replace(pos=jnp.where(pool.alive, pool.pos, -1), run_min=jnp.where(pool.alive, pool.run_min, jnp.inf))
  return GlobalCache(pool, tuple(c.carry for c in caches))


@contextlib.contextmanager
def stand_in(part: str):
  """For profiling only (`experiments/bench_decode.py`): programs traced inside run fpa_global's step
  with one part replaced by a stand-in of no cost, so a part's cost is the step's time minus the
  step's without it (the tokens such a program decodes mean nothing). part: "attention" (every
  head's attention, over its range or the whole pool) or "eviction" (`pool_evict` between steps)."""
  stubs = {
    "attention": {
      "_attend_masked": lambda qg, pool, mine, scale, limit: qg * pool.k[:, :1, :1].sum(),
      "_attend_packed": lambda qg, pool, index, layer, scale, limit: qg * pool.k[:, :1, :1].sum(),
    },
    "eviction": {"pool_evict": lambda cache, policy, now, repack_due=True: cache},
  }
  if part not in stubs:
    raise ValueError(f"part must be one of {sorted(stubs)}, got {part!r}")
  here = globals()
  old = {name: here[name] for name in stubs[part]}
  here.update(stubs[part])
  try:
    yield
  finally:
    here.update(old)
