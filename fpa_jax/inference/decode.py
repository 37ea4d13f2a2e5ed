"""Decoding with a first-passage KV cache: the one public decoder (`Decoder`: init, prefill, step,
extend) and what is built on it, `cached_logits` (studies) and `generate`.

The model is a `DecoderLM` or any NNX model made of `FirstPassageAttention` layers whose `__call__`
hands a `cache=` down to them (`fpa_jax.inference.graph`: the layers are found in the NNX graph,
one cache per layer). Shape legend: B batch, T tokens, P prompt length, N new tokens, V vocab,
L attention layers, H heads.

`Decoder` runs over one decode-state protocol (`cache.DecodeState`: occupancy, overflow, row
select, ...), which every layer's `LayerCache` together (`cache.LayerCaches`) and fpa_global's slot
pool (`pool.GlobalCache`) implement, so no code here asks which layout a state is. `generate` and
`cached_logits` each build one jitted program per (model structure, policy, shapes): the per-token
step is traced once and run by `jax.lax.scan`, so a whole generation compiles once. Model weights
are passed as NNX state, never baked into the program.

The global budget (`fpa_global`) needs every layer's penalties at once, so it lives here, at the
model level. `generate` keeps one slot pool per row for all layers and kv heads (`pool.GlobalCache`,
G slots, `FPAGlobal.pool_slots`: with its tags and index, at most the budget's bytes): the model's cached loop threads it through the layers' attend calls
(`pool.GlobalCache.with_run`) and `pool.pool_evict` frees slots after each step. `cached_logits`
measures it on ordinary per-head caches of one slot per token with `cache.global_evict` after each
step (`cache.LayerCaches.settle`): the same
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
  DecodeState,
  Extend,
  LayerCaches,
  Prefill,
  check_chunk_policy,
  global_evict,
  init_layer_state,
)
from fpa_jax.inference.graph import call_cached, check_decodable, layer_configs, vocab_size
from fpa_jax.inference.policies import (  # noqa: F401  (the bounds: importable from here, as before)
  CachePolicy,
  PolicyRule,
  as_policy,
  layer_logit_bounds,
  layer_query_bounds,
)
from fpa_jax.models import DecoderLM, check_tokens

TRACES = {"cached_logits": 0, "generate": 0}  # Python traces of each program (tests: no retracing)


# ------------------------------------------------------------------------------------------------
# Caches
# ------------------------------------------------------------------------------------------------


def _check_model_policy(model, policy: PolicyRule) -> None:
  """Before tracing: a model of your own decodes (`graph.check_decodable`) and suits the policy
  (`PolicyRule.check_model`: fpa needs bounded layers; fpa_global's one pool the same kv heads, head dim
  and dtype in every layer). A `DecoderLM` always does."""
  if isinstance(model, DecoderLM):
    return
  check_decodable(model)
  policy.check_model(model)


def init_caches(model, batch: int, policy: PolicyRule, n_keys: int, slots: int | None = None) -> DecodeState:
  """An empty `DecodeState` for `policy`: one `LayerCache` per attention layer with the policy's
  thresholds (`LayerCaches`), each of its layer's kv heads, head dim and dtype; fpa_global: the
  shared pool (`pool.GlobalCache`).

  n_keys: the most keys a sequence can have (the N in the `fpa` tolerance threshold).
  slots: default `policy.capacity` (fpa_heads: each (layer, kv head) a cache of its own capacity,
  `cache.HeadCaches`); `cached_logits` measures with one slot per token. fpa_global
  without `slots`: a `pool.GlobalCache` of G slots per row (`FPAGlobal.pool_slots`: the pool with
  its tags and index fits in the budget's keys' bytes; what `generate`
  decodes with); with `slots`: per-head caches of that many slots (the measuring layout, and a
  parallel prefill's candidates).
  """
  layers = layer_configs(model)
  n = len(layers)
  if policy.is_global and slots is None:
    c = layers[0]  # the same in every layer (`_check_model_policy`)
    g = policy.pool_slots(n, c.kv_heads, c.head_dim, jnp.dtype(c.dtype).itemsize)
    empty = pool.init_global_cache(batch, g, n, c.kv_heads, c.head_dim, dtype=jnp.dtype(c.dtype))
    return pool.prepare(empty, policy)
  thresholds, coefs, caps = zip(*policy.layer_thresholds(model, n_keys))  # per layer: the policy's
  # Slots per kv head: a key, its level and penalty are shared by the query heads of its group.
  return LayerCaches(
    tuple(
      init_layer_state(
        policy,
        i,
        batch,
        slots,
        a.kv_heads,
        a.head_dim,
        dtype=jnp.dtype(a.dtype),
        threshold=thr,
        key_coef=coef,
        key_cap=cap,
      )
      for i, (a, thr, coef, cap) in enumerate(zip(layers, thresholds, coefs, caps))
    )
  )


def cache_bytes(model, batch: int, policy: PolicyRule, n_keys: int | None = None) -> int:
  """Bytes every array of `generate`'s reused-slot cache allocates (fpa_global: its pool; no allocation)."""
  shapes = jax.eval_shape(lambda: init_caches(model, batch, policy, n_keys or policy.capacity))
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def slots_per_row(model, policy: PolicyRule) -> int:
  """Key slots one row's cache allocates over all layers and kv heads (fpa_global: the pool, G)."""
  return policy.slots_per_row(layer_configs(model))


def _split_on_one_device(model):
  """nnx.split, with the state gathered onto one device if it is spread over several.

  Decoding runs on one device (batch-sharded decoding is future work): a model straight from a
  sharded training run would otherwise run every decode step as a multi-device program.
  """
  graphdef, state = nnx.split(model)
  if any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(state) if hasattr(x, "sharding")):
    state = jax.device_put(state, jax.devices()[0])
  return graphdef, state


