"""Pure-function attention ops (no Flax). See `attention.py` for the public API."""

from fpa_jax.ops.attention import IMPLS, Implementation, fox_attention, fpa_attention, softmax_attention
from fpa_jax.ops.budget import budget_keep, budgeted_attention
from fpa_jax.ops.penalty import first_passage_penalty
from fpa_jax.ops.prefix import CachedKeys, fox_prefix_attention, prefix_attention
from fpa_jax.ops.recurrent import RecurrentCache, cache_penalty, decode_step, init_recurrent_cache

__all__ = [
  "IMPLS",
  "Implementation",
  "fpa_attention",
  "fox_attention",
  "softmax_attention",
  "first_passage_penalty",
  "prefix_attention",
  "fox_prefix_attention",
  "CachedKeys",
  "budget_keep",
  "budgeted_attention",
  "RecurrentCache",
  "init_recurrent_cache",
  "decode_step",
  "cache_penalty",
]
