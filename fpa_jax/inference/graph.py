"""A model as decoding sees it: its `FirstPassageAttention` layers, found in the NNX graph, and one
cached call, for `DecoderLM` and for a model of your own alike.

What a model of your own provides: `model(tokens)` -> logits [B, T, V] (the parallel forward), and
in cached mode `model(tokens, cache=cache)` -> (logits, cache), where `__call__` hands the `cache`
it was given to each of its `FirstPassageAttention` layers and takes back what each returns:

    def __call__(self, tokens, segment_ids=None, *, cache=None):
      x = self.embed(tokens)
      h = self.attn(self.norm(x), segment_ids, cache=cache)   # cached mode: -> (h, cache)
      if cache is not None:
        h, cache = h
      logits = self.head(x + h)
      return logits if cache is None else (logits, cache)

The cache is a `ByLayer` (a `layers.CacheByLayer`): one per-layer cache (or fpa_global's shared slot
pool) for every layer `attention_layers` found, each layer taking its own part; `cache.positions`
[B, T] are the tokens' positions (the layers' RoPE reads them; a model with position embeddings of
its own may read them too, or take a `positions` argument, which decoding then passes). Every other
module must work token by token (embeddings, norms, MLPs): decoding feeds one token per call.
Layers are numbered in `nnx.iter_graph` order (attribute names sorted, list items in order): the
order of the per-layer stats and of fpa_global's ties.

`DecoderLM` keeps its own cached loop (`models.ModelCache`: layer i by index, views of a scanned
stack included); decoding calls it as before.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from fpa_jax.configs import ModelConfig
from fpa_jax.layers import AttentionCache, FirstPassageAttention
from fpa_jax.models import Block, DecoderLM, ModelCache


class Found(NamedTuple):
  """One attention layer of a model: its `nnx.iter_graph` path, the layer, and the RMSNorm scale [D]
  in front of it where the model's structure says so (`DecoderLM` and `models.Block`s; the `fpa`
  policy's parameter bound without QK-norm), else None."""

  path: tuple
  layer: FirstPassageAttention
  norm_scale: jax.Array | None


def _name(model) -> str:
  return type(model).__name__


def attention_layers(model) -> tuple[Found, ...]:
  """Every `FirstPassageAttention` of `model` in decoding order (ValueError if none, or if one is a
  scanned stack: cached mode calls layers one by one).

  `DecoderLM`: its blocks' layers (`layer_blocks`: per-layer views of a scanned stack too). Any other
  NNX module: the layers `nnx.iter_graph` finds (each once, however often it is called)."""
  if isinstance(model, DecoderLM):
    return tuple(
      Found(("blocks", i, "attn"), b.attn, b.attn_norm.scale[...]) for i, b in enumerate(model.layer_blocks())
    )
  if not isinstance(model, nnx.Module):
    raise ValueError(f"decoding needs an NNX module made of FirstPassageAttention layers, got {_name(model)}")
  nodes = list(nnx.iter_graph(model))
  norms = {id(n.attn): n.attn_norm.scale[...] for _, n in nodes if isinstance(n, Block)}
  found = tuple(Found(p, n, norms.get(id(n))) for p, n in nodes if isinstance(n, FirstPassageAttention))
  if not found:
    raise ValueError(f"{_name(model)} has no FirstPassageAttention layer: nothing to decode with a KV cache")
  for f in found:
    if f.layer.wq[...].ndim != 3:
      raise ValueError(
        f"{_name(model)}'s layer at {f.path} is a stacked (scanned) layer: cached decoding calls layers one by "
        "one; run them in a Python loop, or build the model as a DecoderLM (its scan_layers decodes)"
      )
  return found


def layer_configs(model) -> tuple[ModelConfig, ...]:
  """Each attention layer's `ModelConfig` in decoding order (kv heads, head dim, dtype, scale: what a
  cache is built from); `DecoderLM`: its own config per layer, without slicing a scanned stack."""
  if isinstance(model, DecoderLM):
    return (model.cfg,) * model.cfg.n_layers
  return tuple(f.layer.cfg for f in attention_layers(model))


