"""Flax NNX building blocks: RMSNorm, RoPE, SwiGLU and the First Passage Attention layer.

Shape legend: B batch, T sequence, D d_model, H heads, KVH kv heads (k, v, gates; = H unless
grouped-query), K head_dim, F MLP hidden.
Parameters are fp32 (`param_dtype`) and cast to the compute `dtype` at use; norms, the gate and
the field are always computed in fp32. Every parameter carries logical axis names
(`fpa_jax.sharding`) so the trainer can shard it without this module knowing the mesh; activations
are pinned with `constrain(x, BTHK)` etc. (no-ops unless the caller set a mesh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fpa_jax import ops
from fpa_jax.configs import Config, ModelConfig
from fpa_jax.gates import Gate, field_level
from fpa_jax.sharding import BT, BTD, BTF, BTH, BTHK, EMBED, HEAD_DIM, HEADS, MLP, constrain, shard_local

F32 = jnp.float32


def _init(init, axes):
  # eager_sharding=False: annotate only; the trainer places the state (no mesh needed here).
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def normal(std):
  return nnx.initializers.normal(std)


def _param(rngs, init, shape, axes, dtype):
  return nnx.Param(_init(init, axes)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last dim, in fp32."""

  def __init__(self, dim: int, *, eps: float = 1e-6, axis_name: str | None = EMBED, param_dtype=F32, rngs: nnx.Rngs):
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
  freq = theta ** (-jnp.arange(0, k // 2, dtype=F32) / (k // 2))  # [K/2]
  ang = positions.astype(F32)[..., None] * freq  # [B, T, K/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]  # [B, T, 1, K/2]
  x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SwiGLU(nnx.Module):
  """W_down (silu(x W_gate) * (x W_up)); [B, T, D] -> [B, T, D]."""

  def __init__(self, d_model: int, d_ff: int, *, init_std: float, out_std: float, dtype, param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.w_gate = _param(rngs, normal(init_std), (d_model, d_ff), (EMBED, MLP), param_dtype)
    self.w_up = _param(rngs, normal(init_std), (d_model, d_ff), (EMBED, MLP), param_dtype)
    self.w_down = _param(rngs, normal(out_std), (d_ff, d_model), (MLP, EMBED), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = self.dtype
    g = constrain(x @ self.w_gate[...].astype(dt), BTF)  # [B, T, F]
    u = constrain(x @ self.w_up[...].astype(dt), BTF)  # [B, T, F]
    return (jax.nn.silu(g) * u) @ self.w_down[...].astype(dt)  # [B, T, D]


class FirstPassageAttention(nnx.Module):
  """Multi-head causal attention with a first-passage forget gate (one code path for all types).

  The gate (`fpa_jax.gates.Gate`, None for softmax / nope) turns the block input into the field and
  key levels; logits get -relu(level_j - min(field_{j+1..i})) (`ops.fpa_attention`). For `fox` the
  field is monotone and the FoX kernel computes the same penalty as a sum of log forget gates.

  Two modes, one set of projections:
    layer(x, segment_ids)                      parallel: x [B, T, D] -> [B, T, D] (the chunked kernel)
    layer(x, positions=p, cache=c, attend=f)   cached: `f(c, q, k, v, field, level, cum) -> (o, c')`
        does the attention against a cache (prefill or one decode step; `fpa_jax.inference`), the
        layer returns (y [B, T, D], c'). `c.carry` [B, KVH] is the gate's running field sum before
        x; cum [B, T, KVH] the running sum through each token.

  Grouped-query (`n_kv_heads` < `n_heads`): k, v and the gate have KVH heads; query head h reads
  kv head h // (H / KVH) inside the ops, which never repeat k / v.

  `cfg`: a ModelConfig (a run Config used on its own, as in `experiments.live_sets`, is reduced to
  its `.model`: the layer keeps no training or data fields).
  """

  def __init__(self, cfg: ModelConfig | Config, *, rngs: nnx.Rngs):
    cfg = cfg.model
    d, h, kvh, k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layers) ** 0.5
    self.wq = _param(rngs, normal(std), (d, h, k), (EMBED, HEADS, HEAD_DIM), pdt)
    self.wk = _param(rngs, normal(std), (d, kvh, k), (EMBED, HEADS, HEAD_DIM), pdt)
    self.wv = _param(rngs, normal(std), (d, kvh, k), (EMBED, HEADS, HEAD_DIM), pdt)
    self.wo = _param(rngs, normal(out_std), (h, k, d), (HEADS, HEAD_DIM, EMBED), pdt)
    # Optional parts are one assignment each (None is a static attribute in NNX).
    mk_norm = lambda: RMSNorm(k, eps=cfg.norm_eps, axis_name=HEAD_DIM, param_dtype=pdt, rngs=rngs)
    self.q_norm: RMSNorm | None = mk_norm() if cfg.qk_norm else None
    self.k_norm: RMSNorm | None = mk_norm() if cfg.qk_norm else None
    self.wg: nnx.Param | None = (
      _param(rngs, normal(std), (d, h, k), (EMBED, HEADS, HEAD_DIM), pdt) if cfg.output_gate else None
    )
    self.gate: Gate | None = Gate(cfg, rngs=rngs) if cfg.gate_terms else None

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D], positions [B, T] -> q [B, T, H, K], k, v [B, T, KVH, K] (QK-norm, RoPE applied)."""
    cfg, dt = self.cfg, self.dtype
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dt))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if cfg.use_rope:
      q, k = apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta)
    return constrain(q, BTHK), constrain(k, BTHK), constrain(v, BTHK)

  def field_level(self, x: jax.Array, carry: jax.Array | None = None):
    """x [B, T, D] -> (field, level, cum) [B, T, KVH] fp32 (`gates.field_level`); zeros without a gate."""
    if self.gate is None:
      z = jnp.zeros(x.shape[:2] + (self.cfg.kv_heads,), F32)
      return z, z, z
    return tuple(constrain(a, BTH) for a in field_level(self.gate.parts(x), carry))

  def output(self, o: jax.Array, x: jax.Array) -> jax.Array:
    """o [B, T, H, K] (attention output), x [B, T, D] (block input) -> [B, T, D]."""
    dt = self.dtype
    o = constrain(o.astype(dt), BTHK)
    if self.wg is not None:
      o = o * jax.nn.sigmoid(jnp.einsum("btd,dhk->bthk", x, self.wg[...].astype(dt)))
    return constrain(jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(dt)), BTD)

  def parallel_attention(self, op, q, k, v, gates, segment_ids):
    """op(q, k, v, *gates) with the configured impl: q [B, T, H, K], k, v [B, T, KVH, K], gates
    [B, T, KVH] each, segment_ids [B, T] or None -> [B, T, H, K].

    "pallas" under a multi-device mesh runs in `shard_local` (a shard_map): XLA cannot partition
    a pallas_call, so it would gather q, k, v to every device; the math is per (batch, head), so
    each device runs the kernel on its own batch rows and heads with no collectives. Grouped
    heads stay whole: `local_specs` splits the heads axis only where the mesh divides both H and
    KVH, and then device s holds query heads [s H/M, (s+1) H/M) and exactly the kv heads they
    read, [s KVH/M, (s+1) KVH/M); otherwise heads are replicated."""
    cfg = self.cfg
    impl = ops.validate.resolve_impl(cfg.attn_impl, cfg.kv_heads != cfg.n_heads)
    kw = dict(impl=impl, block_size=(cfg.block_size or None) if cfg.attn_impl in ops.validate.BLOCKED else None)
    if impl != "pallas":
      return op(q, k, v, *gates, segment_ids=segment_ids, **kw)
    has_seg = segment_ids is not None
    args, axes = (q, k, v, *gates), (BTHK,) * 3 + (BTH,) * len(gates)
    if has_seg:
      args, axes = args + (segment_ids,), axes + (BT,)

    def local(q, k, v, *rest):
      gates, seg = (rest[:-1], rest[-1]) if has_seg else (rest, None)
      return op(q, k, v, *gates, segment_ids=seg, **kw)

    return shard_local(local, args, axes, BTHK)

  def __call__(
    self,
    x: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    *,
    cache=None,
    attend=None,
  ):
    cfg = self.cfg
    b, t, _ = x.shape
    pos = segment_positions(segment_ids, b, t) if positions is None else positions
    q, k, v = self.project(x, pos)  # [B, T, H | KVH, K]
    if cache is not None:
      field, level, cum = self.field_level(x, cache.carry)
      o, cache = attend(cache, q, k, v, field, level, cum)
      return self.output(o, x), cache
    if self.gate is None:
      # softmax / nope: the same tiled kernel with a zero log-gate (memory-efficient, and
      # throughput comparisons then measure only the gate's cost).
      op, gates = ops.fox_attention, (jnp.zeros((b, t, cfg.kv_heads), F32),)
    elif self.gate.is_fox:
      # field == level == cumsum(log forget): the FoX kernel tiles c_i - c_j directly (cheaper,
      # mathematically identical to fpa_attention(field, field)): the honest cost baseline.
      op, gates = ops.fox_attention, (constrain(self.gate.parts(x).increment, BTH),)
    else:
      op, gates = ops.fpa_attention, tuple(constrain(a, BTH) for a in self.gate(x))
    o = self.parallel_attention(op, q, k, v, gates, segment_ids)
    return self.output(o, x)  # [B, T, D]
