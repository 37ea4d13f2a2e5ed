"""Decoding with a first-passage KV cache: `cached_logits` (studies) and `generate`.

The model is a `DecoderLM` or any NNX model made of `FirstPassageAttention` layers whose `__call__`
hands a `cache=` down to them (`fpa_jax.inference.graph`: the layers are found in the NNX graph,
one cache per layer). Shape legend: B batch, T tokens, P prompt length, N new tokens, V vocab,
L attention layers, H heads.

Both build one jitted program per (model structure, policy, shapes): the per-token step is traced
once and run by `jax.lax.scan`, so a whole generation compiles once. Model weights are passed as
NNX state, never baked into the program.

The global budget (`fpa_global`) needs every layer's penalties at once, so it lives here, at the
model level. `generate` keeps one slot pool per row for all layers and kv heads (`pool.GlobalCache`,
G = keys * L * KVH slots): the model's cached loop threads it through the layers' attend calls
(`pool.PoolStep`) and `pool.pool_evict` frees slots after each step. `cached_logits` measures it
on ordinary per-head caches of one slot per token with `global_evict` after each step: the same
rule, so every query attends to the same keys as in the pool. A parallel prefill builds per-head
candidate caches from the whole prompt, `global_evict` cuts them to the global limit and
`pool.pool_from_caches` packs what is left into the pool.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fpa_jax.inference import pool
from fpa_jax.inference.cache import (
  Decode,
  LayerCache,
  LayerCaches,
  Prefill,
  init_layer_cache,
  pick_rows,
  reset_rows,
  select_rows,
)
from fpa_jax.inference.graph import call_cached, check_decodable, layer_configs, vocab_size
from fpa_jax.inference.policies import (  # noqa: F401  (the bounds: importable from here, as before)
  CachePolicy,
  Policy,
  _check_bounded,
  as_policy,
  layer_logit_bounds,
  layer_query_bounds,
)
from fpa_jax.models import DecoderLM, check_tokens
from fpa_jax.ops import first_passage as fp

TRACES = {"cached_logits": 0, "generate": 0}  # Python traces of each program (tests: no retracing)


# ------------------------------------------------------------------------------------------------
# Caches
# ------------------------------------------------------------------------------------------------


def _check_model_policy(model, policy: Policy) -> None:
  """Before tracing: a model of your own decodes (`graph.check_decodable`) and suits the policy
  (`Policy.check_model`: fpa needs bounded layers; fpa_global's one pool the same kv heads, head dim
  and dtype in every layer). A `DecoderLM` always does."""
  if isinstance(model, DecoderLM):
    return
  check_decodable(model)
  policy.check_model(model)


def init_caches(
  model, batch: int, policy: Policy, n_keys: int, slots: int | None = None
) -> tuple[LayerCache, ...] | pool.GlobalCache:
  """One empty `LayerCache` per attention layer with the policy's thresholds (fpa_global: the shared
  pool), each of its layer's kv heads, head dim and dtype.

  n_keys: the most keys a sequence can have (the N in the `fpa` tolerance threshold).
  slots: default `policy.capacity`; `cached_logits` measures with one slot per token. fpa_global
  without `slots`: a `pool.GlobalCache` of G = keys * L * KVH slots per row (what `generate`
  decodes with); with `slots`: per-head caches of that many slots (the measuring layout, and a
  parallel prefill's candidates).
  """
  layers = layer_configs(model)
  n = len(layers)
  if policy.is_global and slots is None:
    c = layers[0]  # the same in every layer (`_check_model_policy`)
    g = policy.pool_slots(n, c.kv_heads)
    empty = pool.init_global_cache(batch, g, n, c.kv_heads, c.head_dim, dtype=jnp.dtype(c.dtype))
    return pool.prepare(empty, policy)
  thresholds, coefs, caps = zip(*policy.layer_thresholds(model, n_keys))  # per layer: the policy's
  # Slots per kv head: a key, its level and penalty are shared by the query heads of its group.
  return tuple(
    init_layer_cache(
      batch,
      slots or policy.capacity,
      a.kv_heads,
      a.head_dim,
      dtype=jnp.dtype(a.dtype),
      threshold=thr,
      key_coef=coef,
      key_cap=cap,
    )
    for a, thr, coef, cap in zip(layers, thresholds, coefs, caps)
  )


def cache_bytes(model, batch: int, policy: Policy, n_keys: int | None = None) -> int:
  """Bytes every array of `generate`'s reused-slot cache allocates (fpa_global: its pool; no allocation)."""
  shapes = jax.eval_shape(lambda: init_caches(model, batch, policy, n_keys or policy.capacity))
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def slots_per_row(model, policy: Policy) -> int:
  """Key slots one row's cache allocates over all layers and kv heads (fpa_global: the pool, G)."""
  return policy.slots_per_row([c.kv_heads for c in layer_configs(model)])


_slots_per_row = slots_per_row  # the name the benchmarks used


def global_evict(caches: Sequence[LayerCache], policy: Policy, now: jax.Array) -> tuple[LayerCache, ...]:
  """fpa_global on per-layer caches (`cached_logits`' measuring layout and a parallel prefill's
  candidates; `pool.pool_evict` is the same rule on the pool): evict across all layers and heads
  of a row down to G - L*KVH keys.

  G = policy.keys * L * KVH. The keys that may go are those outside every head's protected window
  (positions <= now + 1 - W: the next step's new key and the W - 1 before it stay); they go largest
  penalty first, ties oldest, then lower (layer, head). `now` [B]: the position of the last key
  written. Per row, the excess over the limit is evicted in one sort of the L * S * KVH slots (after
  a decode step it is at most L * KVH keys). Only `alive` changes (slots are reused by the next step).
  """
  n_l = len(caches)
  b, s, h = caches[0].pos.shape
  limit = (policy.keys - 1) * n_l * h
  pen = jnp.stack([c.penalty for c in caches], 1)  # [B, L, S, H]
  alive = jnp.stack([c.alive for c in caches], 1)
  pos = jnp.stack([c.pos for c in caches], 1)
  cand = alive & (pos <= now[:, None, None, None] + 1 - policy.recent)
  excess = jnp.maximum(jnp.sum(alive, axis=(1, 2, 3)) - limit, 0)  # [B]
  head = jnp.broadcast_to((jnp.arange(n_l)[:, None, None] * h + jnp.arange(h)[None, None, :])[None], pen.shape)
  flat = lambda x: x.reshape(b, n_l * s * h)
  evict = fp.evict_largest(flat(pen), flat(pos), flat(head), flat(cand), excess).reshape(b, n_l, s, h)
  return tuple(c._replace(alive=c.alive & ~evict[:, i]) for i, c in enumerate(caches))


def _select_rows(rows: jax.Array, new, old):
  """Per row b: new if rows[b] else old (the per-head threshold terms [H] are shared); a LayerCache
  or a whole `pool.GlobalCache` (every leaf has the batch first)."""
  if isinstance(new, pool.GlobalCache):
    return jax.tree.map(functools.partial(pick_rows, rows), new, old)
  return select_rows(rows, new, old)


def _split_on_one_device(model):
  """nnx.split, with the state gathered onto one device if it is spread over several.

  Decoding runs on one device (batch-sharded decoding is future work): a model straight from a
  sharded training run would otherwise run every decode step as a multi-device program.
  """
  graphdef, state = nnx.split(model)
  if any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(state) if hasattr(x, "sharding")):
    state = jax.device_put(state, jax.devices()[0])
  return graphdef, state


