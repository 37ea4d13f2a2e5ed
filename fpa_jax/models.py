"""Decoder-only language model (pre-norm Transformer) with a choice of attention.

    from fpa_jax.configs import get_config
    from fpa_jax.models import build_model
    model = build_model(get_config("tiny", attention="fpa"), seed=0)
    logits = model(tokens)                       # int [B, T] -> fp32 [B, T, vocab]
    logits = model(tokens, segment_ids=seg)      # packed sequences: no attention across segments

Shape legend: B batch, T sequence, D d_model, V vocab.
Activations are pinned to the mesh in context (`jax.set_mesh`) at block boundaries and on the
logits via `fpa_jax.sharding.constrain`; without a mesh these are no-ops.

The model takes a `ModelConfig` and keeps it as `model.cfg`; given a run `Config` (as from
`get_config`) it keeps only `config.model`, so a model never carries the learning rate or data dir.

Depth (`ModelConfig.scan_layers`, `.remat`): with scan_layers the blocks are one `Block` whose
parameters carry a leading [L] axis (built by `nnx.vmap`, run by `nnx.scan`); `convert_layers`
moves weights between the two layouts, `layer_blocks` gives per-layer views of either. remat wraps
each block call in `nnx.remat` with the policy `REMAT_POLICIES[cfg.remat]`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fpa_jax.configs import Config, ModelConfig
from fpa_jax.layers import (
  F32,
  AttentionCache,
  FirstPassageAttention,
  RMSNorm,
  SwiGLU,
  _param,
  normal,
  precision_scope,
  with_gates,
)
from fpa_jax.sharding import BTD, BTV, EMBED, LAYERS, VOCAB, constrain

# ModelConfig.remat -> what a block saves for the backward pass (everything else is recomputed).
REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,  # only the block input
  "dots": jax.checkpoint_policies.dots_saveable,  # every matmul output
  "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weight matmuls only
}
_LAYER_AXIS = {nnx.PARTITION_NAME: LAYERS}  # the stacked axis's logical name in the params' metadata


def check_tokens(tokens, vocab_size: int) -> jax.Array:
  """Token ids int [B, T] -> int32 [B, T], checked before tracing (the model's and decoding's one check).

  ValueError unless `tokens` is a rank-2 integer array with B, T >= 1 and, where its values are
  known (a concrete, fully addressable array: not a tracer under jit), every id in [0, vocab_size).
  Traced ids are not checked: `embed_tokens` gives an out-of-range id a zero embedding."""
  if not isinstance(tokens, (jax.Array, jax.core.Tracer)):
    tokens = np.asarray(tokens)  # lists, numpy: checked on the host, before any int64 -> int32 cast
  if tokens.ndim != 2 or 0 in tokens.shape:
    raise ValueError(f"tokens must be int [batch, seq] with batch, seq >= 1, got shape {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  if not isinstance(tokens, jax.core.Tracer) and getattr(tokens, "is_fully_addressable", True):
    ids = np.asarray(tokens)  # on the host: a concrete array closed over under jit must not become traced ops
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
      raise ValueError(f"token ids must be in [0, vocab_size={vocab_size}), got ids in [{lo}, {hi}]")
  return jnp.asarray(tokens, jnp.int32)


def embed_tokens(embed: jax.Array, tokens: jax.Array) -> jax.Array:
  """embed [V, D], tokens int [B, T] -> [B, T, D]. The defined result for ids outside [0, V) (only
  reachable under jit, where `check_tokens` cannot see values): a zero vector, so the logits stay
  finite (plain `jnp.take` gives NaN rows for ids >= V and wraps -1 to row V - 1); such an id's
  embedding gets no gradient."""
  v = embed.shape[0]
  return jnp.take(embed, jnp.where(tokens < 0, v, tokens), axis=0, mode="fill", fill_value=0)


class ModelCache(Protocol):
  """What `DecoderLM`'s cached mode runs against: per layer i the `AttentionCache` layer i attends
  against (`layer(i)`), and the cache with what layer i left (`update(i, new)`): a decoder's state
  holding the call's run (`fpa_jax.inference.cache.DecodeState.with_run`), per-layer caches
  (`inference.cache.LayerCaches`) or fpa_global's shared slot pool (`inference.pool.GlobalCache`),
  whose layers see the pool the previous layer left."""

  def layer(self, i: int) -> AttentionCache: ...

  def update(self, i: int, new: AttentionCache) -> ModelCache: ...


class Block(nnx.Module):
  """x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, layer: int = 0, rngs: nnx.Rngs):
    """`layer`: the block's index (its group of `cfg.head_gates`; a scanned stack has one for all)."""
    pdt = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
    self.attn = FirstPassageAttention(cfg, layer=layer, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
    self.mlp = SwiGLU(
      cfg.d_model,
      cfg.ff_dim,
      init_std=cfg.init_std,
      out_std=cfg.init_std / (2 * cfg.n_layers) ** 0.5,
      dtype=jnp.dtype(cfg.dtype),
      param_dtype=pdt,
      precision=cfg.precision,
      rngs=rngs,
    )

  def __call__(
    self,
    x: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    *,
    cache: AttentionCache | None = None,
    cut=None,
  ):
    """x [B, T, D] -> [B, T, D]; with a cache (an `AttentionCache`) -> (x, the cache after x);
    cut: the training cut, see `FirstPassageAttention`."""
    x = constrain(x, BTD)  # block boundary: batch over `data` under the trainer's mesh
    h = self.attn(self.attn_norm(x), segment_ids, positions, cache=cache, cut=cut)
    if cache is not None:
      h, cache = h
    x = constrain(x + h, BTD)  # [B, T, D]
    x = constrain(x + self.mlp(self.mlp_norm(x)), BTD)
    return x if cache is None else (x, cache)


class DecoderLM(nnx.Module):
  """Token embedding -> N blocks -> final RMSNorm -> output head (optionally tied).

  `cfg`: a ModelConfig, or a run Config, reduced here to its `.model`: `self.cfg` (and every
  layer's) is a ModelConfig, with no training or data fields."""

  def __init__(self, cfg: ModelConfig | Config, *, rngs: nnx.Rngs):
    cfg = cfg.model.validate()
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    pdt = jnp.dtype(cfg.param_dtype)
    self.embed = _param(rngs, normal(cfg.init_std), (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED), pdt)
    # scan_layers: one Block with [L, ...] params (unsharded leading axis), else a list of L Blocks.
    self.blocks = (
      _stacked_blocks(cfg, rngs)
      if cfg.scan_layers
      else nnx.List([Block(cfg, layer=i, rngs=rngs) for i in range(cfg.n_layers)])
    )
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
    if not cfg.tie_embeddings:
      self.head = _param(rngs, normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB), pdt)

  def __call__(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    *,
    cache: ModelCache | None = None,
    return_gates: bool = False,
    cut=None,
  ):
    """tokens int [B, T] (+ segment_ids int [B, T]) -> logits fp32 [B, T, V].

    Token ids outside [0, vocab_size) raise ValueError on a concrete array (`check_tokens`); under
    jit, where values are unknown, such an id embeds as a zero vector (`embed_tokens`): finite,
    defined logits, the same in every attn_impl.

    return_gates=True -> (logits, (field, level)): every layer's gate outputs as the attention
    used them, each stacked [L, B, T, KVH] fp32 in both layouts (zeros for a layer without a gate),
    from the same forward pass: `layers.with_gates(model, tokens, ...)`, what the layers sow (the
    evictability objective, `fpa_jax.losses`). Parallel mode only.

    cut=(capacity, recent) int32 scalars, the training cut (parallel mode, gated attention): every
    layer attends only over the keys an `fpa_budget` cache of `capacity` keys per (row, kv head), with
    `recent` protected, would hold (`fpa_jax.ops.budget`): the logits equal `cached_logits(policy=
    "fpa_budget", budget=capacity, recent=recent)`'s. Training with budget in the loop. An optional
    third element `soft` (a Python float, nats) relaxes the cut, and a fourth, `shared` (a Python
    bool), gives each layer one cache of capacity * KVH keys for all its kv heads
    (`ops.budget.budgeted_attention`).

    Cached mode (`fpa_jax.inference`): `cache` is a `ModelCache` (layer i attends against
    `cache.layer(i)`, and `cache.update(i, new)` takes what it left, so state shared across layers,
    as fpa_global's slot pool, passes from one layer to the next), `positions` [B, T] the tokens'
    positions; returns (logits, the updated cache).
    """
    if (return_gates or cut is not None) and cache is not None:
      raise ValueError("return_gates and cut= are for the parallel (training) forward, not cached mode")
    if cut is not None and (not isinstance(cut, (tuple, list)) or len(cut) not in (2, 3, 4)):
      raise ValueError(f"cut= must be (capacity, recent) int scalars [, soft float [, shared bool]], got {cut!r}")
    if cut is not None and len(cut) == 4 and not isinstance(cut[3], bool):
      raise ValueError(f"cut= (capacity, recent, soft, shared): shared must be a Python bool, got {cut[3]!r}")
    if return_gates:
      return with_gates(self, tokens, segment_ids, positions, cut=cut)
    tokens = check_tokens(tokens, self.cfg.vocab_size)  # ValueError on bad ids where they are concrete
    x = constrain(embed_tokens(self.embed[...], tokens).astype(self.dtype), BTD)  # [B, T, D]
    if cache is not None:
      # Per layer even when stacked: a scanned model's blocks are static slices of the stack (no
      # gradient here, so no remat); each layer reads the cache the previous layers left.
      for i, block in enumerate(self.layer_blocks()):
        x, new = block(x, segment_ids, positions, cache=cache.layer(i))
        cache = cache.update(i, new)
      return self.logits(x), cache

    def apply(block, x, segment_ids, positions, cut):
      return block(x, segment_ids, positions, cut=cut)

    if self.cfg.remat != "none":
      apply = nnx.remat(apply, policy=REMAT_POLICIES[self.cfg.remat])
    if not self.cfg.scan_layers:
      for block in self.blocks:
        x = apply(block, x, segment_ids, positions, cut)
      return self.logits(x)

    # The block is traced once and looped by XLA (compile time flat in depth); segment_ids and
    # positions are the same for every layer (in_axes None). What the layers sow (`with_gates`)
    # comes out stacked [L, ...] with the scanned state.
    @nnx.scan(in_axes=(nnx.Carry, 0, None, None, None), out_axes=nnx.Carry, transform_metadata=_LAYER_AXIS)
    def scan(x, block, segment_ids, positions, cut):
      return apply(block, x, segment_ids, positions, cut)

    return self.logits(scan(x, self.blocks, segment_ids, positions, cut))

  def layer_blocks(self) -> list[Block]:
    """The L per-layer Blocks: the list itself, or (scan_layers) views sliced out of the stack.

    A view's parameters are copies of the slices (read-only use: decoding, inspection); update the
    stacked model itself, or `convert_layers` it, to change weights."""
    if not self.cfg.scan_layers:
      return list(self.blocks)
    graphdef, state = nnx.split(self.blocks)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(self.cfg.n_layers)]

  def logits(self, x: jax.Array) -> jax.Array:
    """Final norm and output head: [B, T, D] -> fp32 [B, T, V]."""
    x = self.final_norm(x)
    w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]  # [D, V]
    with precision_scope(self.cfg.precision):  # the blocks' matmuls run under it in their layers
      return constrain((x @ w.astype(self.dtype)).astype(F32), BTV)  # [B, T, V]


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """L Blocks as one whose every parameter has a leading [L] axis (logical axis LAYERS).

  Each layer draws from its own split of the params stream, so the initial weights are not those of
  the unscanned model with the same seed (same distributions)."""

  @nnx.split_rngs(splits=cfg.n_layers)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYER_AXIS)
  def make(rngs):
    return Block(cfg, rngs=rngs)

  return make(rngs)


