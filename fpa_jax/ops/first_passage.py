"""The first-passage core: a key's state, its penalty and the eviction rule, one definition for
every op, cache and policy of the package (pure JAX, no Flax).

For query i and key j <= i,

    penalty[i, j] = dip(level_j, min(field_{j+1}, ..., field_i))      (`dip`: max(0, level - min))

and the range (j, i] is empty on the diagonal (min = +inf, penalty 0). A key's *first-passage
state* is its level and `run_min`, the min of the field over (j, now]: +inf when the key is
written, lowered by every later token (`advance`). Its penalty (`penalty`) therefore never
decreases, which is the eviction rule (`survives`): a key whose penalty reached a threshold is gone
for good, it would never have come back under it. Capacity eviction takes the largest penalty,
ties the oldest, outside a protected window of recent keys (`victim`, `evict_largest`).

Where the state is built (each form beside the float64 loop `reference_np.penalty_np`, in
tests/ops/test_first_passage.py):
  one token at a time  `advance`: `ops.recurrent`, `inference.cache`, `inference.pool`, `ops.budget`
  a whole prompt       `suffix_min` (each key's run_min after it), `run_min_at` (at sampled queries:
                       `ops.evictability`, SnapKV's observation window)
  all pairs (i, j)     three algorithmic forms of min over (j, i]:
    associative scan   `ops.penalty.first_passage_penalty` (and `column_min`, inside one tile)
    tile identity      `block_stats`: for a query block I after a key block J,
                       min over (j, i] = min(S_j, R[I, J], C_i) (`ops.bias`: chunked, sparse keys,
                       Pallas off-diagonal tiles)
    sparse table       `window_mins` / `table_min`: min(N_k[j], M_k[i]) for 2^k <= i - j < 2^(k+1)
                       (Pallas diagonal tiles)

Shapes: B batch, T tokens, S cache slots, H (kv) heads; every statistic is fp32 (`STATS_DTYPE`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fpa_jax.ops.common import STATS_DTYPE

_INF = float("inf")
_BIG = jnp.iinfo(jnp.int32).max

# ------------------------------------------------------------------------------------------------
# The penalty of a key
# ------------------------------------------------------------------------------------------------


def dip(level: jax.Array, low: jax.Array) -> jax.Array:
  """The penalty of a key at `level` below which the field reached `low`: level - low where
  level > low, else exactly 0. Equal to relu(level - low) on finite values and defined on all
  the others without an inf - inf: an empty range (low = +inf) gives 0 even for level = +inf,
  a level of +inf against a finite low gives +inf (a dead key), a level of -inf gives 0.
  Autodiff: d/dlevel = 1 and d/dlow = -1 where level > low, else 0 (no product with a value)."""
  return jnp.where(level > low, level - low, 0.0)


def penalty(level: jax.Array, run_min: jax.Array) -> jax.Array:
  """The current penalty of a cached key: dip(level, run_min), fp32; any matching shapes
  ([B, S, H] in a cache). 0 for a key just written (run_min = +inf), whatever its level."""
  return dip(level.astype(STATS_DTYPE), run_min)


def advance(run_min: jax.Array, field: jax.Array) -> jax.Array:
  """A new token's field lowers the running min of every key before it: min(run_min, field), fp32.
  `field` broadcasts against `run_min` (a cache's [B, S, H] takes field [B, 1, H]); the new key's
  own run_min is +inf (its range is empty), which the caller writes."""
  return jnp.minimum(run_min, field.astype(STATS_DTYPE))


def survives(pen: jax.Array, threshold: jax.Array) -> jax.Array:
  """The threshold eviction rule: True where a key stays (penalty < threshold), shapes broadcast.

  Final: a penalty never decreases, so a key that fails once fails at every later query, and
  evicting it at once drops nothing that would have come back (the `fpa` policies' bound rests
  on this; `ops.evictability`'s hard count is this rule at tau)."""
  return pen < threshold


# ------------------------------------------------------------------------------------------------
# Running minima
# ------------------------------------------------------------------------------------------------


def min_scan(x: jax.Array, axis: int, reverse: bool = False) -> jax.Array:
  """Inclusive running min along `axis` (an associative scan: the form autodiff of `lax.cummin`
  takes too, so values and gradients are those of either)."""
  return jax.lax.associative_scan(jnp.minimum, x, axis=axis % x.ndim, reverse=reverse)


def suffix_min(field: jax.Array, axis: int) -> jax.Array:
  """min of `field` over (j, end) for every j along `axis`, +inf for the last: each key's run_min
  after a whole prompt (tokens to leave out must be +inf). fp32, the shape of `field`."""
  f = field.astype(STATS_DTYPE)
  axis = axis % f.ndim
  tail = jax.lax.slice_in_dim(min_scan(f, axis, reverse=True), 1, None, axis=axis)
  inf = jnp.full_like(jax.lax.slice_in_dim(f, 0, 1, axis=axis), _INF)
  return jnp.concatenate([tail, inf], axis=axis)


def run_min_at(field: jax.Array, queries: jax.Array) -> jax.Array:
  """Every key's run_min as sampled queries see it: field [B, T, H], queries int [B, Q] ->
  [B, Q, T, H] fp32, min of the field over (j, i] for i = queries[b, q] (+inf for j >= i).
  O(B Q T H): never the [T, T] matrix."""
  seen = jnp.arange(field.shape[1])[None, None, :] <= queries[:, :, None]  # [B, Q, T]: s <= i
  return suffix_min(jnp.where(seen[..., None], field.astype(STATS_DTYPE)[:, None], _INF), axis=2)


def column_min(phi: jax.Array) -> jax.Array:
  """m[..., i, j] = min(phi over (j, i]) for j < i, +inf elsewhere: [..., n] -> [..., n, n]. The
  all-pairs scan inside one tile (O(n^2 log n)); `first_passage_penalty` is the same scan paired
  with the levels."""
  n = phi.shape[-1]
  below = jnp.arange(n)[:, None] > jnp.arange(n)[None, :]
  return min_scan(jnp.where(below, phi[..., :, None], _INF), -2)


# ------------------------------------------------------------------------------------------------
# Tile identity: per-block statistics
# ------------------------------------------------------------------------------------------------


def block_stats(phi: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The tiling identity's statistics of phi [..., nb, blk] (the field cut into nb blocks):

    S [..., nb, blk]  S_j = min of the field after j in its block (+inf for the block's last)
    C [..., nb, blk]  C_i = min of the field up to and including i in its block
    R [..., nb, nb]   R[I, J] = min of the block minima strictly between J and I (+inf if none)

  so that min over (j, i] = min(S_j, R[I, J], C_i) for i in block I after j in block J < I."""
  nb = phi.shape[-2]
  suffix = suffix_min(phi, -1)
  prefix = min_scan(phi, -1)
  # The block minima as a gather at their argmin, not phi.min(-1), whose pullback divides by the
  # count of entries equal to the min: XLA recomputes phi inside that count's fusion, and where
  # one copy is compiled to an FMA and the other not (XLA:CPU at backend optimisation level 0) the
  # count is 0 and the field's gradient 0/0 = NaN, even for a zero cotangent (as for nb = 1).
  bmin = jnp.take_along_axis(phi, jnp.argmin(phi, -1)[..., None], -1)[..., 0]  # [..., nb]
  # P[b, J] = min(bmin over (J, b]); R[I, J] = P[I - 1, J] = min over blocks strictly between.
  ib = jnp.arange(nb)
  p = min_scan(jnp.where(ib[:, None] > ib[None, :], bmin[..., :, None], _INF), -2)
  r = jnp.concatenate([jnp.full(p.shape[:-2] + (1, nb), _INF, STATS_DTYPE), p[..., :-1, :]], -2)
  return suffix, prefix, r


# ------------------------------------------------------------------------------------------------
# Sparse table: power-of-two windows
# ------------------------------------------------------------------------------------------------


def n_levels(blk: int) -> int:
  """Sparse-table levels for in-tile distances 1 .. blk - 1."""
  return (blk - 1).bit_length()


def _shift(x, n):
  """x[..., t + n] along the last axis (n > 0: look ahead, n < 0: look back), +inf outside."""
  t = x.shape[-1]
  if abs(n) >= t:
    return jnp.full_like(x, _INF)
  fill = jnp.full(x.shape[:-1] + (abs(n),), _INF, x.dtype)
  return jnp.concatenate([x[..., n:], fill], -1) if n > 0 else jnp.concatenate([fill, x[..., :n]], -1)


def window_mins(phi: jax.Array, levels: int) -> tuple[list[jax.Array], list[jax.Array]]:
  """The sparse table of phi [..., T]: (M, N), each `levels` arrays [..., T], with
  M_k[i] = min(phi over (i - 2^k, i]) and N_k[j] = min(phi over (j, j + 2^k]) (+inf outside).
  For 2^k <= i - j < 2^(k+1) the two windows cover (j, i] exactly (`table_min`)."""
  ms, ns = [], []
  m, n = phi, _shift(phi, 1)  # windows (i - 1, i] and (j, j + 1]
  for k in range(levels):
    ms.append(m)
    ns.append(n)
    m, n = jnp.minimum(m, _shift(m, -(2**k))), jnp.minimum(n, _shift(n, 2**k))  # disjoint halves: no ties
  return ms, ns


def table_min(ns, ms, dist: jax.Array) -> jax.Array:
  """min over (j, i] from the sparse table: ns[k] key-side (broadcasting over queries), ms[k]
  query-side, dist = i - j (int) -> the broadcast shape, +inf at distance <= 0 (an empty range)."""
  m = jnp.full(dist.shape, _INF, STATS_DTYPE)
  for k in range(len(ns)):  # ascending: the last level with 2^k <= i - j wins
    m = jnp.where(dist >= 2**k, jnp.minimum(ns[k], ms[k]), m)
  return m


# ------------------------------------------------------------------------------------------------
# Which key a full cache evicts
# ------------------------------------------------------------------------------------------------


def oldest_max(score: jax.Array, pos: jax.Array, mask: jax.Array, axis: int = 1) -> jax.Array:
  """Index along `axis` of the largest `score` among `mask`, ties to the oldest key (the smallest
  position `pos`); shapes broadcast. The order every capacity policy evicts in (score: the
  penalty for the fpa policies, 0 for the window ones, minus the attention mass for h2o / snapkv)."""
  p = jnp.where(mask, score, -jnp.inf)
  best = jnp.max(p, axis=axis, keepdims=True)
  return jnp.argmax(jnp.where(mask & (p == best), -pos, -_BIG), axis=axis)


def candidates(held: jax.Array, pos: jax.Array, now: jax.Array, recent, axis: int = 1) -> jax.Array:
  """The held keys a full cache may evict: those at positions <= now - recent (the newest
  `recent` positions up to `now` are protected), or every held key where none is, so a full cache
  always has one. held, pos, now broadcast; `recent` a static 0 protects nothing."""
  if isinstance(recent, int) and recent == 0:
    return held
  cand = held & (pos <= now - recent)
  return jnp.where(jnp.any(cand, axis, keepdims=True), cand, held)


def victim(pen: jax.Array, pos: jax.Array, held: jax.Array, now: jax.Array, recent, axis: int = 1) -> jax.Array:
  """The key a full cache evicts (`fpa_budget`): the largest penalty among the `candidates`, ties
  the oldest. -> indices along `axis` (the key axis removed)."""
  return oldest_max(pen, pos, candidates(held, pos, now, recent, axis), axis)


def evict_largest(pen: jax.Array, pos: jax.Array, owner: jax.Array, cand: jax.Array, count: jax.Array) -> jax.Array:
  """The global rule (`fpa_global`): per row, the `count` [B] candidates that go, largest penalty
  first, ties the oldest, then the lower owner (layer, head). pen, pos, owner, cand: [B, N] over
  all of a row's keys -> bool [B, N]. One sort of the row."""
  b, n = pen.shape
  idx = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (b, n))
  *_, order = jax.lax.sort((~cand, -pen, pos, owner, idx), dimension=1, num_keys=4)
  rank = jnp.zeros((b, n), jnp.int32).at[jnp.arange(b)[:, None], order].set(idx)
  return (rank < count[:, None]) & cand
