"""Budget in the loop: train through the cache an `fpa_budget` decode would keep (pure math, no Flax).

The training cut, `cut=(capacity, recent[, soft])` of `DecoderLM` / `FirstPassageAttention`: attend
only over the keys an `fpa_budget` cache of `capacity` keys would hold (`budget` is the inference
word, the keys a cache policy keeps; the cut is that cache simulated in a training step). The second
form of the evictability objective (Expire-Span's random caps, with FPA's own rule): in a training
step, every (row, kv head) gets a KV cache of `capacity` keys managed exactly as `fpa_jax.inference`
manages `policy="fpa_budget"` while decoding token by token:

    at query i: advance every held key's running min of the field with field_i; if the cache holds
    `capacity` keys, evict the one with the largest penalty (ties: the oldest) among the keys at
    positions <= i - recent (all held keys if none is; `first_passage.victim`, the rule the decode
    runs); insert key i; attend over what is held.

(a new segment starts with an empty cache, as `generate` resets a row.) `budget_keep` simulates that
for every query of a training sequence at once (a scan over positions, O(B H T^2) time, O(B H T)
carry) and returns which keys query i sees; `budgeted_attention` is the quadratic attention over
exactly those keys, with the exact penalty on the logits (what a model's layers run under `cut=`).
Its outputs equal the decode's (`tests/ops/test_budget.py` checks the logits of a model against
`cached_logits(policy="fpa_budget")`).

The keep mask is not differentiated (as Expire-Span's hard cut): the LM loss flows through the kept
keys' logits and penalties as usual, so the gate learns what survives the cut and the rest of the
model learns to work with the cache it will have at inference. Nothing then teaches the gate *which*
keys to keep: an evicted key gets no weight, so no gradient. `soft > 0` relaxes the cut at the
cache's own threshold (Expire-Span's soft ramp, on the penalty instead of the age): an evicted key
j keeps the logit

    scale * q_i.k_j - penalty[i, j] + log sigmoid((theta_i - penalty[i, j]) / soft - SOFT_TIE)

where theta_i is the largest penalty among the keys the cache holds at query i (stopped): a key
evicted at a tie with the cache keeps e^-SOFT_TIE ~ 5% of its weight, one evicted by a margin
loses 1/soft nats per nat of penalty beyond theta. The LM loss then pushes the penalty of a key it
needed (the passkey's needle, evicted because a drifting field made it the oldest) below the
threshold, so forgetting by age costs what it loses. Kept keys are exact as before.

A capacity >= T never evicts (the plain attention; the layer then runs its own kernel instead).
Memory O(B H T^2): a training-time op for the lengths at which the quadratic reference is
affordable, not a kernel.

Shapes: B batch, T sequence, H kv heads, K head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fpa_jax.ops import validate as _v
from fpa_jax.ops import first_passage as fp
from fpa_jax.ops.common import F32
from fpa_jax.ops.penalty import first_passage_penalty
from fpa_jax.ops.quadratic import masked_softmax_attention

# With soft > 0, an evicted key at a tie with the cache's threshold keeps sigmoid(-SOFT_TIE) of its weight.
SOFT_TIE = 3.0


def budget_keep(
  field: jax.Array,
  level: jax.Array,
  capacity: jax.Array | int,
  recent: jax.Array | int,
  segment_ids: jax.Array | None = None,
  shared: bool = False,
) -> jax.Array:
  """Which keys each query sees through an `fpa_budget` cache of `capacity` keys.

  Args:
    field, level: [B, T, H] (fp32 inside).
    capacity: int (scalar, may be traced) >= 1: keys held per (row, head), the new one included.
    recent: int (scalar, may be traced), 0 <= recent < capacity: the protected window W (the keys at
      positions > i - W are never the victim at query i).
    segment_ids: optional int [B, T]; the cache empties where a new segment starts.
    shared: False: a cache of `capacity` keys per (row, head). True: one cache of capacity * H keys
      per row shared by the H heads (`fpa_global`'s rule inside one layer: at query i the H new keys
      go in after the largest penalties of every head go out, ties the oldest, then the lower head,
      among the keys at positions <= i - recent in their head, or every held key where too few are),
      so a head that forgets pays for a head that keeps.
  Returns:
    keep: bool [B, H, T(query i), T(key j)], True where key j is held when query i attends (always
    on the diagonal; never above it). No gradient (computed from stopped inputs).
  """
  if field.shape != level.shape or field.ndim != 3:
    raise ValueError(f"field and level must both be [B, T, H], got {field.shape} and {level.shape}")
  b, t, h = field.shape
  if segment_ids is not None and segment_ids.shape != (b, t):
    raise ValueError(f"segment_ids must be [B, T] = {(b, t)}, got {segment_ids.shape}")
  f = jnp.moveaxis(jax.lax.stop_gradient(field).astype(F32), 1, 0)  # [T, B, H]
  lvl = jnp.swapaxes(jax.lax.stop_gradient(level).astype(F32), 1, 2)  # [B, H, T]
  if segment_ids is None:
    new_seg = jnp.zeros((t, b), bool)
  else:
    s = segment_ids.astype(jnp.int32)
    new_seg = jnp.concatenate([jnp.zeros((b, 1), bool), s[:, 1:] != s[:, :-1]], axis=1).T  # [T, B]
  pos = jnp.arange(t, dtype=jnp.int32)  # key positions j (slot j holds key j)
  cap = jnp.asarray(capacity, jnp.int32)
  w = jnp.asarray(recent, jnp.int32)

  def step(carry, xs):
    alive, run_min = carry  # [B, H, T] bool / fp32 (run min over (j, i] of the held keys; +inf: none)
    i, f_i, reset = xs
    alive = alive & ~reset[:, None, None]
    run_min = jnp.where(pos < i, fp.advance(run_min, f_i[:, :, None]), jnp.inf)
    pen = fp.penalty(lvl, run_min)  # [B, H, T]; 0 where the range is empty
    if shared:
      alive = alive & ~_shared_victims(pen, pos, alive, i, cap, w)
    else:
      full = jnp.sum(alive, axis=-1) >= cap  # [B, H]
      out = fp.victim(pen, pos, alive, i, w, axis=-1)  # the rule `inference.cache` decodes with
      alive = alive & ~(full[:, :, None] & (pos == out[:, :, None]))
    alive = alive | (pos == i)
    return (alive, run_min), alive

  init = (jnp.zeros((b, h, t), bool), jnp.full((b, h, t), jnp.inf, F32))
  _, keep = jax.lax.scan(step, init, (pos, f, new_seg))  # [T(i), B, H, T(j)]
  return jnp.transpose(keep, (1, 2, 0, 3))


def _shared_victims(pen: jax.Array, pos: jax.Array, alive: jax.Array, i, cap, recent) -> jax.Array:
  """The keys a row's shared cache of cap * H keys evicts before query i's H keys go in: the
  excess (at most H), largest penalty first, ties the oldest, then the lower head (`fpa_global`'s
  rule, `fp.evict_largest`), among the keys outside their head's recent window, or among every held
  key where fewer than the excess are. pen, alive [B, H, T], pos [T] (slot j holds key j) -> bool [B, H, T].

  One `lax.top_k` of H per row, not a sort: the row is laid out position-major (index pos * H +
  head), and top_k puts the lower index first among equal values, so ties go to the oldest, then
  the lower head."""
  b, h, t = pen.shape
  excess = jnp.maximum(jnp.sum(alive, axis=(1, 2)) + h - cap * h, 0)  # [B], <= H: a full cache gains H keys
  cand = alive & (pos <= i - recent)
  cand = jnp.where((jnp.sum(cand, axis=(1, 2)) >= excess)[:, None, None], cand, alive)
  score = jnp.swapaxes(jnp.where(cand, pen, -jnp.inf), 1, 2).reshape(b, t * h)  # [B, T * H], position-major
  _, idx = jax.lax.top_k(score, h)  # [B, H], largest first
  go = jnp.arange(h)[None, :] < excess[:, None]
  gone = jnp.zeros((b, t * h), bool).at[jnp.arange(b)[:, None], idx].set(go)
  return jnp.swapaxes(gone.reshape(b, t, h), 1, 2)


def budgeted_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  field: jax.Array,
  level: jax.Array,
  *,
  capacity: jax.Array | int,
  recent: jax.Array | int,
  scale: float | None = None,
  segment_ids: jax.Array | None = None,
  soft: float | jax.Array = 0.0,
  shared: bool = False,
) -> jax.Array:
  """First Passage Attention over the keys an `fpa_budget` cache of `capacity` keys holds.

      out_i = sum_{j kept at i} softmax_j(scale * q_i.k_j - penalty[i, j]) v_j

  Args: q [B, T, H, K], k [B, T, KVH, K], v [B, T, KVH, Kv]; field, level [B, T, KVH]; capacity,
  recent, segment_ids as in `budget_keep`; scale default K ** -0.5; soft: 0 = the hard cut (the
  decode's logits exactly), > 0 = evicted keys kept at the soft bias of the module docstring (nats);
  a Python float or a traced scalar (a scanned or rematerialised model passes it traced); shared:
  one cache of capacity * KVH keys per row for all kv heads (`budget_keep`), and the soft cut's
  threshold theta the largest penalty it holds over every head.
  Returns: [B, T, H, Kv] in q's dtype. Differentiable in every input but the keep mask (and theta).
  """
  concrete = isinstance(soft, (int, float))
  if not (math.isfinite(soft) and soft >= 0) if concrete else getattr(soft, "ndim", None) != 0:
    raise ValueError(f"soft must be a finite float >= 0 (0 = the hard cut) or a scalar array, got {soft!r}")
  b, t, _, kvh, d = _v.check_qkv(q, k, v)
  _v.check_gate("field", field, (b, t, kvh))
  _v.check_gate("level", level, (b, t, kvh))
  _v.check_segment_ids(segment_ids, (b, t))
  if isinstance(capacity, int) and capacity < 1:
    raise ValueError(f"capacity must be >= 1 key, got {capacity}")
  if isinstance(capacity, int) and isinstance(recent, int) and not 0 <= recent < capacity:
    raise ValueError(f"recent must be in [0, capacity) = [0, {capacity}), got {recent}")
  scale = _v.default_scale(scale, d)
  fb, lb = (jnp.swapaxes(a, 1, 2).astype(F32) for a in (field, level))  # [B, KVH, T]
  keep = budget_keep(field, level, capacity, recent, segment_ids, shared=shared)  # [B, KVH, T, T]
  pen = first_passage_penalty(fb, lb)  # [B, KVH, T, T]; +inf above the diagonal
  # Evicted keys get -inf (no weight, no gradient); the causal / segment mask is the attention's.
  bias = jnp.where(keep, -jnp.where(keep, pen, 0.0), -jnp.inf)
  if not concrete or soft:
    t = field.shape[1]
    s = jnp.asarray(soft, F32)
    causal = jnp.tril(jnp.ones((t, t), bool)) & (s > 0)  # a traced 0: the hard cut
    p = jnp.where(causal, pen, 0.0)  # finite where the bias is read: no inf in the gradient
    held = jnp.where(keep, p, 0.0)
    theta = jnp.max(held, axis=(1, 3) if shared else 3, keepdims=True)  # [B, KVH | 1, T, 1]
    theta = jax.lax.stop_gradient(theta)
    evicted = -p + jax.nn.log_sigmoid((theta - p) / jnp.where(s > 0, s, 1.0) - SOFT_TIE)
    bias = jnp.where(keep, bias, jnp.where(causal, evicted, -jnp.inf))
  return masked_softmax_attention(q, k, v, bias, scale=scale, segment_ids=segment_ids)


def draw_capacity(
  key: jax.Array, seq: int, prob: float | jax.Array, low: float, high: float
) -> tuple[jax.Array, jax.Array]:
  """A random cut for one training step: with probability `prob` a capacity of round(rho * seq)
  keys, rho ~ U[low, high] (at least 2), else seq (no eviction). -> the cut (capacity, recent), int32
  scalars, recent = capacity // 8 (the decode default, `inference.policies`): pass it as `cut=`."""
  k_on, k_rho = jax.random.split(key)
  rho = jax.random.uniform(k_rho, (), F32, low, high)
  cap = jnp.maximum(jnp.round(rho * seq).astype(jnp.int32), 2)
  cap = jnp.where(jax.random.uniform(k_on, ()) < prob, jnp.minimum(cap, seq), jnp.int32(seq))
  return cap, cap // 8
