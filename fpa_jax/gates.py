"""Gates: NNX modules that turn the attention block input into the field and the key levels.

One definition serves the parallel path (a cumsum over the sequence) and decoding (a carried
running sum), so training and inference can never disagree about what the field is.

Per head h, token t, block input x_t (fp32), a gate has up to four linear read-outs:

    forget    f_t = log sigmoid(w_f.x_t + b_f)                 (<= 0: FoX's log forget gate)
    step      s_t = step_scale * (w_s.x_t + b_s)               (free sign: the walk's increment)
    absolute  a_t = absolute_scale * (w_a.x_t + b_a)           (a non-accumulated part of the field)
    offset    o_t = offset_scale * (w_o.x_t + b_o)             (a key's own level above the field)

    field_t = sum_{s <= t} (f_s + s_s) + a_t,       level_t = field_t + o_t

A leaky head (kind "l", `ModelConfig.walk_leak` = 1 - r) sums with a retention r < 1 instead:
walk_t = r * walk_{t-1} + f_t + s_t, a walk that keeps its local order (near keys' dips) but is held
within |increment| / (1 - r) of 0, so it cannot drift by age: a far key's penalty is its level above
the band the field moves in, which is content.

Which read-outs a gate has is `ModelConfig.gate_terms` (fox: forget; stack: step; fpa: step, absolute,
offset). `GateParts` holds the per-token terms; `field_level` does the (carried) sum.
Shape legend: B batch, T sequence, D d_model, H heads. Gates have one entry per kv head
(`ModelConfig.kv_heads`, = n_heads unless grouped-query), written H here too.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from fpa_jax.configs import GATE_TERMS, HEAD_GATES, LEAKY, ModelConfig
from fpa_jax.ops.common import F32
from fpa_jax.sharding import EMBED, HEADS


class GateParts(NamedTuple):
  """Per-token gate terms, each [B, T, H] fp32 or None (absent = 0)."""

  increment: jax.Array  # forget + step: what the field accumulates
  absolute: jax.Array | None
  offset: jax.Array | None
  retain: tuple[float, ...] | None = None  # per head, what the walk keeps of itself a token on (None: all)


class LinearReadout(nnx.Module):
  """scale * (x @ w + b): [B, T, D] -> [B, T, H] fp32. `w` [D, H], `b` [H]."""

  def __init__(self, d: int, h: int, *, scale: float, init_std: float, bias_init: float, param_dtype, rngs: nnx.Rngs):
    part = lambda init, axes: nnx.with_partitioning(init, axes, eager_sharding=False)
    self.scale = float(scale)
    self.w = nnx.Param(part(nnx.initializers.normal(init_std), (EMBED, HEADS))(rngs.params(), (d, h), param_dtype))
    self.b = nnx.Param(part(nnx.initializers.constant(bias_init), (HEADS,))(rngs.params(), (h,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.scale * (x.astype(F32) @ self.w[...].astype(F32) + self.b[...].astype(F32))


_SIDE_TAG = 0x6A7E  # folded into the layer's next key: the FPA read-outs' own stream


def _side_stream(rngs: nnx.Rngs) -> nnx.Rngs:
  """A params stream derived from the layer's next key without drawing it (its count stays)."""
  s = rngs.params
  return nnx.Rngs(params=jax.random.fold_in(jax.random.fold_in(s.key[...], s.count[...]), _SIDE_TAG))


