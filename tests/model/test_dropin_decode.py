"""The layer as a drop-in for `nnx.MultiHeadAttention` when decoding too: a model written around
flax's decode convention (`init_cache(input_shape)`, calls with `decode=True`, the cache in the
layer's `nnx.Cache` state, no cache argument) decodes with `FirstPassageAttention` swapped in, under
a per-layer policy, as the threaded form (`cache=`) and teacher forcing do (CPU, tiny)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fpa_jax.inference import FPABudget, FPAHeads, generate
from fpa_jax.layers import FirstPassageAttention

VOCAB, D, HEADS, B, P, N = 48, 32, 2, 2, 10, 6


class FlaxLM(nnx.Module):
  """A tiny LM as one writes it around `nnx.MultiHeadAttention` (its decode convention); `attn`
  swaps the attention layer, the only change."""

  def __init__(self, *, attn=None, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.attn = attn if attn is not None else nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def init_cache(self, input_shape, **kw):
    self.attn.init_cache(input_shape, **kw)

  def __call__(self, tokens, decode=False):
    x = self.embed(tokens)
    h = self.attn(self.norm(x), decode=decode, is_causal=not decode)
    return self.head(x + h)


class Threaded(nnx.Module):
  """The same modules in the threaded form (`__call__` hands `cache=` to the layer): what
  `fpa_jax.inference.generate` decodes."""

  def __init__(self, lm: FlaxLM):
    self.lm = lm

  def __call__(self, tokens, *, cache=None):
    lm = self.lm
    x = lm.embed(tokens)
    h = lm.attn(lm.norm(x), cache=cache)
    if cache is not None:
      h, cache = h
    logits = lm.head(x + h)
    return logits if cache is None else (logits, cache)


@nnx.jit
def _decode(model, tokens):
  return model(tokens, decode=True)


def greedy(model, prompt, n_new: int, *, whole_prompt: bool = False, **cache_kw) -> np.ndarray:
  """Flax's loop: init_cache, the prompt (token by token, or at once), then one token per call."""
  b, p = prompt.shape
  model.init_cache((b, p + n_new, D), **cache_kw)
  if whole_prompt:
    logits = _decode(model, prompt)
  else:
    for t in range(p):
      logits = _decode(model, prompt[:, t : t + 1])
  out = []
  for _ in range(n_new):
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    out.append(np.asarray(tok))
    logits = _decode(model, tok[:, None])
  return np.stack(out, 1)


@pytest.fixture(scope="module")
def models():
  rngs = nnx.Rngs(0)
  layer = FirstPassageAttention.from_args(D, HEADS, gate="fpa", step_init_std=0.3, offset_init_std=0.3, rngs=rngs)
  swapped = FlaxLM(attn=layer, rngs=nnx.Rngs(0))
  prompt = jax.random.randint(jax.random.key(1), (B, P), 0, VOCAB)
  return FlaxLM(rngs=nnx.Rngs(0)), swapped, prompt


def test_the_flax_model_decodes_with_multi_head_attention(models):
  """The loop below is flax's own: the model with nnx.MultiHeadAttention runs it as written."""
  mha, _, prompt = models
  assert greedy(mha, prompt, 3).shape == (B, 3)


def test_swapped_layer_decodes_under_fpa_budget_like_the_threaded_form(models):
  """After swapping the layer: greedy decoding the flax way under fpa_budget (the cache in the
  layer's nnx.Cache state) emits the threaded form's tokens, prompt token by token (generate's
  decode prefill) and at once (its parallel prefill); the layer holds at most the budget."""
  _, lm, prompt = models
  policy = FPABudget(budget=6)
  want_dec, _ = generate(Threaded(lm), np.asarray(prompt), N, policy=policy, prefill="decode")
  want_par, _ = generate(Threaded(lm), np.asarray(prompt), N, policy=policy, prefill="parallel")
  np.testing.assert_array_equal(greedy(lm, prompt, N, policy=policy), want_dec)
  assert int(lm.attn.cache_index[...]) == P + N and lm.attn.cache_policy.capacity == 6
  assert int(np.asarray(lm.attn.cache_state.get_value().alive).sum(1).max()) <= 6
  np.testing.assert_array_equal(greedy(lm, prompt, N, whole_prompt=True, policy=policy), want_par)


def test_swapped_layer_decodes_under_a_head_split_like_the_threaded_form(models):
  """fpa_heads (a capacity per kv head: a cache per head in the layer's nnx.Cache state) decodes the
  flax way as the threaded form does, each head within its own capacity; a split of another
  model's shape is refused at init_cache."""
  _, lm, prompt = models
  policy = FPAHeads(budget=0.25, split=[[0.125, 0.375]])  # of P + N = 16 keys: 2 and 6, the budget's 8
  want, _ = generate(Threaded(lm), np.asarray(prompt), N, policy=policy, prefill="decode")
  np.testing.assert_array_equal(greedy(lm, prompt, N, policy=policy), want)
  heads = lm.attn.cache_state.get_value().heads
  assert [int(np.asarray(c.alive).sum(1).max()) for c in heads] == [2, 6]
  with pytest.raises(ValueError, match="the model has 1 attention layers"):
    lm.attn.init_cache((B, P + N, D), policy=FPAHeads(budget=0.25, split=[[0.25, 0.25]] * 2))


def test_swapped_layer_full_cache_is_teacher_forcing(models):
  """Full cache: each generated token is the parallel model's argmax after the prompt and the
  tokens generated before it."""
  _, lm, prompt = models
  out = greedy(lm, prompt, N)
  seq = jnp.concatenate([prompt, jnp.asarray(out)], 1)
  forced = np.asarray(jnp.argmax(lm(seq), -1))[:, P - 1 : P + N - 1]
  np.testing.assert_array_equal(out, forced)


def test_flax_way_errors(models):
  _, lm, prompt = models
  fresh = FirstPassageAttention.from_args(D, HEADS, gate="fpa", rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="call init_cache"):
    fresh(jnp.zeros((B, 1, D)), decode=True)
  with pytest.raises(ValueError, match="threaded form"):
    fresh.init_cache((B, 8, D), policy="fpa_global", budget=4)
  with pytest.raises(ValueError, match="takes no mask"):
    fresh(jnp.zeros((B, 4, D)), mask=jnp.ones((B, 1, 4, 4), bool))
  fresh.init_cache((B, 8, D))
  with pytest.raises(ValueError, match="pass no cache="):
    fresh(jnp.zeros((B, 1, D)), segment_ids=jnp.zeros((B, 1), jnp.int32), decode=True)


def test_docs_dropin_block_runs_as_written():
  """docs/inference.md's drop-in block: the flax-style model decodes under fpa_budget, the layer's
  cache at the budget (a quarter of 24 tokens) and its position past the prompt and 8 steps."""
  import re
  from pathlib import Path

  text = (Path(__file__).resolve().parents[2] / "docs" / "inference.md").read_text()
  block = re.search(r"```python\n(.*?)```", text[text.index("## Decoding the flax way") :], re.S).group(1)
  prompt = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
  ns = {"nnx": nnx, "jnp": jnp, "prompt": prompt}  # as imported above it on the page
  exec(compile(block, "docs/inference.md", "exec"), ns)
  attn = ns["model"].attn
  assert int(attn.cache_index[...]) == 24 and attn.cache_policy.capacity == 6
  assert int(np.asarray(attn.cache_state.get_value().alive).sum(1).max()) <= 6
  assert ns["logits"].shape == (2, 1, 64) and np.isfinite(np.asarray(ns["logits"])).all()
