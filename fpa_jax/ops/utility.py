"""Key utility: which old keys later queries still read, the target that levels are taught to rank
by (pure math, no Flax).

Locret trains a small head to predict, for every cached key, the largest attention it will receive
from later queries, and evicts the keys it scores lowest; kvpress's KVzap weighs that attention by
the size of what the key writes out (||v||). Here the same target labels the first-passage penalty:
for a query i and a key j outside the recent window (j <= i - W),

    A[h, i', j]  = softmax_j(q_i' . k_j * scale - penalty[i', j])       the attention the layer computes
    U[i, j]      = max over queries i' >= i and the query heads h of j's kv head of  A[h, i', j] * ||v_j||

is what keeping j is worth from query i on (a key nobody reads again is worth 0, and since U only
shrinks as i grows it matches the penalty's rule: once evicted, never needed). Among the eligible
keys of each (sequence, sampled query, kv head) the top `keep` share by U is labelled "keep", the
rest "evict" (`keep_labels`), and the objective (`fpa_jax.losses`, `utility_weight`) asks the soft
live indicator sigmoid((tau - penalty) / temp) to match the labels (`utility_bce`, class-balanced
binary cross-entropy): kept keys below tau, evicted keys above it, a rank by content instead of
a share by age.

The target is computed from the model's own attention under `stop_gradient` (the current
parameters, the penalty included: the attention it actually uses), not a frozen teacher's: the
labels follow the model as it learns, and only the gate (field, level) gets the loss's gradient.

Cost: the layer's attention is recomputed as a [B, H, T, T] matrix (a training-length diagnostic:
O(T^2) memory per layer, as the quadratic kernel), then reduced to the sampled queries.

Shapes: B batch, T sequence, H query heads, KVH kv heads (H = G * KVH), K head dim, Q sampled queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fpa_jax.ops.common import F32
from fpa_jax.ops.penalty import first_passage_penalty


def key_utility(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  field: jax.Array,
  level: jax.Array,
  query_idx: jax.Array,
  *,
  scale: float | None = None,
  segment_ids: jax.Array | None = None,
) -> jax.Array:
  """U at the sampled queries (module docstring), no gradient.

  Args:
    q: [B, T, H, K]; k, v: [B, T, KVH, K] (H a multiple of KVH: grouped queries).
    field, level: [B, T, KVH] the gate outputs the attention used (zeros: no penalty).
    query_idx: int [B, Q] the sampled query positions (`evictability.sample_queries`).
    scale: the logit scale (None: K ** -0.5, the layer's).
    segment_ids: optional int [B, T]; a query reads only keys of its own segment.
  Returns:
    [B, Q, T, KVH] fp32: for query i = query_idx[b, q] and key j, the largest ||v_j||-weighted
    attention j receives from any query i' >= i in i's segment (0 for j > i).
  """
  b, t, h, d = q.shape
  if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != (b, t) or k.shape[-1] != d:
    raise ValueError(f"k and v must both be [B, T, KVH, K] = [{b}, {t}, KVH, {d}], got {k.shape} and {v.shape}")
  kvh = k.shape[2]
  if h % kvh:
    raise ValueError(f"the query heads ({h}) must be a multiple of the kv heads ({kvh})")
  if field.shape != (b, t, kvh) or level.shape != field.shape:
    raise ValueError(f"field and level must both be [B, T, KVH] = {(b, t, kvh)}, got {field.shape} and {level.shape}")
  scale = d**-0.5 if scale is None else scale
  q, k, v = (jax.lax.stop_gradient(a.astype(F32)) for a in (q, k, v))
  field, level = (jax.lax.stop_gradient(jnp.moveaxis(a.astype(F32), -1, 1)) for a in (field, level))  # [B, KVH, T]
  g = h // kvh
  qg = q.reshape(b, t, kvh, g, d)
  logits = jnp.einsum("bikgd,bjkd->bkgij", qg, k) * scale  # [B, KVH, G, T(i), T(j)]
  logits = logits - first_passage_penalty(field, level)[:, :, None]
  mask = jnp.tril(jnp.ones((t, t), bool))
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]  # [B, 1, 1, T, T]
  a = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
  a = a.max(2)  # [B, KVH, T, T]: the group's largest (masked pairs are 0: every row holds its diagonal)
  a = a * jnp.linalg.norm(v, axis=-1).transpose(0, 2, 1)[:, :, None, :]  # * ||v_j||
  later = jax.lax.cummax(a, axis=2, reverse=True)  # [B, KVH, T(i), T(j)]: max over i' >= i
  qi = jnp.clip(query_idx.astype(jnp.int32), 0, t - 1)  # [B, Q]
  at = jnp.take_along_axis(later, qi[:, None, :, None], axis=2)  # [B, KVH, Q, T]
  return jax.lax.stop_gradient(jnp.moveaxis(at, 1, -1))  # [B, Q, T, KVH]


def keep_labels(utility: jax.Array, eligible: jax.Array, keep: float) -> jax.Array:
  """The top `keep` share of the eligible keys by utility, per (row, query, head): utility
  [B, Q, T, H], eligible bool [B, Q, T], keep in (0, 1] -> bool [B, Q, T, H] (ceil(keep * n)
  keys of n eligible; ties at the cut all kept; False where not eligible)."""
  if not 0.0 < keep <= 1.0:
    raise ValueError(f"keep must be in (0, 1] (the share of old keys labelled keep), got {keep}")
  e = eligible[..., None]  # [B, Q, T, 1]
  u = jnp.where(e, utility, -jnp.inf)
  n = jnp.sum(eligible, axis=-1)  # [B, Q]
  m = jnp.ceil(keep * n).astype(jnp.int32)  # keys to keep
  desc = -jnp.sort(-u, axis=2)  # [B, Q, T, H] largest first
  cut = jnp.take_along_axis(desc, jnp.maximum(m - 1, 0)[:, :, None, None], axis=2)  # [B, Q, 1, H]
  return e & (u >= cut) & (m > 0)[:, :, None, None]


def utility_bce(pen: jax.Array, labels: jax.Array, eligible: jax.Array, *, tau: float, temp: float) -> jax.Array:
  """Class-balanced binary cross-entropy of the soft live indicator sigmoid((tau - pen) / temp)
  against the labels: pen [B, Q, T, H] (the objective's penalty), labels bool [B, Q, T, H],
  eligible bool [B, Q, T] -> [] fp32, the mean of the kept keys' loss and the evicted keys' loss
  (each a mean over its pairs; 0 where a class is empty), so a 10% keep share weighs as much as
  the 90% it is ranked against."""
  z = (tau - pen.astype(F32)) / temp  # logit of "live"
  e = eligible[..., None].astype(F32)
  y = labels.astype(F32) * e
  e = jnp.broadcast_to(e, z.shape)
  n_pos = jnp.sum(y)
  pos = jnp.sum(y * jax.nn.softplus(-z)) / jnp.maximum(n_pos, 1.0)  # -log sigmoid(z)
  neg = jnp.sum((e - y) * jax.nn.softplus(z)) / jnp.maximum(jnp.sum(e) - n_pos, 1.0)  # -log(1 - sigmoid(z))
  return 0.5 * (pos + neg)
