"""Inference: decode a model with a first-passage KV cache and learned eviction.

    from fpa_jax.inference import CachePolicy, load_model, generate, cached_logits
    model, cfg = load_model("runs/small_fpa")
    tokens, stats = generate(model, prompts, 32, policy="fpa_budget", budget=0.25)
    tokens, stats = generate(model, prompts, 32, policy="fpa_global", budget=0.25)  # one budget per row
    tokens, stats = generate(model, prompts, 32, policy=CachePolicy("window", compression_ratio=0.75))
    logits, stats = cached_logits(model, tokens, policy="fpa", tolerance=1e-3)   # studies
    logits, conv = extend(model, turn_1, max_len=4096, policy="fpa_budget", budget=512)  # chunk by chunk
    logits, conv = extend(model, turn_2, conv)

The model: a `DecoderLM`, or any NNX model of `FirstPassageAttention` layers whose `__call__` hands
a `cache=` down to them (`.graph`: the layers found in the NNX graph, one cache each).

Policies (one class per rule: `FPABudget(budget=0.25)`, `FPAGlobal(budget=0.25, pool_impl="masked")`,
...; `CachePolicy(name, ...)` or a name with keywords builds the same; one of your own subclasses
`ScorePolicy` and writes `score()`) and the tolerance bound: `fpa_jax.inference.policies`. Cache layout: `.cache` (fpa_global's
shared slot pool: `.pool`). A model's layers attend against a cache through one protocol
(`fpa_jax.layers.AttentionCache`): `cache.CacheView` (a layer's cache with a `Decode` step, a
`Prefill` or an `Extend` chunk) and `pool.PoolView`; `DecoderLM` takes them as a `models.ModelCache` (`LayerCaches`,
`pool.PoolStep`).
"""

from fpa_jax.inference.cache import (
  CacheView,
  Decode,
  Extend,
  LayerCache,
  LayerCaches,
  Prefill,
  decode_attend,
  init_layer_cache,
  prefill_attend,
  prefill_chunk,
  snapkv_scores,
)
from fpa_jax.inference.decode import (
  cache_bytes,
  cached_logits,
  decode_step,
  generate,
  global_evict,
  init_caches,
  layer_logit_bounds,
  layer_query_bounds,
  occupancy,
  prefill_parallel,
  slots_per_row,
)
from fpa_jax.inference.conversation import Conversation, extend
from fpa_jax.inference.graph import ByLayer, attention_layers, call_cached, vocab_size
from fpa_jax.inference.loading import export_model, load_exported, load_model, read_metrics
from fpa_jax.inference.policies import (
  H2O,
  POLICIES,
  POLICY_CLASSES,
  CachePolicy,
  FPABudget,
  FPAGlobal,
  FPAThreshold,
  FPATolerance,
  Full,
  Policy,
  PolicyName,
  ScorePolicy,
  SinkWindow,
  SnapKV,
  Window,
  add_policy_args,
  as_policy,
  key_tolerance_threshold,
  logit_bound,
  make_policy,
  policy_from_args,
  query_norm_bound,
  tolerance_threshold,
)
from fpa_jax.inference.pool import (
  GlobalCache,
  PoolStep,
  PoolView,
  SlotPool,
  pool_decode_attend,
  pool_evict,
  scan_steps,
)

__all__ = [
  "export_model",
  "load_exported",
  "load_model",
  "read_metrics",
  "generate",
  "cached_logits",
  "extend",
  "Conversation",
  "init_caches",
  "layer_logit_bounds",
  "layer_query_bounds",
  "cache_bytes",
  "global_evict",
  "prefill_parallel",
  "decode_step",
  "occupancy",
  "slots_per_row",
  "scan_steps",
  "GlobalCache",
  "SlotPool",
  "PoolView",
  "PoolStep",
  "pool_decode_attend",
  "pool_evict",
  "snapkv_scores",
  "LayerCache",
  "LayerCaches",
  "CacheView",
  "Decode",
  "Prefill",
  "Extend",
  "init_layer_cache",
  "decode_attend",
  "prefill_attend",
  "prefill_chunk",
  "attention_layers",
  "call_cached",
  "vocab_size",
  "ByLayer",
  "POLICIES",
  "POLICY_CLASSES",
  "CachePolicy",
  "Full",
  "Window",
  "SinkWindow",
  "H2O",
  "SnapKV",
  "FPATolerance",
  "FPAThreshold",
  "FPABudget",
  "FPAGlobal",
  "ScorePolicy",
  "add_policy_args",
  "policy_from_args",
  "as_policy",
  "Policy",
  "PolicyName",
  "make_policy",
  "logit_bound",
  "query_norm_bound",
  "tolerance_threshold",
  "key_tolerance_threshold",
]
