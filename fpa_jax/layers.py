"""Flax NNX building blocks: RMSNorm, RoPE, SwiGLU and the First Passage Attention layer.

Shape legend: B batch, T sequence, D d_model, H heads, KVH kv heads (k, v, gates; = H unless
grouped-query), K head_dim, F MLP hidden.
Parameters are fp32 (`param_dtype`) and cast to the compute `dtype` at use; norms, the gate and
the field are always computed in fp32. Every parameter carries logical axis names
(`fpa_jax.sharding`) so the trainer can shard it without this module knowing the mesh; activations
are pinned with `constrain(x, BTHK)` etc. (no-ops unless the caller set a mesh).

Matmul precision (`ModelConfig.precision`): the attention layer and SwiGLU run their matmuls under
`jax.default_matmul_precision(precision)` ("default": the backend's, which on TPU is bf16 passes
for fp32 operands), the attention op's hand-written backward included (`with_precision`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from fpa_jax import ops
from fpa_jax import field_checks
from fpa_jax.configs import GATE_OPTIONS, Config, ModelConfig, gate_recipe
from fpa_jax.gates import Gate, field_level
from fpa_jax.ops.budget import budgeted_attention
from fpa_jax.ops.common import F32
from fpa_jax.sharding import BT, BTD, BTF, BTH, BTHK, EMBED, HEAD_DIM, HEADS, MLP, constrain, shard_local


def _init(init, axes):
  # eager_sharding=False: annotate only; the trainer places the state (no mesh needed here).
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def normal(std):
  return nnx.initializers.normal(std)


def _param(rngs, init, shape, axes, dtype):
  return nnx.Param(_init(init, axes)(rngs.params(), shape, dtype))


def precision_scope(precision: str = "default"):
  """A context in which jnp matmuls traced inside it run at `precision` (`configs.PRECISIONS`);
  "default" adds nothing (the backend's default, the same program as without the scope)."""
  return contextlib.nullcontext() if precision == "default" else jax.default_matmul_precision(precision)


def _at_own_precision(method):
  # Decorates a module method: it traces under the module's `self.precision`. Autodiff's transposes
  # copy each matmul's precision, so this covers plain backward passes (not a custom_vjp's: with_precision).
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with precision_scope(self.precision):
      return method(self, *args, **kwargs)

  return wrapped


def with_precision(op, precision: str = "default"):
  """op(*arrays, segment_ids=None, **static) whose matmuls run at `precision` in the forward and
  the backward pass. A custom_vjp's backward (the chunked / Pallas kernels') is traced when the
  gradient is taken, outside any scope around the forward call, so the backward is pulled through
  `jax.vjp` inside a scope of its own. "default" returns `op` itself."""
  if precision == "default":
    return op

  def call(*arrays, segment_ids=None, **static):
    n = len(arrays)
    fn = lambda *a: op(*a[:n], segment_ids=a[n] if len(a) > n else None, **static)

    @jax.custom_vjp
    def run(*a):
      with precision_scope(precision):
        return fn(*a)

    def fwd(*a):
      with precision_scope(precision):
        return jax.vjp(fn, *a)  # (out, pullback): the pullback is a pytree of residuals

    def bwd(pull, ct):
      with precision_scope(precision):
        return pull(ct)

    run.defvjp(fwd, bwd)
    return run(*arrays, *(() if segment_ids is None else (segment_ids,)))

  return call


def _dtype_name(dt):
  """A dtype (jnp.bfloat16, np.dtype, "float32") as its name, for the config field; others as given."""
  try:
    return jnp.dtype(dt).name
  except TypeError:
    return dt


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

  def __init__(
    self,
    d_model: int,
    d_ff: int,
    *,
    init_std: float,
    out_std: float,
    dtype,
    param_dtype,
    precision: str = "default",
    rngs: nnx.Rngs,
  ):
    self.dtype = dtype
    self.precision = precision  # matmul precision (`precision_scope`)
    self.w_gate = _param(rngs, normal(init_std), (d_model, d_ff), (EMBED, MLP), param_dtype)
    self.w_up = _param(rngs, normal(init_std), (d_model, d_ff), (EMBED, MLP), param_dtype)
    self.w_down = _param(rngs, normal(out_std), (d_ff, d_model), (MLP, EMBED), param_dtype)

  @_at_own_precision
  def __call__(self, x: jax.Array) -> jax.Array:
    dt = self.dtype
    g = constrain(x @ self.w_gate[...].astype(dt), BTF)  # [B, T, F]
    u = constrain(x @ self.w_up[...].astype(dt), BTF)  # [B, T, F]
    return (jax.nn.silu(g) * u) @ self.w_down[...].astype(dt)  # [B, T, D]


class GateTerms(NamedTuple):
  """A layer's gate outputs for the tokens of one call, each [B, T, KVH] fp32 (zeros without a gate).

  field, level: what the penalty reads (`ops.fpa_attention`); cum: the running sum of increments
  through each token (a cache's next `carry`); increment: the per-token log forget (+ step) term
  that the FoX kernel (and, as zeros, the softmax / nope kernel) sums itself."""

  field: jax.Array
  level: jax.Array
  cum: jax.Array
  increment: jax.Array


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How a layer attends, resolved once from its config (`attention_spec`): impl, tiles, skipping,
  scale and precision. Every path reads it (the parallel forward, a prefill, a decode step), none
  re-derives them; a cache's `attend` gets it from the layer.

  kind: "fpa" (`ops.fpa_attention` on field, level), "fox" (`ops.fox_attention` on the log
    forget gate) or "none" (softmax / nope: the FoX kernel with a zero log-gate).
  impl: the ops impl, "auto" resolved (`ops.validate.resolve_impl`); block_size: the tile, None =
    the ops default (only set for a blocked impl); skip_tolerance, skip: dead tiles / keys dropped
    (both differentiable); scale: the logit scale head_dim ** -0.5; precision: matmul precision;
    pallas_backend: what impl "pallas" builds its kernels for ("auto", or "tpu" / "gpu" to lower
    them for that target on any host, `ops.pallas.lower_for`).
  """

  kind: str
  impl: str
  block_size: int | None
  skip_tolerance: float | None
  skip: str
  scale: float
  precision: str
  pallas_backend: str = "auto"

  def op_args(self, gates: GateTerms) -> tuple:
    """(op, gate arrays) of the parallel kernel for this kind."""
    if self.kind == "fpa":
      return ops.fpa_attention, (gates.field, gates.level)
    return ops.fox_attention, (gates.increment,)

  def parallel(self, q, k, v, gates: GateTerms, segment_ids=None) -> jax.Array:
    """The parallel (prefill / training) attention: q [B, T, H, K], k, v [B, T, KVH, K] -> [B, T, H, K]."""
    op, args = self.op_args(gates)
    return self.run(op, q, k, v, args, segment_ids)

  def run(self, op, q, k, v, gates, segment_ids=None) -> jax.Array:
    """op(q, k, v, *gates) with this impl, tiles, skipping and precision: gates [B, T, KVH] each,
    segment_ids [B, T] or None -> [B, T, H, K].

    "pallas" under a multi-device mesh runs in `shard_local` (a shard_map): XLA cannot partition
    a pallas_call, so it would gather q, k, v to every device; the math is per (batch, head), so
    each device runs the kernel on its own batch rows and heads with no collectives. Grouped
    heads stay whole: `local_specs` splits the heads axis only where the mesh divides both H and
    KVH, and then device s holds query heads [s H/M, (s+1) H/M) and exactly the kv heads they
    read, [s KVH/M, (s+1) KVH/M); otherwise heads are replicated."""
    kw = dict(impl=self.impl, block_size=self.block_size)
    if self.skip_tolerance is not None:  # the op raises a clear error where impl skips no tiles
      kw["skip_tolerance"] = self.skip_tolerance
    if self.skip != "tiles":  # config validation has already required a tolerance with it
      kw["skip"] = self.skip
    if self.pallas_backend != "auto":  # config validation has already required impl "pallas" with it
      kw["pallas_backend"] = self.pallas_backend
    op = with_precision(op, self.precision)
    if self.impl != "pallas":
      return op(q, k, v, *gates, segment_ids=segment_ids, **kw)
    has_seg = segment_ids is not None
    args, axes = (q, k, v, *gates), (BTHK,) * 3 + (BTH,) * len(gates)
    if has_seg:
      args, axes = args + (segment_ids,), axes + (BT,)

    def local(q, k, v, *rest):
      gates, seg = (rest[:-1], rest[-1]) if has_seg else (rest, None)
      return op(q, k, v, *gates, segment_ids=seg, **kw)

    return shard_local(local, args, axes, BTHK)


def sow_gates(layer: nnx.Module, gates: GateTerms) -> None:
  """Record (field, level) [B, T, KVH] as the layer's `nnx.Intermediate` "gates", only while an
  `nnx.capture` collects them: flax's `sow` outside a capture would add a Variable to the layer
  (its state would change under a training step), so the plain forward sows nothing."""
  if hasattr(layer, "__captures__"):  # what Module.sow itself checks for a capture in progress
    layer.sow(nnx.Intermediate, "gates", (gates.field, gates.level))


def sow_attention_inputs(layer: nnx.Module, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  """Record (q, k, v) as the layer's `nnx.Intermediate` "attention_inputs" under an `nnx.capture`
  (as `sow_gates`): q [B, T, H, K] after QK-norm and RoPE, k, v [B, T, KVH, K], what the kernel
  attends with. Studies read them (`attention_inputs`) instead of patching the layer; the utility
  target of the levels (`fpa_jax.losses`) recomputes the attention from them."""
  if hasattr(layer, "__captures__"):
    layer.sow(nnx.Intermediate, "attention_inputs", (q, k, v))


def attention_inputs(model, *args, **kwargs):
  """model(*args, **kwargs) and what each `FirstPassageAttention` in it attended with, from the same
  parallel forward pass -> (out, [(the layer's path, ((q, k, v, field, level), ...) one per call)]) in
  path order; q [B, T, H, K], k, v [B, T, KVH, K], field, level [B, T, KVH] fp32 (a scanned stack:
  a leading layer axis on each). `model`: any NNX module made of these layers."""
  out, inter = nnx.capture(model, nnx.Intermediate)(*args, **kwargs)
  flat = nnx.to_flat_state(inter)
  by_path: dict = {}
  for path, v in flat:
    if path[-1] in ("gates", "attention_inputs"):
      by_path.setdefault(path[:-1], {})[path[-1]] = v.get_value()
  found = [
    (path, tuple((*qkv, *g) for qkv, g in zip(d["attention_inputs"], d["gates"])))
    for path, d in sorted(by_path.items())
    if "attention_inputs" in d and "gates" in d
  ]
  if not found:
    raise ValueError(f"{type(model).__name__} has no FirstPassageAttention layer (nothing sowed 'attention_inputs')")
  return out, found


def with_gates(model, *args, **kwargs):
  """model(*args, **kwargs) and the gate outputs of every `FirstPassageAttention` in it, from the same
  forward pass (`nnx.capture` of what the layers sow, `sow_gates`) -> (out, (field, level)), each
  [L, B, T, KVH] fp32 with the layers in the model's order (a scanned stack's layer axis first;
  zeros for a layer without a gate). `model`: any NNX module made of these layers (`DecoderLM`,
  a model of your own); the evictability objective and the gate statistics read them
  (`fpa_jax.losses`)."""
  out, found = gates_by_layer(model, *args, **kwargs)
  stack = lambda i: jnp.concatenate([a[i] if a[i].ndim == 4 else a[i][None] for _, calls in found for a in calls])
  return out, (stack(0), stack(1))


def gates_by_layer(model, *args, **kwargs):
  """model(*args, **kwargs) and what each `FirstPassageAttention` in it sowed in that pass (`sow_gates`)
  -> (out, [(the layer's path in the model, ((field, level), ...) one pair per call)]), in path order;
  field, level [B, T, KVH] fp32 ([L, B, T, KVH] from a scanned stack). Layers may differ in KVH
  (`with_gates` stacks them, so it needs one KVH)."""
  out, inter = nnx.capture(model, nnx.Intermediate)(*args, **kwargs)
  found = sorted((path[:-1], v.get_value()) for path, v in nnx.to_flat_state(inter) if path[-1] == "gates")
  if not found:
    raise ValueError(f"{type(model).__name__} has no FirstPassageAttention layer (nothing sowed 'gates')")
  return out, found


@functools.lru_cache(maxsize=None)
def attention_spec(cfg: ModelConfig) -> AttentionSpec:
  """The `AttentionSpec` of a layer of `cfg` (a ModelConfig): the one place impl, block size,
  skipping and the scale head_dim ** -0.5 are resolved."""
  terms = cfg.gate_terms
  kind = "none" if not terms else "fox" if set(terms) <= {"forget"} else "fpa"
  return AttentionSpec(
    kind=kind,
    impl=ops.validate.resolve_impl(cfg.attn_impl, cfg.kv_heads != cfg.n_heads),
    block_size=(cfg.block_size or None) if cfg.attn_impl in ops.validate.BLOCKED else None,
    skip_tolerance=None if cfg.skip_tolerance is None else float(cfg.skip_tolerance),
    skip=cfg.skip,
    scale=cfg.head_dim**-0.5,
    precision=cfg.precision,
    pallas_backend=cfg.pallas_backend,
  )


class AttentionCache(Protocol):
  """What a layer attends against in cached mode (`FirstPassageAttention(x, positions=p, cache=c)`):
  a per-layer cache (`fpa_jax.inference.cache.CacheView`, full or evicting, for prefill or a decode
  step) or one layer's view of a shared slot pool (`fpa_jax.inference.pool.PoolView`).

  carry: [B, KVH] fp32 the gate's running sum of field increments before this call's tokens.
  attend(spec, q, k, v, gates) -> (o [B, T, H, K], the cache after these tokens): q [B, T, H, K],
    k, v [B, T, KVH, K], gates this call's `GateTerms`; a prefill runs `spec.parallel` (the layer's
    own impl and skipping), a decode step the cache's own math at `spec.scale`."""

  carry: jax.Array

  def attend(self, spec: AttentionSpec, q, k, v, gates: GateTerms) -> tuple[jax.Array, AttentionCache]: ...


class NNXDecoding(Protocol):
  """How a `FirstPassageAttention` decodes the NNX way (flax's `nnx.MultiHeadAttention` convention:
  `init_cache(input_shape)`, then calls with `decode=True`; the cache is the layer's `nnx.Cache`
  state, no cache argument). `fpa_jax.inference` provides it when it is imported
  (`register_nnx_decoding`), so that this module stays below inference in the import graph.

  init(layer, batch, max_len, dtype, policy, policy_kw) -> (state, the resolved policy): an empty
    cache of one layer for `batch` rows of up to `max_len` tokens under a per-layer policy.
  attend(state, policy, start, spec, q, k, v, gates) -> (o [B, T, H, K], state after it): the call's
    T tokens at positions start, start + 1, ... ([] int32, the same in every row); `state.carry`
    [B, KVH] is the gate's running sum before them."""

  def init(self, layer, batch: int, max_len: int, dtype, policy, policy_kw: dict): ...

  def attend(self, state, policy, start, spec: AttentionSpec, q, k, v, gates: GateTerms): ...


_NNX_DECODING: list[NNXDecoding] = []  # fpa_jax.inference's, once it is imported


def register_nnx_decoding(impl: NNXDecoding) -> None:
  """Set how layers decode the NNX way (`fpa_jax.inference.cache` calls this when it is imported)."""
  _NNX_DECODING[:] = [impl]


def _nnx_decoding() -> NNXDecoding:
  if not _NNX_DECODING:
    raise ValueError(
      "decode=True keeps a KV cache of fpa_jax.inference (its caches and policies): import fpa_jax.inference "
      "before init_cache (e.g. `from fpa_jax.inference import FPABudget`)"
    )
  return _NNX_DECODING[0]


def check_layer_inputs(x, d_model: int, segment_ids=None, positions=None) -> tuple[int, int]:
  """x [batch, seq, d_model] float; segment_ids, positions: None or int [batch, seq]. Raises
  ValueError naming the argument (shapes are static: checked while tracing too) -> (batch, seq)."""
  shape = getattr(x, "shape", None)
  if shape is None or len(shape) != 3:
    hint = " (add a batch axis: x[None])" if shape is not None and len(shape) == 2 else ""
    raise ValueError(f"x must be [batch, seq, d_model] (rank 3), got shape {shape}{hint}")
  if shape[-1] != d_model:
    raise ValueError(f"x's last axis must be d_model={d_model} (the layer's width), got shape {tuple(shape)}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a float array (the block input, not token ids), got dtype {x.dtype}")
  b, t = shape[:2]
  for name, a in (("segment_ids", segment_ids), ("positions", positions)):
    if a is None:
      continue
    if getattr(a, "shape", None) != (b, t):
      raise ValueError(
        f"{name} must be int [batch, seq] = {(b, t)} (x's first two axes), got shape {getattr(a, 'shape', None)}"
      )
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array [batch, seq], got dtype {a.dtype}")
  return b, t


class CacheByLayer(Protocol):
  """A whole model's cache, handed down unchanged to every layer (a model of your own passes its
  `cache=` argument on to each `FirstPassageAttention`; `fpa_jax.inference.graph.ByLayer`): the layer
  takes its own `AttentionCache` from it and gives back the whole cache with its part replaced.

  positions: [B, T] int32 the call's token positions (the layer's RoPE positions when the model
    passes none). part(layer) -> that layer's `AttentionCache`; put(layer, new) -> the cache after it."""

  positions: jax.Array

  def part(self, layer: FirstPassageAttention) -> AttentionCache: ...

  def put(self, layer: FirstPassageAttention, new: AttentionCache) -> CacheByLayer: ...


class FirstPassageAttention(nnx.Module):
  """Multi-head causal attention with a first-passage forget gate (one code path for all types).

  The gate (`fpa_jax.gates.Gate`, None for softmax / nope) turns the block input into the field and
  key levels; logits get -relu(level_j - min(field_{j+1..i})) (`ops.fpa_attention`). For `fox` the
  field is monotone and the FoX kernel computes the same penalty as a sum of log forget gates.

  Two modes, one set of projections:
    layer(x, segment_ids)            parallel: x [B, T, D] -> [B, T, D] (`spec.run`: the configured impl)
    layer(x, positions=p, cache=c)   cached: c is an `AttentionCache` (prefill or one decode step,
        a per-layer cache or a view of a shared slot pool; `fpa_jax.inference`); the layer computes
        q, k, v and the `GateTerms` from `c.carry` (the gate's running sum before x), calls
        `c.attend(self.spec, q, k, v, gates) -> (o, c')` and returns (y [B, T, D], c').
    layer(x, cache=m)                the same with a whole model's cache m (a `CacheByLayer`, what
        decoding hands a model of your own): the layer attends against `m.part(self)`, at
        `m.positions` unless given, and returns (y, m.put(self, c')).
  `self.spec` (`AttentionSpec`, resolved once per config) fixes impl, tiles, skipping and the scale
  for both modes: a prefill runs the same kernel as the parallel forward.

  Grouped-query (`n_kv_heads` < `n_heads`): k, v and the gate have KVH heads; query head h reads
  kv head h // (H / KVH) inside the ops, which never repeat k / v.

  `cfg.skip_tolerance` / `cfg.skip` (dead tiles or keys skipped) apply to the parallel mode and to
  a prefill; `cfg.precision` to both modes.

  Build it from a ModelConfig, or from plain arguments with `FirstPassageAttention.from_args(d_model,
  n_heads, gate=...)` (no vocabulary or depth). `cfg`: a ModelConfig (a run Config used on its own,
  as in `experiments.live_sets`, is reduced to its `.model`: the layer keeps no training or data
  fields). `out_init_std`: std of W_o's init; None -> cfg.init_std / sqrt(2 * cfg.n_layers) (GPT-2's
  depth scaling: each block adds two residual branches), which is what `DecoderLM` uses.
  """

  def __init__(self, cfg: ModelConfig | Config, *, out_init_std: float | None = None, layer: int = 0, rngs: nnx.Rngs):
    cfg = cfg.model.validate()  # a layer built on its own (not via DecoderLM) is checked too
    d, h, kvh, k = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    self.precision = cfg.precision
    std = cfg.init_std
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if out_init_std is None else float(out_init_std)
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
    self.gate: Gate | None = Gate(cfg, layer=layer, rngs=rngs) if cfg.gate_terms else None
    # Flax's decode convention (`init_cache`, `decode=True`): the cache lives here once made.
    self.decode = False
    self.cache_state: nnx.Cache | None = nnx.data(None)  # the layer's cache (an inference.cache.LayerCache)
    self.cache_index: nnx.Cache | None = nnx.data(None)  # [] int32 the next token's position
    self.cache_policy = None  # the resolved per-layer policy (static)

  @classmethod
  def from_args(
    cls,
    d_model: int,
    n_heads: int,
    *,
    n_kv_heads: int | None = None,
    gate: str = "fpa",
    qk_norm: bool = False,
    output_gate: bool = False,
    rope: bool | None = None,
    rope_theta: float = 10000.0,
    attn_impl: str = "auto",
    block_size: int | None = None,
    skip_tolerance: float | None = None,
    skip: str = "tiles",
    precision: str = "default",
    init_std: float = 0.02,
    out_init_std: float | None = None,
    norm_eps: float = 1e-6,
    dtype="float32",
    param_dtype="float32",
    recipe: str | None = None,
    rngs: nnx.Rngs,
    **gate_options,
  ) -> FirstPassageAttention:
    """The layer from plain arguments, for a model of your own: x [B, T, d_model] -> [B, T, d_model].

    d_model, n_heads: model width and query heads (n_heads divides d_model; head_dim = d_model /
      n_heads). n_kv_heads: k / v / gate heads (grouped-query; divides n_heads), None (or 0) = n_heads.
    gate: "fpa" (first passage: field, levels), "stack" (levels = field), "fox" (FoX's forget
      gate), "softmax" (no gate, RoPE) or "nope" (no gate, no RoPE).
    qk_norm, output_gate: FoX "Pro"'s per-head RMSNorm on q, k and sigmoid output gate.
    rope: None = RoPE for softmax only (the gates give position); rope_theta its base.
    attn_impl, block_size: the ops impl ("auto", "chunked", "pallas", "quadratic", "recurrent")
      and tile size (None or 0 = the ops default). skip_tolerance: None (exact) or eps in (0, 1),
      chunked or pallas: each row loses at most eps of its attention (`fpa_jax.ops.chunked`); skip:
      "tiles" drops whole tiles, "keys" (or "keys_shared" / "keys_per_head") single keys per query
      block (chunked only, `ops.sparse`).
    precision: matmul precision, "default" | "high" | "highest" (`configs.PRECISIONS`).
    init_std: std of the q, k, v (and output-gate) projections' init; out_init_std that of W_o
      (None = init_std; for a stack of L blocks init_std / sqrt(2 L) is GPT-2's depth scaling).
    dtype, param_dtype: compute and parameter dtypes, float32 or bfloat16.
    recipe: None (the ModelConfig defaults: the single-head studies' gate) or a gate recipe of
      `configs.GATE_RECIPES`: "lm", the recommended language-model gate (`configs.LM_DEFAULT`: FoX's
      forget term at bias 5 plus read-outs at scale 1 started at 0, on every kv head), or
      "single_head". Its optimizer half (the read-outs' clipping and lr ramp) is
      `fpa_jax.optim.gate_optimizer(tx, recipe=...)`.
    gate_options: the gate's parameterisation and init, as the ModelConfig fields of that name
      (step_scale, step_init_std, offset_scale, gate_forget, fox_heads, ...; `configs.GATE_OPTIONS`);
      they override the recipe's.

    Equals `FirstPassageAttention(ModelConfig(...same fields...), out_init_std=..., rngs=...)`:
    the same parameters for the same `rngs`. Raises ValueError naming the argument to change.
    """
    bad = sorted(set(gate_options) - set(GATE_OPTIONS))
    if bad:
      train = sorted(set(bad) & set(gate_recipe("lm", "train")))
      hint = (
        f" ({train} are the optimizer's: fpa_jax.optim.gate_optimizer; recipe='lm' sets the gate's)" if train else ""
      )
      raise ValueError(f"unknown argument(s) {bad}{hint}; the gate options are {GATE_OPTIONS}")
    if recipe is not None:
      gate_options = {**gate_recipe(recipe, "model"), **gate_options}
    if out_init_std is not None:
      field_checks.real(0, why="std of W_o's init; None = init_std")("out_init_std", out_init_std)
    cfg = ModelConfig(
      d_model=d_model,
      n_layers=1,  # unused by the layer (its only use, W_o's init, is out_init_std here)
      n_heads=n_heads,
      n_kv_heads=0 if n_kv_heads is None else n_kv_heads,
      attention=gate,
      attn_impl=attn_impl,
      block_size=0 if block_size is None else block_size,
      skip_tolerance=skip_tolerance,
      skip=skip,
      precision=precision,
      rope=rope,
      rope_theta=rope_theta,
      qk_norm=qk_norm,
      output_gate=output_gate,
      norm_eps=norm_eps,
      init_std=init_std,
      dtype=_dtype_name(dtype),
      param_dtype=_dtype_name(param_dtype),
      **gate_options,
    )
    # the fields' own checks, each error naming the argument (`gate` sets the field `attention`)
    cfg.validate(arg_names={"attention": "gate"})
    return cls(cfg, out_init_std=init_std if out_init_std is None else out_init_std, rngs=rngs)

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

  def gate_field_level(self, x: jax.Array, carry: jax.Array | None = None):
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

  @property
  def spec(self) -> AttentionSpec:
    """How this layer attends (impl, tiles, skipping, scale, precision): `attention_spec(self.cfg)`."""
    return attention_spec(self.cfg)

  def gate_arrays(self, x: jax.Array, carry: jax.Array | None = None, segment_ids=None) -> GateTerms:
    """x [B, T, D] -> `GateTerms` [B, T, KVH] fp32 each; carry [B, KVH] the running sum before x
    (None = 0, a fresh sequence); segment_ids [B, T] or None (a leaky walk restarts per document).
    Zeros without a gate."""
    if self.gate is None:
      z = jnp.zeros(x.shape[:2] + (self.cfg.kv_heads,), F32)
      return GateTerms(z, z, z, z)
    parts = self.gate.parts(x)
    field, level, cum = field_level(parts, carry, segment_ids)
    return GateTerms(*(constrain(a, BTH) for a in (field, level, cum, parts.increment)))

  def init_cache(self, input_shape, dtype=None, *, policy="full", **policy_kw) -> None:
    """Flax's decode convention (`nnx.MultiHeadAttention.init_cache`): make the KV cache that calls
    with `decode=True` attend against, kept in this layer's `nnx.Cache` state (`cache_state`, and
    `cache_index`, the next position), so a model's `__call__` threads no cache argument.

    input_shape: (batch, max_len, ...) as flax's: the rows, and the most tokens a row will hold (the
      N of the `fpa` tolerance bound; what a float budget is a fraction of).
    dtype: k and v's dtype (default the layer's compute dtype).
    policy, policy_kw: a per-layer cache policy of `fpa_jax.inference` (`FPABudget(budget=0.25)`, or
      a name with its keywords; default "full"). fpa_global shares one slot pool across layers, so
      it needs the threaded form (`fpa_jax.inference.generate`, `Decoder`): ValueError, as for a
      policy that cannot decode token by token (snapkv).
    Then `layer(x, decode=True)`: x [B, T, D] -> [B, T, D], the T tokens after those before (T = 1:
    a decode step; T > 1 a chunk, `inference.cache.prefill_chunk`: a prompt at once)."""
    if len(input_shape) < 2:
      raise ValueError(f"input_shape must be (batch, max_len, ...), got {tuple(input_shape)}")
    b, n = int(input_shape[0]), int(input_shape[1])
    dt = self.dtype if dtype is None else jnp.dtype(dtype)
    state, pol = _nnx_decoding().init(self, b, n, dt, policy, policy_kw)
    self.cache_state = nnx.Cache(state)
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
    self.cache_policy = pol

  def _decode_call(self, x, positions, b: int, t: int):
    """`decode=True`: x's T tokens against the layer's own cache (`init_cache`) -> y [B, T, D]."""
    if self.cache_state is None:
      raise ValueError(
        "decode=True needs the layer's cache: call init_cache(input_shape) first (as with nnx.MultiHeadAttention)"
      )
    state = self.cache_state.get_value()
    if state.carry.shape[0] != b:
      raise ValueError(f"the cache was made for {state.carry.shape[0]} rows (init_cache), x has {b}")
    start = self.cache_index[...]
    pos = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if positions is None else positions
    q, k, v = self.project(x, pos)
    g = self.gate_arrays(x, state.carry)
    o, state = _nnx_decoding().attend(state, self.cache_policy, start, self.spec, q, k, v, g)
    self.cache_state.set_value(state)
    self.cache_index[...] = start + t
    return self.output(o, x)

  def parallel_attention(self, op, q, k, v, gates, segment_ids):
    """op(q, k, v, *gates) with the layer's impl (`AttentionSpec.run`): q [B, T, H, K], k, v
    [B, T, KVH, K], gates [B, T, KVH] each, segment_ids [B, T] or None -> [B, T, H, K]. The
    parallel forward's one call of the kernel (studies record its inputs here)."""
    return self.spec.run(op, q, k, v, gates, segment_ids)

  @_at_own_precision
  def __call__(
    self,
    x: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    *,
    cache: AttentionCache | CacheByLayer | None = None,
    cut=None,
    decode: bool | None = None,
    mask=None,
    is_causal: bool = True,
  ):
    """Parallel: x [B, T, D] -> y [B, T, D]. Under `nnx.capture(..., nnx.Intermediate)` the layer
    sows `gates` = (field, level), the gate outputs the attention used, each [B, T, KVH] fp32
    (zeros without a gate), from the same forward pass (`sow_gates`; `with_gates`,
    `fpa_jax.losses`). cut=(capacity, recent[, soft[, shared]]), the training cut: attend only over the
    keys an `fpa_budget` cache of `capacity` keys would hold (shared: one of capacity * KVH keys for
    the layer's kv heads; `ops.budget.budgeted_attention`, quadratic
    whatever `attn_impl` says; training with budget in the loop). Cached mode (`cache`, an
    `AttentionCache` or a whole model's `CacheByLayer`): -> (y, the cache after x); see the class
    docstring. decode (None: `self.decode`): flax's convention, the layer's own cache
    (`init_cache`) -> y. mask, is_causal: `nnx.MultiHeadAttention`'s call arguments, accepted so a
    model written for it calls this layer unchanged: the layer is causal by construction, so only
    mask=None with is_causal=True (or in decode mode, either) is taken (padding and packing:
    segment_ids)."""
    cfg, spec = self.cfg, self.spec
    b, t = check_layer_inputs(x, cfg.d_model, segment_ids, positions)
    decode = self.decode if decode is None else decode
    if mask is not None:
      raise ValueError(
        "FirstPassageAttention takes no mask: it is causal by construction (call it with is_causal=True or no "
        "mask); padded or packed rows go through segment_ids"
      )
    if not (is_causal or decode):
      raise ValueError("FirstPassageAttention is causal attention: is_causal=False has no meaning here (drop it)")
    if decode:
      if cache is not None or cut is not None or segment_ids is not None:
        raise ValueError(
          "decode=True attends against the layer's own cache (init_cache): pass no cache=, cut= or segment_ids "
          "with it (the threaded form: cache=, without decode)"
        )
      return self._decode_call(x, positions, b, t)
    whole = None
    if cache is not None and not hasattr(cache, "attend"):  # a whole model's cache: this layer's part of it
      whole, cache = cache, cache.part(self)
      positions = whole.positions if positions is None else positions
    pos = segment_positions(segment_ids, b, t) if positions is None else positions
    q, k, v = self.project(x, pos)  # [B, T, H | KVH, K]
    g = self.gate_arrays(x, None if cache is None else cache.carry, segment_ids)
    sow_gates(self, g)
    sow_attention_inputs(self, q, k, v)
    if cache is not None:
      o, cache = cache.attend(spec, q, k, v, g)
      return self.output(o, x), (cache if whole is None else whole.put(self, cache))
    if cut is not None:
      if self.gate is None:
        raise ValueError(f"cut= (budget in the loop) needs a gated attention (fpa, fox, stack), not {cfg.attention!r}")
      # FoX too: field = level = its cumulative log forget
      cap, recent, *rest = cut  # (cap, recent[, soft[, shared]])
      soft = rest[0] if rest else 0.0
      shared = rest[1] if len(rest) > 1 else False
      through_cut = lambda: budgeted_attention(  # noqa: E731
        q, k, v, g.field, g.level, capacity=cap, recent=recent, segment_ids=segment_ids, soft=soft, shared=shared
      )
      # The step's capacity is traced (drawn per step): the quadratic cut path runs only where it
      # evicts; a cache of the whole row is the layer's own kernel (the same attention, at its cost).
      op, args = spec.op_args(g)
      o = jax.lax.cond(
        jnp.asarray(cap) < t, through_cut, lambda: self.parallel_attention(op, q, k, v, args, segment_ids)
      )
    else:
      # softmax / nope run the same tiled kernel as FoX with a zero log-gate (memory-efficient, and
      # throughput comparisons then measure only the gate's cost); FoX's field == level ==
      # cumsum(log forget), which its kernel tiles as c_i - c_j (cheaper, mathematically identical
      # to fpa_attention(field, field)): the honest cost baseline.
      op, args = spec.op_args(g)
      o = self.parallel_attention(op, q, k, v, args, segment_ids)
    return self.output(o, x)  # [B, T, D]