def convert_layers(model: DecoderLM, scan_layers: bool) -> DecoderLM:
  """The same weights in the other block layout: L blocks <-> one [L, ...]-stacked block.

  Returns a new model with `cfg.scan_layers = scan_layers` (the model itself if it already has
  that layout); its logits and gradients equal the input's up to float reassociation.
  """
  cfg = dataclasses.replace(model.cfg, scan_layers=scan_layers).validate()
  if scan_layers == model.cfg.scan_layers:
    return model
  graphdef, target = nnx.split(abstract_model(cfg))
  src = dict(nnx.to_flat_state(nnx.state(model)))
  out = []
  for path, v in nnx.to_flat_state(target):
    if path[0] != "blocks":
      val = src[path][...]
    elif scan_layers:  # ('blocks', ...) <- stack of ('blocks', i, ...)
      val = jnp.stack([src[("blocks", i) + path[1:]][...] for i in range(cfg.n_layers)])
    else:  # ('blocks', i, ...) <- slice i of ('blocks', ...)
      val = src[("blocks",) + path[2:]][...][path[1]]
    out.append((path, v.replace(val)))
  return nnx.merge(graphdef, nnx.from_flat_state(out))


def weight_decay_mask(cfg: ModelConfig):
  """optax `mask` fn: decay a parameter iff it is a matrix of its layer (ndim >= 2, not counting a
  scanned model's stacked layer axis), so both layouts decay the same weights (norm scales and
  gate biases [L, ...] of a stacked model stay undecayed)."""

  def mask(params):
    def one(path, p):
      stacked = cfg.scan_layers and getattr(path[0], "key", None) == "blocks"
      return jnp.ndim(p) - int(stacked) >= 2

    return jax.tree_util.tree_map_with_path(one, params)

  return mask


def build_model(config: ModelConfig | Config, seed: int = 0) -> DecoderLM:
  """Instantiate (and materialise, unsharded) a model of `config.model` (a run Config's model part,
  or a ModelConfig itself). For sharded creation see `train.create_state`."""
  return DecoderLM(config, rngs=nnx.Rngs(params=seed))


def abstract_model(config: ModelConfig | Config) -> DecoderLM:
  """Shapes-only model of `config.model` (no FLOPs, no memory) via `nnx.eval_shape`."""
  return nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(params=0)))


def count_params(model_or_state) -> int:
  """Number of parameters of a model (concrete or abstract) or of a Param state."""
  state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
  return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
