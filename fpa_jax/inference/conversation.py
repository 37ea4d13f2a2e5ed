"""A conversation prefilled chunk by chunk: each call runs only its new tokens against the cache the
previous calls left, under an eviction policy.

    from fpa_jax.inference import extend
    logits, conv = extend(model, turn_1, max_len=4096, policy="fpa_budget", budget=512)
    logits, conv = extend(model, turn_2, conv)          # turn 2 attends to what turn 1 left
    logits, conv = extend(model, next_token[:, None], conv)   # one token: a decode step

Shape legend: B batch, T tokens of the call, V vocab, L layers, KVH kv heads. The model: a `DecoderLM`
or a model of your own whose `__call__` hands `cache=` down to its layers (`inference.graph`).

Each layer runs `inference.cache.prefill_chunk`: the chunk's queries attend to the cached keys with
their first-passage state and to the chunk causally (`ops.prefix.prefix_attention`, exact), then the
policy keeps the cache's slots' worth of the cached and new keys. With the `full` policy the logits
of every chunk equal the model's parallel logits over the whole conversation (up to fp32 reduction
order); with an evicting policy each query sees the keys the cache kept plus its own chunk's.
Re-running the whole conversation at every turn costs O(N^2) over N tokens; chunk by chunk costs
O(T * (S + T)) per chunk of T tokens against S slots (`experiments/bench_prefix.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fpa_jax.inference.cache import LayerCaches, check_chunk_policy, keys_held
from fpa_jax.inference.decode import Decoder, _split_on_one_device
from fpa_jax.inference.graph import check_decodable, vocab_size
from fpa_jax.inference.policies import CachePolicy, PolicyRule, as_policy
from fpa_jax.models import check_tokens

TRACES = {"extend": 0}  # Python traces of the program (tests: one per shape)


@dataclasses.dataclass(frozen=True)
class Conversation:
  """What `extend` leaves for the next call: every layer's `LayerCache` (`caches`, a
  `cache.LayerCaches`: the decoder's state), the tokens each row has
  seen (`seen` [B] int, on the host: the next chunk's first position), the resolved policy and
  `max_len`, the most tokens a row may hold (the N of the `fpa` tolerance bound; what a float budget
  is a fraction of)."""

  caches: LayerCaches
  seen: np.ndarray
  policy: PolicyRule
  max_len: int

  def keys_held(self) -> np.ndarray:
    """[L, B, KVH] keys each (layer, row, kv head) holds (-1 past the kv heads of a layer with fewer)."""
    held = [np.asarray(keys_held(c)) for c in self.caches]
    kvh = max(h.shape[1] for h in held)
    return np.stack([np.pad(h, ((0, 0), (0, kvh - h.shape[1])), constant_values=-1) for h in held])

  def nbytes(self) -> int:
    """Bytes the cache allocates, every array of every layer (as `decode.cache_bytes` counts)."""
    return self.caches.nbytes()


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "max_len"))
def extend_program(graphdef, state, caches, tokens, lengths, seen, *, policy: PolicyRule, max_len: int):
  """The jitted program of one `extend` chunk (graphdef, policy, max_len static): `Decoder.extend`
  -> (logits, caches). Public so that a benchmark can lower it (`.lower(...).compile().memory_analysis()`)."""
  TRACES["extend"] += 1
  return Decoder(nnx.merge(graphdef, state), policy, max_len=max_len).extend(caches, tokens, lengths, seen)


def extend(
  model,
  tokens,
  conversation: Conversation | None = None,
  *,
  lengths=None,
  max_len: int | None = None,
  policy: str | CachePolicy = "full",
  budget: float | int | None = None,
  compression_ratio: float | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  recent: int | None = None,
  bound: str | None = None,
) -> tuple[jax.Array, Conversation]:
  """Run `tokens` [B, T] (right-padded, `lengths` [B] in [0, T], default T) after `conversation`.

  The first call (conversation=None) starts one with an empty cache under the policy: `max_len`
  (required) is the most tokens a row will hold, and policy, budget, compression_ratio, tolerance,
  threshold, recent, bound are `policies.make_policy`'s, or policy a `CachePolicy` (policies
  `cache.CHUNKABLE`, a score policy of your own included; a float budget is a fraction of max_len).
  Later calls pass the conversation and no policy argument.

  Returns:
    (logits [B, T, V] fp32 of the chunk's tokens (padding rows: junk), the conversation after it).
  Raises ValueError before tracing on bad tokens or lengths, a policy argument with a conversation,
  or a chunk that would take a row past max_len (the cache would drop keys the policy did not choose
  and the tolerance bound would no longer hold).
  """
  check_decodable(model)
  tokens = check_tokens(tokens, vocab_size(model))
  b, t = tokens.shape
  given = dict(
    budget=budget,
    compression_ratio=compression_ratio,
    tolerance=tolerance,
    threshold=threshold,
    recent=recent,
    bound=bound,
  )
  if conversation is None:
    if max_len is None or isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
      raise ValueError(
        f"the first extend() call starts a conversation: pass max_len=N (an int >= 1), the most tokens a row "
        f"will hold, got max_len={max_len!r}"
      )
    pol = as_policy(policy, **given).resolve(max_len)
    check_chunk_policy(pol)
    dec = Decoder(model, pol, max_len=max_len)
    conversation = Conversation(dec.init(b), np.zeros((b,), np.int64), pol, max_len)
  else:
    passed = sorted(k for k, val in given.items() if val is not None) + (["policy"] if policy != "full" else [])
    if passed or max_len is not None:
      raise ValueError(
        f"extend(..., conversation) continues under the conversation's own policy and max_len: drop "
        f"{passed + (['max_len'] if max_len is not None else [])}"
      )
    if conversation.seen.shape != (b,):
      raise ValueError(f"tokens must have the conversation's batch of {conversation.seen.shape[0]} rows, got {b}")
  lengths = np.full((b,), t) if lengths is None else np.asarray(lengths)
  if (
    lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer) or np.any(lengths < 0) or np.any(lengths > t)
  ):
    raise ValueError(f"lengths must be [batch]={b} ints in [0, {t}], got {lengths.tolist()}")
  after = conversation.seen + lengths
  if np.any(after > conversation.max_len):
    raise ValueError(
      f"this chunk takes rows {np.flatnonzero(after > conversation.max_len).tolist()} to {int(after.max())} tokens, "
      f"past the conversation's max_len={conversation.max_len}: start it with a larger max_len"
    )
  graphdef, state = _split_on_one_device(model)  # a sharded model decodes on one device, as in generate
  logits, caches = extend_program(
    graphdef,
    state,
    conversation.caches,
    tokens,
    jnp.asarray(lengths, jnp.int32),
    jnp.asarray(conversation.seen, jnp.int32),
    policy=conversation.policy,
    max_len=conversation.max_len,
  )
  return logits, dataclasses.replace(conversation, caches=caches, seen=after)
