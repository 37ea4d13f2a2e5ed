"""Decoder-only language model (pre-norm Transformer) with a choice of attention.

    from fpa_jax.configs import get_config
    from fpa_jax.models import build_model
    model = build_model(get_config("tiny", attention="fpa"), seed=0)
    logits = model(tokens)                       # int [B, T] -> fp32 [B, T, vocab]
    logits = model(tokens, segment_ids=seg)      # packed sequences: no attention across segments

Shape legend: B batch, T sequence, D d_model, V vocab.
Activations are pinned to the mesh in context (`jax.set_mesh`) at block boundaries and on the
logits via `fpa_jax.sharding.constrain`; without a mesh these are no-ops.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from fpa_jax.configs import Config
from fpa_jax.layers import F32, FirstPassageAttention, RMSNorm, SwiGLU, _param, normal
from fpa_jax.sharding import BTD, BTV, EMBED, VOCAB, constrain


class Block(nnx.Module):
  """x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
    self.attn = FirstPassageAttention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
    self.mlp = SwiGLU(cfg.d_model, cfg.ff_dim, init_std=cfg.init_std,
                      out_std=cfg.init_std / (2 * cfg.n_layers) ** 0.5,
                      dtype=jnp.dtype(cfg.dtype), param_dtype=pdt, rngs=rngs)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               *, cache=None, attend=None):
    """x [B, T, D] -> [B, T, D]; with a cache (see `FirstPassageAttention`) -> (x, cache)."""
    x = constrain(x, BTD)  # block boundary: batch over `data` under the trainer's mesh
    h = self.attn(self.attn_norm(x), segment_ids, positions, cache=cache, attend=attend)
    if cache is not None:
      h, cache = h
    x = constrain(x + h, BTD)                                                # [B, T, D]
    x = constrain(x + self.mlp(self.mlp_norm(x)), BTD)
    return x if cache is None else (x, cache)


class DecoderLM(nnx.Module):
  """Token embedding -> N blocks -> final RMSNorm -> output head (optionally tied)."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    pdt = jnp.dtype(cfg.param_dtype)
    self.embed = _param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED), pdt)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
    if not cfg.tie_embeddings:
      self.head = _param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB), pdt)

  def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
               *, caches=None, attend=None):
    """tokens int [B, T] (+ segment_ids int [B, T]) -> logits fp32 [B, T, V].

    Cached mode (`fpa_jax.inference`): `caches` is a sequence of per-layer caches, `attend` the
    function that attends against one (see `FirstPassageAttention`), `positions` [B, T] the tokens'
    positions; returns (logits, new caches).
    """
    x = constrain(jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype), BTD)  # [B, T, D]
    if caches is not None:
      new = []
      for block, cache in zip(self.blocks, caches, strict=True):
        x, cache = block(x, segment_ids, positions, cache=cache, attend=attend)
        new.append(cache)
      return self.logits(x), tuple(new)
    for block in self.blocks:
      x = block(x, segment_ids, positions)
    return self.logits(x)

  def logits(self, x: jax.Array) -> jax.Array:
    """Final norm and output head: [B, T, D] -> fp32 [B, T, V]."""
    x = self.final_norm(x)
    w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]     # [D, V]
    return constrain((x @ w.astype(self.dtype)).astype(F32), BTV)           # [B, T, V]


def build_model(config: Config, seed: int = 0) -> DecoderLM:
  """Instantiate (and materialise, unsharded) a model. For sharded creation see `train.create_state`."""
  return DecoderLM(config, rngs=nnx.Rngs(params=seed))


def abstract_model(config: Config) -> DecoderLM:
  """Shapes-only model (no FLOPs, no memory) via `nnx.eval_shape`."""
  return nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(params=0)))


def count_params(model_or_state) -> int:
  """Number of parameters of a model (concrete or abstract) or of a Param state."""
  state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
