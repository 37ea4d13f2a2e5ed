"""O(T^2)-memory reference attention: materialise the logits, mask, softmax. Readable, not fast.

The reference: its two matmuls run at Precision.HIGHEST (full fp32 on TPU / GPU, whose default
for fp32 operands is bf16 passes / TF32), whatever `jax.default_matmul_precision` says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fpa_jax.ops.common import STATS_DTYPE

HIGHEST = jax.lax.Precision.HIGHEST


def masked_softmax_attention(q, k, v, bias, *, scale, segment_ids=None):
  """softmax(scale * q k^T + bias) v over causal, same-segment keys.

  Grouped-query: query head h reads kv head h // G (G = H / KVH). q is viewed as [B, T, KVH, G, K]
  and contracted against k / v per kv head, so k / v are never repeated.

  Args:
    q: [B, T, H, K]; k: [B, T, KVH, K]; v: [B, T, KVH, Kv]; KVH divides H.
    bias: [B, KVH, T, T] fp32 additive logit bias (query i, key j), shared by the G query heads of
      a kv head; may hold +-inf above the diagonal, which the causal mask overrides.
    segment_ids: optional [B, T] int.
  Returns:
    [B, T, H, Kv] in q's dtype.
  """
  b, t, h, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d)
  s = jnp.einsum("bihgd,bjhd->bhgij", qg, k, preferred_element_type=STATS_DTYPE, precision=HIGHEST) * scale
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None, None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
  # where() before and after the softmax: masked entries get neither value nor gradient, and an
  # infinite bias above the diagonal never meets an arithmetic op.
  logits = jnp.where(mask, s + jnp.where(mask, bias[:, :, None], 0.0), -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgij,bjhd->bihgd", p.astype(v.dtype), v, preferred_element_type=STATS_DTYPE, precision=HIGHEST)
  return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)