class Gate(nnx.Module):
  """The gate of one attention layer; optional read-outs are None when the variant lacks them."""

  def __init__(self, cfg: ModelConfig, *, layer: int = 0, rngs: nnx.Rngs):
    """`layer`: the block's index, which picks its group of `cfg.head_gates`."""
    terms = cfg.gate_terms
    # One read-out per kv head: a key's penalty is then shared by the query heads of its group.
    d, h, pdt = cfg.d_model, cfg.kv_heads, jnp.dtype(cfg.param_dtype)
    mk = lambda scale, std, bias, r=rngs: LinearReadout(
      d, h, scale=scale, init_std=std, bias_init=bias, param_dtype=pdt, rngs=r
    )
    self.n_heads = h
    # Which read-outs feed each head (`ModelConfig.head_gates`, or fox_heads' split): a term a head's
    # kind lacks is replaced by 0 there (its read-out weights get no gradient and stay as they were).
    kinds = cfg.head_gate_kinds(layer)
    self.head_kinds = kinds
    # a leaky head's retention, 1.0 on the others (None when no head leaks: the plain cumsum)
    self.retain = tuple(1.0 - cfg.walk_leak if c in LEAKY else 1.0 for c in kinds) if LEAKY & set(kinds) else None
    # per term, per head: kept? (tuples: a module's static attributes must hash, for jit)
    self._keeps = tuple((t, tuple(t in HEAD_GATES[c] for c in kinds)) for t in GATE_TERMS)
    self.forget: LinearReadout | None = mk(1.0, cfg.gate_init_std, cfg.gate_bias_init) if "forget" in terms else None
    # The FPA read-outs draw from a side stream (the layer's stream does not advance for them), so
    # every other parameter of an FPA model starts equal to the FoX (with `gate_forget`) or softmax
    # model of the same seed: FPA started at FoX's init with zero read-outs is FoX exactly, and a
    # comparison by seed measures the gate alone, not a different draw of the other weights.
    side = _side_stream(rngs) if set(terms) - {"forget"} else None
    self.step: LinearReadout | None = (
      mk(cfg.step_scale, cfg.step_init_std, cfg.step_bias_init, side) if "step" in terms else None
    )
    self.absolute: LinearReadout | None = (
      mk(cfg.absolute_scale, cfg.absolute_init_std, 0.0, side) if "absolute" in terms else None
    )
    self.offset: LinearReadout | None = (
      mk(cfg.offset_scale, cfg.offset_init_std, cfg.offset_bias_init, side) if "offset" in terms else None
    )

  @property
  def is_fox(self) -> bool:
    """Field == level == cumsum of a log forget gate: the monotone special case (FoX kernel)."""
    return self.step is None and self.absolute is None and self.offset is None

  def _term(self, term: str, out: jax.Array | None) -> jax.Array | None:
    """A read-out's term [B, T, H], 0 on the heads whose kind lacks it; None if the gate lacks it."""
    keep = dict(self._keeps)[term]
    if out is None or all(keep):
      return out
    # a where, not a product: keeps out's dtype, and 0 * inf would be nan
    return jnp.where(jnp.asarray(keep), out, jnp.zeros((), out.dtype))

  def parts(self, x: jax.Array) -> GateParts:
    """x [B, T, D] -> per-token terms; pointwise in t, so decoding calls it on one token."""
    inc = jnp.zeros(x.shape[:2] + (self.n_heads,), F32)  # no accumulating term: a flat walk
    if self.forget is not None:
      inc = inc + self._term("forget", jax.nn.log_sigmoid(self.forget(x)))
    if self.step is not None:
      inc = inc + self._term("step", self.step(x))
    return GateParts(
      increment=jnp.asarray(inc, F32),
      absolute=self._term("absolute", None if self.absolute is None else self.absolute(x)),
      offset=self._term("offset", None if self.offset is None else self.offset(x)),
      retain=self.retain,
    )

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> (field, level), each [B, T, H] fp32 (the parallel path)."""
    field, level, _ = field_level(self.parts(x))
    return field, level


def field_level(
  parts: GateParts, carry: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(field, level, cum) [B, T, H] from gate terms [B, T, H] and the running sum before them.

  carry: [B, H] the walk over the tokens already seen (None = 0, a fresh sequence); cum[:, t] is the
  walk through token t (the carry after it). segment_ids: [B, T] int or None, packed documents; a
  leaky walk restarts at 0 where the id changes, as a fresh sequence would (a plain walk needs no
  restart: the penalty only reads differences of field and level, so its carry's value never matters
  and packed segments may share one cumsum).
  """
  if parts.retain is None:
    cum = jnp.cumsum(parts.increment, axis=1)  # [B, T, H]
    if carry is not None:
      cum = cum + carry[:, None, :]
  else:
    cum = leaky_walk(parts.increment, parts.retain, carry, segment_ids)
  field = cum if parts.absolute is None else cum + parts.absolute
  level = field if parts.offset is None else field + parts.offset
  return field, level, cum


def leaky_walk(
  inc: jax.Array, retain: tuple[float, ...], carry: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> jax.Array:
  """walk_t = r_h * walk_{t-1} + inc_t: inc [B, T, H] fp32, retain (r_h, H floats in (0, 1]),
  carry [B, H] the walk before token 0 (None = 0), segment_ids [B, T] (restart at 0 on a new id)
  -> [B, T, H]. A linear recurrence as an associative scan over (r, b) pairs, (r1, b1) then (r2, b2)
  = (r1 r2, r2 b1 + b2): O(log T) depth, as the cumsum it replaces."""
  a = jnp.broadcast_to(jnp.asarray(retain, F32), inc.shape)
  if segment_ids is not None:
    new = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    a = jnp.where(new[..., None], 0.0, a)  # nothing carried into a new document

  def combine(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]

  decay, walk = jax.lax.associative_scan(combine, (a, inc.astype(F32)), axis=1)
  return walk if carry is None else walk + decay * carry[:, None, :]
