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

import importlib as _importlib

# Public name -> its module, imported on first use (PEP 562): `import fpa_jax.data.tokenizers` (or
# any submodule) does not load Flax and the models through this package.
_EXPORTS = {
  "FirstPassageAttention": "fpa_jax.layers",
  "fpa_attention": "fpa_jax.ops",
  "fox_attention": "fpa_jax.ops",
  "ModelConfig": "fpa_jax.configs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(_importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
