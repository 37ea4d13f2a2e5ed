"""Inference: decode a trained `DecoderLM` with a first-passage KV cache and learned eviction.

    from fpa_jax.inference import load_model, generate, cached_logits
    model, cfg = load_model("runs/small_fpa")
    tokens, stats = generate(model, prompts, 32, policy="fpa_budget", budget=0.25)
    logits, stats = cached_logits(model, tokens, policy="fpa", tolerance=1e-3)   # studies

Policies and the tolerance bound: `fpa_jax.inference.policies`. Cache layout: `.cache`.
"""

from fpa_jax.inference.cache import LayerCache, decode_attend, init_cache, prefill_attend
from fpa_jax.inference.decode import cached_logits, generate, init_caches, layer_logit_bounds
from fpa_jax.inference.loading import load_model, read_metrics
from fpa_jax.inference.policies import POLICIES, Policy, PolicyName, logit_bound, make_policy, tolerance_threshold

__all__ = [
  "load_model",
  "read_metrics",
  "generate",
  "cached_logits",
  "init_caches",
  "layer_logit_bounds",
  "LayerCache",
  "init_cache",
  "decode_attend",
  "prefill_attend",
  "POLICIES",
  "Policy",
  "PolicyName",
  "make_policy",
  "logit_bound",
  "tolerance_threshold",
]
