"""Evictability: how many old keys a query still keeps, as a differentiable count (pure math, no Flax).

A key j is dropped from an `fpa` cache at query i when its penalty is large,

    penalty[i, j] = max(0, level_j - min(field_{j+1}, ..., field_i)),

and since the penalty never decreases as i grows, a dropped key never comes back. The training
objective (`fpa_jax.losses`) asks the gate to make that rule cut the cache: on a few sampled queries i
it counts the keys outside a recent window of W tokens that are still "live",

    eligible(i, j) = j <= i - W  (and seg_j == seg_i when segment ids are given)
    live_i         = sum_{eligible j} sigmoid((tau - pen_ij) / temp)                   (soft count)
    live_frac_i    = live_i / #eligible(i)                                               in [0, 1]

and hinges `live_frac_i` at a target kept fraction. tau is the penalty (nats taken off the logit)
at which a key counts as half gone; temp the sigmoid's width.

The kink. With the exact penalty, a key at or below the running min of the field (level_j <=
min field on (j, i]) has penalty 0 and relu'(0) = 0: the objective can neither raise its level nor
push the field below it, so keys the gate has not started to forget never feel the pressure (and
with a near-flat initial field that is about half of them). `soft > 0` replaces relu inside the
objective only (the attention keeps the exact penalty) by a softplus of temperature `soft`,

    pen_soft = soft * log(1 + exp((level_j - runmin) / soft))     (-> relu as soft -> 0),

whose gradient sigmoid(d / soft) is positive everywhere and decays exponentially below the kink:
keys just under the running min get a pull upward, keys far under it (the field is nowhere near
forgetting them) almost none. The cost is a bias: a key exactly at the running min counts as
penalised by soft * log 2 nats (its soft count drops a little below the hard one); `soft = 0` is
the exact relu. The hard count (the exact penalty below tau, `first_passage.survives`) is
returned beside it for logging: it is what a threshold-tau policy would keep.

Cost: per sampled query a reverse running min of the field over (j, i] (`first_passage.run_min_at`):
O(B * Q * T * H) time and memory for Q sampled queries, never the [T, T] penalty matrix.

Budget in the loop, the objective's second form (a random cache per step, masked in the forward pass),
is `fpa_jax.ops.budget`: the same eviction as the `fpa_budget` decode, simulated for every query.

Shapes: B batch, T sequence, H heads (one gate per kv head; any trailing head axis works, the loss
module folds layers into it), Q sampled queries per sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fpa_jax.ops import first_passage as fp
from fpa_jax.ops.common import F32


class LiveCounts(NamedTuple):
  """Per sampled query: soft [B, Q, H] (differentiable), hard [B, Q, H] (penalty < tau, exact relu,
  no gradient), eligible [B, Q] (keys outside the window in the query's segment; 0 -> no keys)."""

  soft: jax.Array
  hard: jax.Array
  eligible: jax.Array


def sample_queries(key: jax.Array, batch: int, seq: int, n: int, window: int) -> jax.Array:
  """Stratified query positions int32 [batch, n] in [min(window, seq - 1), seq).

  The range is cut into n equal strata and one position drawn uniformly in each (per row), so
  early and late queries are both covered at a static count. A query i < window has no eligible
  key; when window >= seq every query is such (the counts are then 0)."""
  lo = min(int(window), int(seq) - 1)
  span = int(seq) - lo
  u = jax.random.uniform(key, (int(batch), int(n)))
  pos = lo + jnp.floor((jnp.arange(n)[None, :] + u) * (span / n)).astype(jnp.int32)
  return jnp.clip(pos, lo, seq - 1)


def live_counts(
  field: jax.Array,
  level: jax.Array,
  query_idx: jax.Array,
  *,
  window: int,
  tau: float,
  temp: float,
  soft: float = 0.0,
  segment_ids: jax.Array | None = None,
) -> LiveCounts:
  """Soft and hard live counts of the keys outside the recent window, at sampled queries.

  Args:
    field, level: [B, T, H] (cast to fp32).
    query_idx: int [B, Q] query positions in [0, T) (`sample_queries`).
    window: W >= 0; keys j <= i - W count (W = 0 includes the query itself, penalty 0).
    tau: penalty (nats) at which a key is half live; temp > 0: the sigmoid's width (nats).
    soft: softplus temperature for the penalty (0 = exact relu; see the module docstring).
    segment_ids: optional int [B, T]; keys of another segment are not eligible.
  Returns:
    LiveCounts (soft, hard [B, Q, H] fp32; eligible [B, Q] fp32). Under jit any query_idx is
    clipped into [0, T).
  """
  if not temp > 0:
    raise ValueError(f"need temp > 0 (the sigmoid's width in nats), got temp={temp}")
  pen, hard_pen, elig = pair_penalties(field, level, query_idx, window=window, soft=soft, segment_ids=segment_ids)
  e = elig[..., None].astype(F32)  # [B, Q, T, 1]
  soft_live = jnp.sum(e * jax.nn.sigmoid((tau - pen) / temp), axis=2)  # [B, Q, H]
  hard_live = jnp.sum(e * fp.survives(jax.lax.stop_gradient(hard_pen), tau), axis=2)
  return LiveCounts(soft_live, hard_live, jnp.sum(e[..., 0], axis=2))


def pair_penalties(
  field: jax.Array,
  level: jax.Array,
  query_idx: jax.Array,
  *,
  window: int,
  soft: float = 0.0,
  segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every (sampled query, key) pair's penalty: field, level [B, T, H], query_idx int [B, Q] ->
  (pen [B, Q, T, H] the objective's (softplus of temperature `soft`; the exact relu at soft 0),
  hard [B, Q, T, H] the exact penalty, eligible bool [B, Q, T]: keys j <= i - window in the
  query's segment). `live_counts` sums them; the utility objective labels them one by one."""
  if field.shape != level.shape or field.ndim != 3:
    raise ValueError(f"field and level must both be [B, T, H], got {field.shape} and {level.shape}")
  if query_idx.ndim != 2 or query_idx.shape[0] != field.shape[0]:
    raise ValueError(f"query_idx must be [B, Q] with B = {field.shape[0]}, got {query_idx.shape}")
  if int(window) < 0 or soft < 0:
    raise ValueError(f"need window >= 0, soft >= 0; got window={window}, soft={soft}")
  field, level = field.astype(F32), level.astype(F32)
  b, t, _ = field.shape
  qi = jnp.clip(query_idx.astype(jnp.int32), 0, t - 1)[:, :, None]  # [B, Q, 1]
  pos = jnp.arange(t, dtype=jnp.int32)[None, None, :]  # [1, 1, T]
  run_min = fp.run_min_at(field, qi[:, :, 0])  # [B, Q, T, H] min over (j, i]; +inf for j >= i
  lvl = level[:, None]  # [B, 1, T, H]
  hard_pen = fp.penalty(lvl, run_min)  # the exact penalty; 0 for j >= i (an empty range)
  pen = hard_pen
  if soft > 0:
    strict = (pos < qi)[..., None]  # [B, Q, T, 1]: a non-empty range (j = i has penalty 0)
    # Double where: j >= i never meets the +inf (value 0, gradient 0, no NaN).
    d = jnp.where(strict, lvl - jnp.where(strict, run_min, lvl), 0.0)
    pen = jnp.where(strict, soft * jax.nn.softplus(d / soft), 0.0)
  elig = pos <= qi - int(window)  # [B, Q, T]
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    elig = elig & (seg[:, None, :] == jnp.take_along_axis(seg, qi[:, :, 0], axis=1)[:, :, None])
  return pen, hard_pen, elig


def hinge_live_fraction(counts: LiveCounts, target, shared: bool = False) -> tuple[jax.Array, jax.Array]:
  """One-sided hinge at a kept fraction: (loss, live_frac [B, Q, H]).

  live_frac = soft / max(eligible, 1); loss = sum over (b, q, h) of eligible * relu(live_frac -
  target), divided by the sum of eligible (over the H heads too): a mean over (query, old key)
  pairs, so queries with long pasts (where a cache costs most) weigh most and a query with no
  eligible key weighs nothing (loss 0 if none has any). `target` in (0, 1] (a scalar; 1 = no
  pressure, since live_frac <= 1).

  shared=True: one budget for the H heads together (`fpa_global`'s, AdaKV's), not one each: the
  hinge is on the heads' mean live fraction, sum over (b, q) of eligible * relu(mean_h live_frac -
  target) / sum of eligible, so a head may keep more where another keeps less."""
  elig = counts.eligible[..., None]  # [B, Q, 1]
  frac = counts.soft / jnp.maximum(elig, 1.0)
  over = frac.mean(-1, keepdims=True) if shared else frac  # [B, Q, 1] one budget, or [B, Q, H] one each
  loss = jnp.sum(elig * jax.nn.relu(over - target)) / jnp.maximum(over.shape[-1] * jnp.sum(elig), 1.0)
  return loss, frac


def pooled_fraction(live: jax.Array, eligible: jax.Array) -> jax.Array:
  """sum(live) / sum(eligible) over [B, Q] (live [B, Q, ...] -> [...]): the live share of all pairs."""
  return jnp.sum(live, axis=(0, 1)) / jnp.maximum(jnp.sum(eligible), 1.0)