def check_decodable(model) -> None:
  """Before tracing, for a model of your own (a `DecoderLM` always decodes): its `__call__` takes
  `cache`, it has attention layers (`attention_layers`) and no other attention module (decoding
  could not cache its keys); ValueError naming the fix."""
  if isinstance(model, DecoderLM):
    return
  if not _accepts(model, "cache"):
    raise ValueError(
      f"{_name(model)}.__call__ takes no `cache` argument: decoding calls model(tokens, cache=cache) and wants "
      "(logits, cache) back; add `cache=None`, hand it to each FirstPassageAttention and return the cache they "
      "return (fpa_jax.inference.graph, docs/inference.md)"
    )
  other = [p for p, n in nnx.iter_graph(model) if isinstance(n, nnx.MultiHeadAttention)]
  if other:
    raise ValueError(
      f"{_name(model)} has attention layers decoding cannot cache ({other}): use FirstPassageAttention for every "
      "attention layer (gate='softmax' is plain attention)"
    )
  attention_layers(model)


def _accepts(model, name: str) -> bool:
  params = inspect.signature(type(model).__call__).parameters.values()
  return any(name == p.name or p.kind is p.VAR_KEYWORD for p in params)


@dataclasses.dataclass(frozen=True)
class ByLayer:
  """The cache a model of your own hands down (`layers.CacheByLayer`): decoding's per-layer caches or
  pool (`inner`, a `cache.DecodeState` holding the call's run: layer i by index) keyed by the layer
  objects of this trace (`index`: id(layer) -> i), the call's positions [B, T], and which layers
  attended (`done`)."""

  inner: ModelCache
  index: dict[int, int]
  paths: tuple
  positions: jax.Array
  owner: str = ""
  done: frozenset = frozenset()

  def _of(self, layer) -> int:
    i = self.index.get(id(layer))
    if i is None:
      raise ValueError(
        f"{self.owner} handed the cache to a FirstPassageAttention decoding did not find in it: a copy made by an "
        "NNX transform inside __call__ (nnx.remat / nnx.scan / nnx.vmap) or another model's layer; in cached mode "
        "call the model's own layers directly"
      )
    return i

  def part(self, layer) -> AttentionCache:
    i = self._of(layer)
    if i in self.done:
      raise ValueError(
        f"{self.owner}'s layer at {self.paths[i]} attended twice in one cached call: decoding keeps one cache per "
        "layer, so each FirstPassageAttention may run once per call (a layer shared by two places cannot decode)"
      )
    return self.inner.layer(i)

  def put(self, layer, new: AttentionCache) -> ByLayer:
    i = self._of(layer)
    return dataclasses.replace(self, inner=self.inner.update(i, new), done=self.done | {i})


def call_cached(model, tokens: jax.Array, positions: jax.Array, cache: ModelCache) -> tuple[jax.Array, Any]:
  """One cached call: tokens, positions [B, T] -> (logits [B, T, V], the `models.ModelCache` after it).
  `DecoderLM`: its own cached loop; a model of your own: `model(tokens, cache=ByLayer(...))` (and
  `positions=` where its `__call__` takes them), checked while tracing: every layer attended once and
  the model returned (logits, cache)."""
  if isinstance(model, DecoderLM):
    return model(tokens, positions=positions, cache=cache)
  found = attention_layers(model)
  name = _name(model)
  whole = ByLayer(cache, {id(f.layer): i for i, f in enumerate(found)}, tuple(f.path for f in found), positions, name)
  kw = {"positions": positions} if _accepts(model, "positions") else {}
  out = model(tokens, cache=whole, **kw)
  if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], ByLayer)):
    raise ValueError(
      f"{name}(tokens, cache=cache) must return (logits, cache), the cache as its layers returned it; got "
      f"{type(out).__name__}"
    )
  logits, whole = out
  missing = [found[i].path for i in range(len(found)) if i not in whole.done]
  if missing:
    raise ValueError(
      f"{name}.__call__ did not hand `cache` to its layer(s) at {missing}: pass cache= to every "
      "FirstPassageAttention (without it a layer attends only to the tokens of the call)"
    )
  return logits, whole.inner


def vocab_size(model) -> int:
  """V: the logits' last axis (a model with a `cfg.vocab_size`, as `DecoderLM`: that; any other: from
  the shapes of its parallel forward on one token, `jax.eval_shape`, no FLOPs)."""
  v = getattr(getattr(model, "cfg", None), "vocab_size", None)
  if isinstance(v, int):
    return v
  graphdef, state = nnx.split(model)
  out = jax.eval_shape(lambda s: nnx.merge(graphdef, s)(jnp.zeros((1, 1), jnp.int32)), state)
  if not hasattr(out, "shape") or len(out.shape) != 3:
    raise ValueError(f"{_name(model)}(tokens [B, T]) must return logits [B, T, vocab], got {out}")
  return int(out.shape[-1])
