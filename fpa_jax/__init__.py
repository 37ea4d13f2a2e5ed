"""fpa_jax: First Passage Attention in JAX / Flax NNX.

Shape legend (the whole package; docstrings use these letters):
  B  batch                      T  sequence (tokens of a call)      S  KV-cache slots
  H  attention heads            K  head dim (q, k, v per head)      D  d_model
  F  MLP hidden dim             V  vocabulary                        L  layers                     P  prompt length                    N  new tokens
  Kv value head dim (= K unless v differs)
  KVH kv heads (k, v, gates; = H unless grouped-query)   G  query heads per kv head (H / KVH)
The ops take the layout of `jax.nn.dot_product_attention`: q [B, T, H, K], k, v [B, T, KVH, K];
per-token gates (field, level, log forget) [B, T, KVH]; segment_ids [B, T].
"""

__version__ = "0.1.0"