def decode_step(
  model, caches, tokens, positions, policy: Policy, *, step=None, measure=False, repack=True, active=None
):
  """One token per row: tokens, positions [B] -> (logits [B, V], caches) (per-layer caches or a
  `pool.GlobalCache`; `repack`: `pool.pool_evict`'s repack_due, False in `pool.scan_steps`' blocks;
  `active` [B]: the rows that take the token, the others' per-layer caches kept as they were; the
  pool's rows are all updated)."""
  if isinstance(caches, pool.GlobalCache):
    logits, done = call_cached(model, tokens[:, None], positions[:, None], pool.PoolStep(caches, policy, positions))
    return logits[:, 0], pool.pool_evict(done.cache, policy, positions, repack_due=repack)
  run = Decode(policy, positions, step=step, measure=measure, active=active)
  logits, done = call_cached(model, tokens[:, None], positions[:, None], LayerCaches(tuple(caches), run))
  caches = done.layers
  if policy.is_global:
    evicted = global_evict(caches, policy, positions)
    keep = lambda n, o: n if active is None else _select_rows(active, n, o)  # eviction spans rows' layers
    caches = tuple(keep(n, o) for n, o in zip(evicted, caches))
  return logits[:, 0], caches


def occupancy(caches) -> tuple[jax.Array, jax.Array]:
  """(max keys held by any (layer, row, head) [], keys held [L, B, KVH]), fp32; layers with fewer kv
  heads than the most (a model of your own may mix them) padded with NaN."""
  if isinstance(caches, pool.GlobalCache):
    held = pool.held(caches).astype(jnp.float32)
  else:
    per = [jnp.sum(c.alive, axis=1).astype(jnp.float32) for c in caches]  # [B, KVH] each
    kvh = max(h.shape[-1] for h in per)
    if any(h.shape[-1] != kvh for h in per):
      per = [jnp.pad(h, ((0, 0), (0, kvh - h.shape[-1])), constant_values=jnp.nan) for h in per]
      held = jnp.stack(per)
      return jnp.nanmax(held), held
    held = jnp.stack(per)  # [L, B, H]
  return jnp.max(held), held


