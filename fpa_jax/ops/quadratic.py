"""O(T^2)-memory reference attention: materialise the logits, mask, softmax. Readable, not fast."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fpa_jax.ops.validate import STATS_DTYPE


def masked_softmax_attention(q, k, v, bias, *, scale, segment_ids=None):
  """softmax(scale * q k^T + bias) v over causal, same-segment keys.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, Kv].
    bias: [B, H, T, T] fp32 additive logit bias (query i, key j); may hold +-inf above the
      diagonal, which the causal mask overrides.
    segment_ids: optional [B, T] int.
  Returns:
    [B, T, H, Kv] in q's dtype.
  """
  t = q.shape[1]
  s = jnp.einsum("bihd,bjhd->bhij", q, k, preferred_element_type=STATS_DTYPE) * scale
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  # where() before and after the softmax: masked entries get neither value nor gradient, and an
  # infinite bias above the diagonal never meets an arithmetic op.
  logits = jnp.where(mask, s + jnp.where(mask, bias, 0.0), -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhij,bjhd->bihd", p.astype(v.dtype), v, preferred_element_type=STATS_DTYPE)
  return out.astype(q.dtype)
