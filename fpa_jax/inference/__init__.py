"""Inference: decode a model with a first-passage KV cache and learned eviction.

    from fpa_jax.inference import CachePolicy, Decoder, load_model, generate, cached_logits
    model, cfg = load_model("runs/small_fpa")
    tokens, stats = generate(model, prompts, 32, policy="fpa_budget", budget=0.25)
    tokens, stats = generate(model, prompts, 32, policy="fpa_global", budget=0.25)  # one budget per row
    split = calibrate_head_split(model, prompts, 0.25)  # fpa_global's split between heads, fixed
    tokens, stats = generate(model, prompts, 32, policy=FPAHeads(budget=0.25, split=split))  # per-head speed
    tokens, stats = generate(model, prompts, 32, policy=CachePolicy("window", compression_ratio=0.75))
    logits, stats = cached_logits(model, tokens, policy="fpa", tolerance=1e-3)   # studies
    logits, conv = extend(model, turn_1, max_len=4096, policy="fpa_budget", budget=512)  # chunk by chunk
    logits, conv = extend(model, turn_2, conv)
    dec = Decoder(model, "fpa_budget", max_len=4096, budget=0.25)  # the decoder they are built on
    logits, state = dec.prefill(prompt)                 # then dec.step(state, tokens, positions), dec.extend(...)

The model: a `DecoderLM`, or any NNX model of `FirstPassageAttention` layers whose `__call__` hands
a `cache=` down to them (`.graph`: the layers found in the NNX graph, one cache each).

Policies (one class per rule: `FPABudget(budget=0.25)`, `FPAHeads(budget=0.25, split=...)`, `FPAGlobal(budget=0.25, pool_impl="masked")`,
...; `CachePolicy(name, ...)` or a name with keywords builds the same; one of your own subclasses
`ScorePolicy` and writes `score()`) and the tolerance bound: `fpa_jax.inference.policies`. Cache layout: `.cache` (fpa_global's
shared slot pool: `.pool`). The decoder's state between calls is a `DecodeState` (`cache.DecodeState`:
every layer's `LayerCache` as `LayerCaches`, or fpa_global's `GlobalCache`), which is also the
`models.ModelCache` of a call once it holds the call's run (`Decode`, `Prefill`, `Extend`); a layer
attends against its part through `fpa_jax.layers.AttentionCache` (`CacheView`, `PoolView`). The
split of a budget between heads for `FPAHeads` (calibrated, saved with the model): `.head_budget`.
"""

from fpa_jax.inference.cache import (
  CacheView,
  Decode,
  DecodeState,
  Extend,
  LayerCache,
  LayerCaches,
  Prefill,
  decode_attend,
  global_evict,
  init_layer_cache,
  prefill_attend,
  prefill_chunk,
  snapkv_scores,
)
from fpa_jax.inference.decode import (
  Decoder,
  cache_bytes,
  cached_logits,
  generate,
  init_caches,
  layer_logit_bounds,
  layer_query_bounds,
  prefill_parallel,
  slots_per_row,
)
from fpa_jax.inference.conversation import Conversation, extend
from fpa_jax.inference.graph import ByLayer, attention_layers, call_cached, vocab_size
from fpa_jax.inference.head_budget import calibrate_head_split, load_head_split, normalise_split, save_head_split
from fpa_jax.inference.loading import export_model, load_exported, load_model, read_metrics
from fpa_jax.inference.policies import (
  H2O,
  POLICIES,
  POLICY_CLASSES,
  CachePolicy,
  FPABudget,
  FPAGlobal,
  FPAHeads,
  FPAThreshold,
  FPATolerance,
  Full,
  PolicyRule,
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
  PoolView,
  SlotPool,
  pool_decode_attend,
  pool_evict,
  stand_in,
)

__all__ = [
  "export_model",
  "load_exported",
  "load_model",
  "read_metrics",
  "Decoder",
  "DecodeState",
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
  "slots_per_row",
  "GlobalCache",
  "SlotPool",
  "PoolView",
  "stand_in",
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
  "FPAHeads",
  "ScorePolicy",
  "calibrate_head_split",
  "normalise_split",
  "save_head_split",
  "load_head_split",
  "add_policy_args",
  "policy_from_args",
  "as_policy",
  "PolicyRule",
  "PolicyName",
  "make_policy",
  "logit_bound",
  "query_norm_bound",
  "tolerance_threshold",
  "key_tolerance_threshold",
]