def prefill_parallel(model, prompt, lengths, policy: PolicyRule, n_keys: int):
  """The prompt [B, P] (right-padded, `lengths` [B]) through the layers' parallel kernel (their
  impl, tiles and skipping: `layers.AttentionSpec`), then the cache the policy keeps -> (logits
  [B, P, V], `DecodeState`). fpa_global: every layer's prompt keys are
  candidates (per head, at most the per-head limit, by `cache.prefill_attend`'s order), then the
  global rule of `cache.global_evict` (each head's last W - 1 prompt keys protected, the largest
  penalties across layers and heads out first, ties oldest, then lower layer / head) cuts them to
  G - L * KVH keys (G: `FPAGlobal.pool_slots`), packed into the pool (`pool.pool_from_caches`)."""
  b, p = prompt.shape
  caches = init_caches(model, b, policy, n_keys, slots=min(policy.capacity, p) if policy.is_global else None)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  logits, done = call_cached(model, prompt, positions, caches.with_run(Prefill(policy, lengths)))
  state = done.settle(caches)
  if policy.is_global:
    g = slots_per_row(model, policy)
    state = pool.prepare(pool.pool_from_caches(global_evict(state, policy, lengths - 1, g), g), policy)
  return logits, state


class Decoder:
  """The one public decoder: a model and a resolved cache policy, and the four things decoding does
  over one `cache.DecodeState` (every layer's `LayerCache`, or fpa_global's shared pool: the
  decoder never asks which). `generate`, `cached_logits`, `extend`, the eval and the benchmarks are
  built on it; its methods are pure functions of (state, tokens), to call inside your own `jax.jit`
  (with the model merged there: `nnx.merge`) or eagerly.

      dec = Decoder(model, "fpa_budget", max_len=P + N, budget=0.25)   # or policy=FPABudget(budget=0.25)
      logits, state = dec.prefill(prompt, lengths)               # [B, P, V]; mode="decode": token by token
      logits, state = dec.step(state, tokens, positions)          # one token per row: [B] -> [B, V]
      logits, state = dec.extend(state, chunk, lengths, offsets)  # a chunk after the cache: [B, T, V]
      peak, held = state.occupancy()                              # [] and [L, B, KVH] keys held

  `model`: a `DecoderLM` or an NNX model of `FirstPassageAttention` layers whose `__call__` hands
  `cache=` to them (`inference.graph`). `policy`: a name with its keywords, a `CachePolicy`, an
  unresolved `PolicyRule` (resolved here for `max_len`, the most tokens a row holds: the N of the
  tolerance bound and what a float budget is a fraction of) or a resolved one (used as it is).
  Checked here, before any tracing: the model decodes and suits the policy.
  """

  def __init__(self, model, policy: str | CachePolicy | PolicyRule = "full", *, max_len: int, **policy_kw):
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
      raise ValueError(f"max_len must be an int >= 1 (the most tokens a row holds), got {max_len!r}")
    check_decodable(model)
    if isinstance(policy, PolicyRule) and policy.resolved:
      given = sorted(k for k, v in policy_kw.items() if v is not None)
      if given:
        raise ValueError(f"policy is a resolved {type(policy).__name__}: its arguments are in it, drop {given}")
      pol = policy
    else:
      pol = as_policy(policy, **policy_kw).resolve(max_len)
    _check_model_policy(model, pol)
    # Sizing checks here, not while tracing: fpa_global's pool that the budget's bytes leave no room in,
    # fpa_heads' split against the model's layers and kv heads.
    slots_per_row(model, pol)
    self.model, self.policy, self.max_len = model, pol, max_len

  def init(self, batch: int, *, slots: int | None = None) -> DecodeState:
    """An empty state for `batch` rows (`init_caches`; `slots`: the measuring layout's slots per head)."""
    return init_caches(self.model, batch, self.policy, self.max_len, slots)

  def nbytes(self, batch: int) -> int:
    """Bytes the state of `batch` rows allocates (`cache_bytes`; nothing is allocated)."""
    return cache_bytes(self.model, batch, self.policy, self.max_len)

  def slots_per_row(self) -> int:
    """Key slots one row's state holds over every layer and kv head (fpa_global: its pool, G)."""
    return slots_per_row(self.model, self.policy)

  def prefill(self, prompt, lengths=None, *, mode: str | None = None) -> tuple[jax.Array, DecodeState]:
    """The prompt [B, P] (right-padded, `lengths` [B], default P) into a fresh state -> (logits
    [B, P, V], state). mode "parallel" (the policy's default where it has one): the layers'
    parallel kernel, every prompt token attending to every earlier one, then the cache the policy
    keeps (`prefill_parallel`); "decode": token by token under the policy (`step`), so no query
    sees more than the budget (rows past their prompt keep their state; their logits there: junk)."""
    b, p = prompt.shape
    lengths = jnp.full((b,), p, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    mode = mode or self.policy.default_prefill()
    if mode not in ("parallel", "decode"):
      raise ValueError(f"prefill mode must be 'parallel' or 'decode', got {mode!r}")
    self.policy.check_prefill(mode)
    if mode == "parallel":
      return prefill_parallel(self.model, prompt, lengths, self.policy, self.max_len)
    logits, state, _ = self._feed(prompt, lengths, keep="all")
    return logits, state

  def _feed(self, prompt, lengths, *, keep: str):
    """The decode prefill's loop -> (logits [B, P, V] (keep "all") or each row's last prompt token's
    [B, V] (keep "last"), state, the peak keys held by any (layer, row, kv head) [])."""
    b, p = prompt.shape

    def feed(carry, xs, repack=True):
      state, last, peak = carry
      tok, t = xs
      logits, state = self.step(state, tok, jnp.full((b,), t, jnp.int32), active=t < lengths, repack=repack)
      last = jnp.where((t < lengths)[:, None], logits, last)
      return (state, last, jnp.maximum(peak, state.occupancy()[0])), (logits if keep == "all" else None)

    vocab = vocab_size(self.model)
    init = (self.init(b), jnp.zeros((b, vocab), jnp.float32), jnp.float32(0))
    (state, last, peak), ys = self.scan(feed, init, (prompt.T, jnp.arange(p, dtype=jnp.int32)))
    return (jnp.swapaxes(ys, 0, 1) if keep == "all" else last), state, peak

  def step(
    self, state: DecodeState, tokens, positions, *, active=None, slot=None, measure: bool = False, repack: bool = True
  ) -> tuple[jax.Array, DecodeState]:
    """One token per row: tokens, positions [B] -> (logits [B, V], state after it).

    active: [B] bool, the rows that take the token (None: all); the others keep their state (a
    decode prefill's rows past their prompt). slot, measure: the measuring layout of
    `cached_logits` (write slot `slot` [], never reuse one; `cache.decode_attend`). repack: False
    inside `scan`'s blocks (fpa_global's packed pool repacks between them)."""
    run = Decode(self.policy, positions, step=slot, measure=measure, active=active)
    logits, done = call_cached(self.model, tokens[:, None], positions[:, None], state.with_run(run))
    return logits[:, 0], done.settle(state, repack=repack)

  def extend(self, state: DecodeState, tokens, lengths, offsets) -> tuple[jax.Array, DecodeState]:
    """A chunk of new tokens per row after the state: tokens [B, T] (right-padded, `lengths` [B] in
    [0, T]), offsets [B] each row's tokens so far -> (logits [B, T, V], state after it). Each layer
    runs `cache.prefill_chunk` (policies that rank keys by what one chunk sees: `cache.CHUNKABLE`)."""
    check_chunk_policy(self.policy)
    positions = offsets[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, done = call_cached(self.model, tokens, positions, state.with_run(Extend(self.policy, lengths, offsets)))
    return logits, done.settle(state)

  def scan(self, body, init, xs):
    """`lax.scan(body, init, xs)` for a decode loop whose carry starts with the state; `body(carry,
    x, repack=...)` passes `repack` to `step` (`pool.scan_steps`: fpa_global's packed pool runs its
    steps in blocks, repacked between them)."""
    return pool.scan_steps(body, init, xs, self.policy)


def _per_head(kept: np.ndarray) -> list[list[float]]:
  """[L, KVH] -> lists per layer, the NaN padding of layers with fewer kv heads dropped."""
  return [[v for v in row if not np.isnan(v)] for row in np.asarray(kept).tolist()]


def _mean(kept: np.ndarray) -> float:
  """The mean over every real (not padding) entry."""
  kept = np.asarray(kept)
  return float(np.mean(kept[~np.isnan(kept)]) if np.isnan(kept).any() else np.mean(kept))


# ------------------------------------------------------------------------------------------------
# cached_logits
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "policy"))
def _cached_logits_program(graphdef, state, tokens, segment_ids, *, policy: PolicyRule):
  TRACES["cached_logits"] += 1
  b, t = tokens.shape
  dec = Decoder(nnx.merge(graphdef, state), policy, max_len=t)

  def body(carry, xs):
    caches, prev_seg, prev_pos = carry
    tok, seg, step = xs
    new_seq = seg != prev_seg
    caches = caches.reset_rows(new_seq)
    pos = jnp.where(new_seq, 0, prev_pos + 1)
    logits, caches = dec.step(caches, tok, pos, slot=step, measure=True)
    peak, held = caches.occupancy()
    kept = jnp.mean(held / (pos + 1).astype(jnp.float32)[None, :, None], axis=1)  # [L, KVH]
    return (caches, seg, pos), (logits, peak, kept, caches.lost(), caches.overflow())

  init = (dec.init(b, slots=t), jnp.full((b,), -1, jnp.int32), jnp.full((b,), -1, jnp.int32))
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
  pol = Decoder(model, policy, max_len=t, recent=recent, head_cap=head_cap, bound=bound, **kw).policy
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
  policy: PolicyRule,
  max_new: int,
  temperature: float,
  top_k: int | None,
  prefill: str,
  n_keys: int,
  vocab: int,
):
  TRACES["generate"] += 1
  b, p = prompt.shape
  dec = Decoder(nnx.merge(graphdef, state), policy, max_len=n_keys)
  if prefill == "parallel":
    logits, caches = dec.prefill(prompt, lengths, mode="parallel")
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    peak0, _ = caches.occupancy()
  else:  # token by token under the policy; rows past their prompt keep their state
    last, caches, peak0 = dec._feed(prompt, lengths, keep="last")

  keys = jax.random.split(key, max_new)
  first = _sample(last, keys[0], temperature, top_k)

  def body(carry, xs, repack=True):
    caches, tok, pos, peak = carry
    logits, caches = dec.step(caches, tok, pos, repack=repack)
    nxt = _sample(logits, xs, temperature, top_k)
    return (caches, nxt, pos + 1, jnp.maximum(peak, caches.occupancy()[0])), nxt

  (caches, _, pos, peak), rest = dec.scan(body, (caches, first, lengths, peak0), keys[1:])
  tokens = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, N]
  _, held = caches.occupancy()  # [L, B, KVH] at the end, over the pos keys each row has seen
  kept = jnp.mean(held / pos.astype(jnp.float32)[None, :, None], axis=1)
  return tokens, {"peak": peak, "overflow": caches.overflow(), "kept": kept}


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
  pol = Decoder(model, policy, max_len=n_keys, recent=recent, head_cap=head_cap, bound=bound, **kw).policy
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
