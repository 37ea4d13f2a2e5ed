"""Flax NNX building blocks: RMSNorm, RoPE, SwiGLU and the First Passage Attention layer.

Shape legend: B batch, T sequence, D d_model, H heads, K head_dim, F MLP hidden.
Parameters are fp32 (`param_dtype`) and cast to the compute `dtype` at use; norms, the gate and
the field are always computed in fp32. Every parameter carries logical axis names
(`fpa_jax.sharding`) so the trainer can shard it without this module knowing the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fpa_jax import ops
from fpa_jax.configs import Config
from fpa_jax.sharding import EMBED, HEAD_DIM, HEADS, MLP

F32 = jnp.float32


def _init(init, axes):
  # eager_sharding=False: annotate only; the trainer places the state (no mesh needed here).
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def normal(std):
  return nnx.initializers.normal(std)


def constant(c):
  return nnx.initializers.constant(c)


def _param(rngs, init, shape, axes, dtype):
  return nnx.Param(_init(init, axes)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last dim, in fp32."""

  def __init__(self, dim: int, *, eps: float = 1e-6, axis_name: str | None = EMBED,
               param_dtype=F32, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = _param(rngs, nnx.initializers.ones, (dim,), (axis_name,), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(F32)).astype(x.dtype)


def segment_positions(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """[B, T] position of each token inside its segment (0 at every segment start)."""
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if segment_ids is None:
    return idx
  start = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)  # index of the current segment's start
  return idx - first


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (half-split convention). x [B, T, H, K], positions [B, T]."""
  k = x.shape[-1]
  freq = theta ** (-jnp.arange(0, k // 2, dtype=F32) / (k // 2))           # [K/2]
  ang = positions.astype(F32)[..., None] * freq                              # [B, T, K/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]        # [B, T, 1, K/2]
  x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SwiGLU(nnx.Module):
  """W_down (silu(x W_gate) * (x W_up)); [B, T, D] -> [B, T, D]."""

  def __init__(self, d_model: int, d_ff: int, *, init_std: float, out_std: float, dtype, param_dtype,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.w_gate = _param(rngs, normal(init_std), (d_model, d_ff), (EMBED, MLP), param_dtype)
    self.w_up = _param(rngs, normal(init_std), (d_model, d_ff), (EMBED, MLP), param_dtype)
    self.w_down = _param(rngs, normal(out_std), (d_ff, d_model), (MLP, EMBED), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = self.dtype
    g = x @ self.w_gate[...].astype(dt)                                      # [B, T, F]
    u = x @ self.w_up[...].astype(dt)                                        # [B, T, F]
    return (jax.nn.silu(g) * u) @ self.w_down[...].astype(dt)                # [B, T, D]


class FirstPassageAttention(nnx.Module):
  """Multi-head causal attention with a first-passage forget gate (one code path for all types).

  Per head, from the block input x_t (fp32):
      fox    delta_t = log sigmoid(w_f.x_t + b_f)                         field = cumsum(delta)
      stack  delta_t = log sigmoid(w_f.x_t + b_f) + rise_scale * tanh(w_r.x_t)
      fpa    as stack, level_j = field_j + w_o.x_j + b_o                   (else level = field)
      softmax / nope: no gate (zero log-gate), RoPE for softmax.
  Attention logits get -relu(level_j - min(field_{j+1..i})) (`ops.fpa_attention`); for a monotone
  field (fox) that is exactly FoX's sum of log forget gates.

  Why this parameterisation: the FoX term keeps FoX's init (w_f ~ N(0, 0.02), b_f = 0) so all
  gated variants start at the FoX limit (w_r = 0, w_o = 0 at init; both still receive gradient
  because d tanh(u.x)/du = x at u = 0). The upward step is bounded by rise_scale per token, the
  field stays O(T) like FoX's and fp32 cumsums are well conditioned; the offset is an unbounded
  linear read-out because a key's level is a per-key threshold, not an accumulated quantity.
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    d, h, k = cfg.d_model, cfg.n_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layers) ** 0.5
    self.wq = _param(rngs, normal(std), (d, h, k), (EMBED, HEADS, HEAD_DIM), pdt)
    self.wk = _param(rngs, normal(std), (d, h, k), (EMBED, HEADS, HEAD_DIM), pdt)
    self.wv = _param(rngs, normal(std), (d, h, k), (EMBED, HEADS, HEAD_DIM), pdt)
    self.wo = _param(rngs, normal(out_std), (h, k, d), (HEADS, HEAD_DIM, EMBED), pdt)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(k, eps=cfg.norm_eps, axis_name=HEAD_DIM, param_dtype=pdt, rngs=rngs)
      self.k_norm = RMSNorm(k, eps=cfg.norm_eps, axis_name=HEAD_DIM, param_dtype=pdt, rngs=rngs)
    if cfg.output_gate:
      self.wg = _param(rngs, normal(std), (d, h, k), (EMBED, HEADS, HEAD_DIM), pdt)
    if cfg.attention in ("fox", "stack", "fpa"):
      self.w_f = _param(rngs, normal(cfg.gate_init_std), (d, h), (EMBED, HEADS), pdt)
      self.b_f = _param(rngs, constant(cfg.gate_bias_init), (h,), (HEADS,), pdt)
    if cfg.attention in ("stack", "fpa"):
      self.w_r = _param(rngs, normal(cfg.rise_init_std), (d, h), (EMBED, HEADS), pdt)
    if cfg.attention == "fpa":
      self.w_o = _param(rngs, normal(cfg.offset_init_std), (d, h), (EMBED, HEADS), pdt)
      self.b_o = _param(rngs, constant(cfg.offset_bias_init), (h,), (HEADS,), pdt)

  def log_forget(self, x: jax.Array) -> jax.Array:
    """FoX's log forget gate: x [B, T, D] -> [B, T, H] fp32, <= 0."""
    return jax.nn.log_sigmoid(x.astype(F32) @ self.w_f[...].astype(F32) + self.b_f[...].astype(F32))

  def gate(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> (field, level), each [B, T, H] fp32."""
    cfg = self.cfg
    x32 = x.astype(F32)
    delta = self.log_forget(x32)                                                               # [B, T, H] <= 0
    if cfg.attention in ("stack", "fpa"):
      delta = delta + cfg.rise_scale * jnp.tanh(x32 @ self.w_r[...].astype(F32))
    field = jnp.cumsum(delta, axis=1)                                                          # [B, T, H]
    level = field
    if cfg.attention == "fpa":
      level = field + x32 @ self.w_o[...].astype(F32) + self.b_o[...].astype(F32)
    return field, level

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
    cfg, dt = self.cfg, self.dtype
    b, t, _ = x.shape
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))              # [B, T, H, K]
    k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dt))              # [B, T, H, K]
    v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dt))              # [B, T, H, K]
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if cfg.use_rope:
      pos = segment_positions(segment_ids, b, t) if positions is None else positions
      q, k = apply_rope(q, pos, cfg.rope_theta), apply_rope(k, pos, cfg.rope_theta)
    kw = dict(impl=cfg.attn_impl, segment_ids=segment_ids,
              block_size=(cfg.block_size or None) if cfg.attn_impl == "chunked" else None)
    if cfg.attention == "fox":
      # FoX: field == level == cumsum(delta); the FoX kernel tiles c_i - c_j directly (cheaper,
      # mathematically identical to fpa_attention(field, field)) -- the honest cost baseline.
      o = ops.fox_attention(q, k, v, self.log_forget(x), **kw)
    elif cfg.attention in ("stack", "fpa"):
      field, level = self.gate(x)
      o = ops.fpa_attention(q, k, v, field, level, **kw)
    else:
      # softmax / nope: the same tiled kernel with a zero log-gate (memory-efficient, and
      # throughput comparisons then measure only the gate's cost).
      o = ops.fox_attention(q, k, v, jnp.zeros((b, t, cfg.n_heads), F32), **kw)
    o = o.astype(dt)                                                         # [B, T, H, K]
    if cfg.output_gate:
      o = o * jax.nn.sigmoid(jnp.einsum("btd,dhk->bthk", x, self.wg[...].astype(dt)))
    return jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(dt))           # [B, T, D]