_step, _occupancy = decode_step, occupancy  # the names tests and benchmarks used


def _lost(caches) -> jax.Array:
  """[] the largest lost mass of any layer, row and head (`LayerCache.lost`)."""
  return jnp.max(jnp.stack([jnp.max(c.lost) for c in caches]))


def _overflow(caches) -> jax.Array:
  """[] bool: a thresholded policy ran out of capacity (never for the pool: fpa_global has no threshold)."""
  if isinstance(caches, pool.GlobalCache):
    return jnp.zeros((), bool)
  return jnp.any(jnp.stack([jnp.any(c.overflow) for c in caches]))


def _per_head(kept: np.ndarray) -> list[list[float]]:
  """[L, KVH] -> lists per layer, the NaN padding of layers with fewer kv heads dropped."""
  return [[v for v in row if not np.isnan(v)] for row in np.asarray(kept).tolist()]


def _mean(kept: np.ndarray) -> float:
  """The mean over every real (not padding) entry."""
  kept = np.asarray(kept)
  return float(np.mean(kept[~np.isnan(kept)]) if np.isnan(kept).any() else np.mean(kept))


def prefill_parallel(model, prompt, lengths, policy: Policy, n_keys: int):
  """The prompt [B, P] (right-padded, `lengths` [B]) through the layers' parallel kernel (their
  impl, tiles and skipping: `layers.AttentionSpec`), then the cache the policy keeps -> (logits
  [B, P, V], caches). fpa_global: every layer's prompt keys are
  candidates (per head, at most the per-head limit, by `cache.prefill_attend`'s order), then the
  global rule of `global_evict` (each head's last W - 1 prompt keys protected, the largest
  penalties across layers and heads out first, ties oldest, then lower layer / head) cuts them to
  G - L * KVH keys, packed into the pool (`pool.pool_from_caches`)."""
  b, p = prompt.shape
  if policy.is_global:
    caches = init_caches(model, b, policy, n_keys, slots=min(policy.capacity, p))
  else:
    caches = init_caches(model, b, policy, n_keys)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  logits, done = call_cached(model, prompt, positions, LayerCaches(caches, Prefill(policy, lengths)))
  caches = done.layers
  if policy.is_global:
    kvh = caches[0].pos.shape[2]
    caches = pool.pool_from_caches(global_evict(caches, policy, lengths - 1), policy.pool_slots(len(caches), kvh))
    caches = pool.prepare(caches, policy)
  return logits, caches


# ------------------------------------------------------------------------------------------------
# cached_logits
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "policy"))
def _cached_logits_program(graphdef, state, tokens, segment_ids, *, policy: Policy):
  TRACES["cached_logits"] += 1
  model = nnx.merge(graphdef, state)
  b, t = tokens.shape
  caches = init_caches(model, b, policy, t, slots=t)

  def body(carry, xs):
    caches, prev_seg, prev_pos = carry
    tok, seg, step = xs
    new_seq = seg != prev_seg
    caches = tuple(reset_rows(c, new_seq) for c in caches)
    pos = jnp.where(new_seq, 0, prev_pos + 1)
    logits, caches = decode_step(model, caches, tok, pos, policy, step=step, measure=True)
    peak, held = occupancy(caches)
    kept = jnp.mean(held / (pos + 1).astype(jnp.float32)[None, :, None], axis=1)  # [L, KVH]
    lost = _lost(caches)
    overflow = _overflow(caches)
    return (caches, seg, pos), (logits, peak, kept, lost, overflow)

  init = (caches, jnp.full((b,), -1, jnp.int32), jnp.full((b,), -1, jnp.int32))
  xs = (tokens.T, segment_ids.T, jnp.arange(t, dtype=jnp.int32))
  _, (logits, peak, kept, lost, overflow) = jax.lax.scan(body, init, xs)
  return jnp.swapaxes(logits, 0, 1), {"peak": peak, "kept": kept, "lost": lost, "overflow": overflow}


def cached_logits(
  model,
  tokens,
  *,
  policy: str | CachePolicy = "full",
  budget: float | int | None = None,
  compression_ratio: float | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  recent: int | None = None,
  head_cap: float | int | None = None,
  bound: str | None = None,
  segment_ids=None,
) -> tuple[jax.Array, dict[str, Any]]:
  """Decode every token of `tokens` [B, T] through the cache under a policy (no prefill), for studies.

  `model`: a `DecoderLM` or any NNX model of `FirstPassageAttention` layers whose `__call__` hands a
  `cache=` down to them (`fpa_jax.inference.graph`). `policy`: a name with its keywords (`budget`
  or `compression_ratio`, `tolerance`, ...), or a `CachePolicy` (then no keywords).

  Evicted keys stay in memory (slots are not reused) only so that the attention mass they would
  have received can be measured; what each query attends to is exactly what a reused-slot cache of
  the policy's capacity gives (`generate`; fpa_global: its shared pool, measured here on per-head
  caches under the same eviction rule). Packed rows: `segment_ids` [B, T] restarts the cache
  (and positions) wherever the segment id changes.

  Policies and their arguments (`recent`, `head_cap`, `bound`; a policy of your own from a score
  function): `fpa_jax.inference.policies`. snapkv ranks a prompt's keys at prefill, so it is for
  `generate` only.

  Returns:
    logits [B, T, V] fp32 and stats: `cache_fraction` (peak keys held by any layer, row and head /
    T), `kept_fraction_mean` (mean over steps, layers, rows, heads of kept / seen),
    `kept_fraction_per_head` ([L][KVH] the same mean per layer and kv head), `lost_mass_max` (max
    over steps, layers, rows, heads of the full-cache attention mass on evicted keys), `overflow`
    (a thresholded policy ran out of capacity), `cache_bytes` (what `generate`'s reused-slot cache
    of the policy allocates for these rows), `policy`, `capacity`.
  """
  check_decodable(model)  # first: a model that cannot decode says so before its tokens are read
  tokens = _check_tokens(tokens, model)
  b, t = tokens.shape
  kw = dict(budget=budget, compression_ratio=compression_ratio, tolerance=tolerance, threshold=threshold)
  pol = as_policy(policy, recent=recent, head_cap=head_cap, bound=bound, **kw).resolve(t)
  _check_model_policy(model, pol)
  pol.check_prefill("none")  # snapkv ranks a prompt's keys at prefill: generate() only
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  if seg.shape != (b, t):
    raise ValueError(f"segment_ids must have the tokens' shape {(b, t)}, got {seg.shape}")
  graphdef, state = _split_on_one_device(model)
  logits, s = _cached_logits_program(graphdef, state, tokens, seg, policy=pol)
  s = jax.device_get(s)
  stats = {
    "policy": pol.name,
    "capacity": pol.capacity,
    "cache_fraction": float(np.max(s["peak"])) / t,
    "kept_fraction_mean": _mean(s["kept"]),
    "kept_fraction_per_head": _per_head(np.mean(s["kept"], axis=0)),
    "lost_mass_max": float(np.max(s["lost"])),
    "overflow": bool(np.any(s["overflow"])),
    "cache_bytes": cache_bytes(model, b, pol, t),
  }
  return logits, stats


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------


def _sample(logits, key, temperature: float, top_k: int | None):
  """logits [B, V] -> tokens [B] int32 (greedy at temperature 0)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
  jax.jit, static_argnames=("graphdef", "policy", "max_new", "temperature", "top_k", "prefill", "n_keys", "vocab")
)
def _generate_program(
  graphdef,
  state,
  prompt,
  lengths,
  key,
  *,
  policy: Policy,
  max_new: int,
  temperature: float,
  top_k: int | None,
  prefill: str,
  n_keys: int,
  vocab: int,
):
  TRACES["generate"] += 1
  model = nnx.merge(graphdef, state)
  b, p = prompt.shape
  if prefill == "parallel":
    logits, caches = prefill_parallel(model, prompt, lengths, policy, n_keys)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    peak0, _ = occupancy(caches)
  else:  # token by token under the policy; rows past their prompt keep their state

    def feed(carry, xs, repack=True):
      caches, last, peak = carry
      tok, t = xs
      active = t < lengths
      pos = jnp.full((b,), t, jnp.int32)
      if isinstance(caches, pool.GlobalCache):
        logits, new = decode_step(model, caches, tok, pos, policy, repack=repack)
        caches = _select_rows(active, new, caches)
      else:  # each layer keeps the rows past their prompt itself: no pass over the whole cache here
        logits, caches = decode_step(model, caches, tok, pos, policy, repack=repack, active=active)
      last = jnp.where(active[:, None], logits, last)
      return (caches, last, jnp.maximum(peak, occupancy(caches)[0])), None

    caches = init_caches(model, b, policy, n_keys)
    init = (caches, jnp.zeros((b, vocab), jnp.float32), jnp.float32(0))
    (caches, last, peak0), _ = pool.scan_steps(feed, init, (prompt.T, jnp.arange(p, dtype=jnp.int32)), policy)

  keys = jax.random.split(key, max_new)
  first = _sample(last, keys[0], temperature, top_k)

  def body(carry, xs, repack=True):
    caches, tok, pos, peak = carry
    k = xs
    logits, caches = decode_step(model, caches, tok, pos, policy, repack=repack)
    nxt = _sample(logits, k, temperature, top_k)
    return (caches, nxt, pos + 1, jnp.maximum(peak, occupancy(caches)[0])), nxt

  (caches, _, pos, peak), rest = pool.scan_steps(body, (caches, first, lengths, peak0), keys[1:], policy)
  tokens = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, N]
  overflow = _overflow(caches)
  _, held = occupancy(caches)  # [L, B, KVH] at the end, over the pos keys each row has seen
  kept = jnp.mean(held / pos.astype(jnp.float32)[None, :, None], axis=1)
  return tokens, {"peak": peak, "overflow": overflow, "kept": kept}


def generate(
  model,
  prompt_tokens,
  max_new_tokens: int,
  *,
  lengths=None,
  policy: str | CachePolicy = "full",
  budget: float | int | None = None,
  compression_ratio: float | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  recent: int | None = None,
  head_cap: float | int | None = None,
  bound: str | None = None,
  temperature: float = 0.0,
  top_k: int | None = None,
  seed: int = 0,
  prefill: Literal["parallel", "decode"] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
  """Generate `max_new_tokens` after each prompt with a KV cache under an eviction policy.

  Args:
    model: a `DecoderLM` or any NNX model of `FirstPassageAttention` layers whose `__call__` hands a
      `cache=` down to them (`fpa_jax.inference.graph`).
    prompt_tokens: int [B, P] right-padded prompts (with `lengths` [B]), or a list of token lists
      of different lengths (padded here).
    policy, budget, compression_ratio, tolerance, threshold, recent, head_cap, bound: see
      `fpa_jax.inference.policies`, or policy a `CachePolicy` (then no keywords); a float budget
      (or head_cap) is a fraction of P + max_new_tokens, an int a key count.
    temperature: 0 = greedy; top_k: sample among the k most likely.
    prefill: "parallel" (default; h2o: "decode") runs the prompt through the model's parallel kernel
      (its attn_impl, tiles and skipping, as in training and eval), every
      prompt token attending to every earlier one, then keeps what the policy keeps; "decode" feeds
      the prompt token by token under the policy, so no query ever sees more than the budget
      (snapkv needs "parallel": it ranks the prompt's keys by its last window's attention).
  Returns:
    (tokens int32 [B, N], stats: `cache_fraction` = peak keys held by any layer, row and head /
    (P + N), `capacity` (slots per head; fpa_global: its per-head limit), `slots_per_row` (every
    layer's and head's slots together; fpa_global: its pool, G), `cache_bytes` (what the cache allocates),
    `kept_fraction_per_head` ([L][KVH] keys held at the end / keys seen, mean over rows), `overflow`,
    `policy`, `prefill`).
  """
  check_decodable(model)  # first: a model that cannot decode says so before its prompts are read
  vocab = vocab_size(model)
  prompt, lengths = _pad_prompts(prompt_tokens, lengths, vocab)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if top_k is not None and not 1 <= top_k <= vocab:
    raise ValueError(f"top_k must be in [1, vocab_size={vocab}], got {top_k}")
  b, p = prompt.shape
  n_keys = p + max_new_tokens
  kw = dict(budget=budget, compression_ratio=compression_ratio, tolerance=tolerance, threshold=threshold)
  pol = as_policy(policy, recent=recent, head_cap=head_cap, bound=bound, **kw).resolve(n_keys)
  _check_model_policy(model, pol)
  prefill = prefill or pol.default_prefill()
  if prefill not in ("parallel", "decode"):
    raise ValueError(f"prefill must be 'parallel' or 'decode', got {prefill!r}")
  pol.check_prefill(prefill)  # h2o: decode only; snapkv: parallel only
  graphdef, state = _split_on_one_device(model)
  tokens, s = _generate_program(
    graphdef,
    state,
    prompt,
    lengths,
    jax.random.key(seed),
    policy=pol,
    max_new=max_new_tokens,
    temperature=float(temperature),
    top_k=top_k,
    prefill=prefill,
    n_keys=n_keys,
    vocab=vocab,
  )
  s = jax.device_get(s)
  return np.asarray(tokens), {
    "policy": pol.name,
    "prefill": prefill,
    "capacity": pol.capacity,
    "slots_per_row": slots_per_row(model, pol),
    "cache_fraction": float(s["peak"]) / n_keys,
    "cache_bytes": cache_bytes(model, b, pol, n_keys),
    "kept_fraction_per_head": _per_head(s["kept"]),
    "overflow": bool(s["overflow"]),
  }


# ------------------------------------------------------------------------------------------------
# Input checks
# ------------------------------------------------------------------------------------------------


def _check_tokens(tokens, model) -> jax.Array:
  return check_tokens(tokens, vocab_size(model))  # the model's own check (one definition)


def _pad_prompts(prompt_tokens, lengths, vocab: int) -> tuple[jax.Array, jax.Array]:
  if (
    isinstance(prompt_tokens, (list, tuple))
    and prompt_tokens
    and isinstance(prompt_tokens[0], (list, tuple, np.ndarray))
  ):
    if lengths is not None:
      raise ValueError("pass lengths only with a padded [batch, prompt] array, not with a list of prompts")
    rows: Sequence = [np.asarray(r, np.int64).reshape(-1) for r in prompt_tokens]
    lengths = [len(r) for r in rows]
    width = max(lengths)
    prompt_tokens = np.stack([np.pad(r, (0, width - len(r))) for r in rows])
  prompt = check_tokens(prompt_tokens, vocab)
  b, p = prompt.shape
  lengths = np.full((b,), p) if lengths is None else np.asarray(lengths)
  if lengths.shape != (b,) or np.any(lengths < 1) or np.any(lengths > p):
    raise ValueError(f"lengths must be [batch]={b} values in [1, {p}], got {lengths.tolist()}")
  return prompt, jnp.asarray(lengths, jnp.int32)
