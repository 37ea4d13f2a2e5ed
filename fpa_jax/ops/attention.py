"""Public entry points: First Passage Attention, Forgetting Attention (FoX), causal softmax.

All take the layout of `jax.nn.dot_product_attention`: q is [batch, seq, heads, head_dim], k / v
are [batch, seq, kv_heads, head_dim] with kv_heads dividing heads (grouped-query attention; MQA
is kv_heads = 1; kv_heads = heads is plain multi-head); per-token gates are [batch, seq, kv_heads];
segment_ids are [batch, seq]. Query head h reads kv head h // (heads / kv_heads), as
`jnp.repeat(k, heads // kv_heads, axis=2)` would give, but k / v are never repeated: q is viewed
as [batch, seq, kv_heads, group, head_dim] and contracted per kv head.

Why gates per kv head (not per query head): FPA's penalty is a property of a key, relu(level_j -
min field), so one gate per kv head means one penalty per (key, kv head). The decode cache then
evicts a slot for the whole group at once (a slot is k, v, level, run_min of one kv head; per
query-head gates would keep it alive while any of the G heads wants it), and the chunked / Pallas
tile bias is computed once per kv head and shared by its G query heads. One convention only:
gates have kv_heads entries, which is heads when not grouped, so ungrouped calls are unchanged.

Edge cases, the same in every impl (tests/ops/test_edges.py):
  * level_j = +inf: key j is dead (penalty +inf, weight exactly 0) for every query i after it
    with a finite field value in (j, i]; on its own diagonal (empty range) its penalty is 0, so a
    row whose other keys are all dead attends to itself alone. Values and gradients stay finite;
    the gradient w.r.t. a dead key's level is 0. (The penalty is `first_passage.dip`: level - min
    field where level > min field, else 0, which is relu of the difference wherever that is
    defined.)
  * level_j = -inf: key j is never penalised (penalty 0 for every query; level gradient 0).
  * field_t = +inf: token t lowers no key's minimum (as padding; field gradient 0 there).
  * batch 0 or seq 0: the empty [batch, seq, heads, v_dim] output (and empty gradients).
  * log_fgate > 0 (FoX): ValueError on concrete arrays; under jit clamped to 0 (`fox_attention`).
  * values that are not allowed (`validate.ALLOWED`): NaN anywhere, a field of -inf, a log_fgate
    of +-inf (tests/ops/test_no_silent_wrongs.py). A concrete array raises ValueError naming the
    argument, the count and the first position. Under jit (values unknown) the output is NaN in
    exactly the query rows (b, i, h) with a bad entry of kv head h // G at a position t <= i of row
    b, whatever the segments, and every other row is what the finite inputs give (those rows never
    read the entry: it is replaced before any impl runs); the gradient is NaN at the bad entries
    and as for finite inputs elsewhere (the NaN rows pass no cotangent back). docs/ops.md,
    "Non-finite inputs", says why these values and not others.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fpa_jax.ops import bias as _bias
from fpa_jax.ops import chunked as _chunked
from fpa_jax.ops import pallas as _pallas
from fpa_jax.ops import sparse as _sparse
from fpa_jax.ops import validate as _v
from fpa_jax.ops.pallas import common as _pallas_common
from fpa_jax.ops.penalty import penalty_matrix
from fpa_jax.ops.quadratic import masked_softmax_attention
from fpa_jax.ops.recurrent import recurrent_attention

Implementation = _v.Implementation  # Literal["quadratic", "chunked", "recurrent", "pallas", "auto"]
IMPLS = _v.IMPLS  # the same names as a tuple (typing.get_args(Implementation))
Skip = _v.Skip  # Literal["tiles", "keys", "keys_shared", "keys_per_head"]: what skip_tolerance drops
PallasBackend = _pallas.Backend  # Literal["auto", "interpret", "tpu", "gpu"]: what impl="pallas" builds
# skip -> `sparse.key_sparse_attention`'s reads
_READS = {"keys": "auto", "keys_shared": "shared", "keys_per_head": "per_head"}


def _bht(x: jax.Array) -> jax.Array:  # [B, T, H] -> [B, H, T] fp32
  return jnp.swapaxes(x, 1, 2).astype(_v.STATS_DTYPE)


def fpa_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  field: jax.Array,
  level: jax.Array,
  *,
  impl: Implementation = "chunked",
  scale: float | None = None,
  segment_ids: jax.Array | None = None,
  block_size: int | None = None,
  skip_tolerance: float | None = None,
  skip: Skip = "tiles",
  pallas_backend: PallasBackend = "auto",
) -> jax.Array:
  """First Passage Attention.

      out_i = sum_j softmax_j(scale * q_i.k_j - relu(level_j - min(field_{j+1..i}))) v_j,  j <= i

  Args:
    q: [batch, seq, heads, head_dim]; k: [batch, seq, kv_heads, head_dim]; v: [batch, seq,
      kv_heads, v_dim]; one dtype, fp32 or bf16; kv_heads divides heads (see the module docstring).
    field: [batch, seq, kv_heads] field value phi_t of each token.
    level: [batch, seq, kv_heads] level l_j of each key.
    impl: "quadratic" (materialised T x T reference), "chunked" (flash-style tiling, O(T * block)
      memory in forward and backward), "recurrent" (scan with a KV cache and first-passage
      state, the decode formulation), "pallas" (the chunked tiling as Pallas kernels, see
      `fpa_jax.ops.pallas`; interpret mode off TPU / GPU), or "auto" ("chunked" on every backend:
      the Pallas kernels are opt-in until their compiled path has passed on an accelerator;
      `ops.validate.resolve_impl`). All exact and differentiable.
    scale: logit scale, default head_dim ** -0.5.
    segment_ids: optional [batch, seq] int; tokens attend only inside their own segment.
    block_size: chunked / pallas / auto only; query/key tile size (default `chunked.DEFAULT_BLOCK`,
      or `pallas.BlockSizes.default` of the backend; pallas and auto also take a `BlockSizes`,
      of which auto (chunked) uses `fwd`).
    skip_tolerance: None (exact, the default) or a float eps in (0, 1); "chunked" / "auto" or
      "pallas" (other impls raise ValueError). Drops the tiles whose every weight is provably
      <= eps / seq (bound in `fpa_jax.ops.chunked`), forward and backward: each row loses total
      weight <= eps, each output component moves by <= 2 eps max|v|. "pallas" then runs the
      block-sparse kernels (`fpa_jax.ops.pallas.block_sparse`: the same tiles dropped, never read;
      one tile size for both passes; TPU or the interpreter, ValueError on GPU).
    skip: what skip_tolerance drops: "tiles" (the default above) or "keys": per query block, each
      key whose weights the bound puts below eps / seq, the live keys gathered into dense chunks
      (`fpa_jax.ops.sparse`; the same guarantee per row, forward and backward, gradients within
      the bound stated there). It turns a head that keeps a sparse set of keys alive into fewer
      reads where no tile is wholly dead. "keys" schedules the chunks per query block
      automatically; "keys_shared" / "keys_per_head" force one loop for every (batch row, kv
      head) / each (row, kv head) its own chunks.
    pallas_backend: impl="pallas" only: what the kernels are built for (`pallas.pallas_attention`'s
      backend): "auto" (JAX's backend, the interpreter off TPU / GPU), "interpret", or "tpu" / "gpu"
      on any backend, to lower them through `jax.export` without the hardware
      (`pallas.lower_for`; docs/ops.md, "Lowering without the hardware").
  Returns:
    [batch, seq, heads, v_dim] in q's dtype. Field, levels, penalties and softmax statistics are fp32.
    Infinite gates, disallowed values (NaN, a field of -inf: ValueError where concrete, NaN rows from
    the bad token on under jit) and empty inputs: see the module docstring.
  """
  _v.check_impl(impl, block_size)
  b, t, h, kvh, d = _v.check_qkv(q, k, v)
  block_size = _v.resolve_block_size(impl, block_size, kvh != h)
  _v.check_gate("field", field, (b, t, kvh))
  _v.check_gate("level", level, (b, t, kvh))
  _v.check_segment_ids(segment_ids, (b, t))
  _v.check_gate_values("field", field)
  _v.check_gate_values("level", level)
  scale = _v.default_scale(scale, d)
  impl = _v.resolve_impl(impl, kvh != h)
  _v.check_skip_tolerance(skip_tolerance, impl)
  _v.check_skip(skip, skip_tolerance, impl)
  _v.check_pallas_skip(impl, block_size, skip_tolerance, pallas_backend)
  _check_pallas_backend(pallas_backend, impl, skip_tolerance)
  if _v.is_empty(b, t):
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  return _fpa_core(
    q,
    k,
    v,
    field,
    level,
    segment_ids,
    impl=impl,
    scale=scale,
    block_size=block_size,
    skip_tolerance=skip_tolerance,
    skip=skip,
    pallas_backend=pallas_backend,
  )


def _check_pallas_backend(pallas_backend, impl, skip_tolerance) -> None:
  """pallas_backend one of `pallas.BACKENDS`, set only where impl (resolved) is "pallas"; "gpu" has no
  block-sparse kernels (Triton has no scalar prefetch), so not with a skip_tolerance."""
  _pallas_common.check_backend(pallas_backend, name="pallas_backend")
  if pallas_backend != "auto" and impl != "pallas":
    raise ValueError(
      f"pallas_backend={pallas_backend!r} only applies to impl='pallas', which impl={impl!r} does not run: "
      f"set impl='pallas' or leave pallas_backend='auto'"
    )
  if pallas_backend == "gpu" and skip_tolerance is not None:
    raise ValueError(_v.PALLAS_SKIP_GPU)


# The computation after validation, one jitted program per (impl, scale, tiles, tolerance, shapes):
# an eager call (a notebook, a test) compiles the kernel once instead of dispatching it op by op;
# under an outer jit it is inlined. Disallowed gate values (only reachable here under jit) are
# replaced before any impl sees them and their rows made NaN after it (`validate.poison_rows`), so
# every impl gives the same result for them.
_STATIC = ("impl", "scale", "block_size", "skip_tolerance", "skip", "pallas_backend")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _fpa_core(
  q, k, v, field, level, segment_ids, *, impl, scale, block_size, skip_tolerance, skip="tiles", pallas_backend="auto"
):
  gates, bad = _v.sanitize_gates({"field": field, "level": level})
  bias = _bias.FPABias(gates["field"], gates["level"])
  out = _attend(
    q,
    k,
    v,
    bias,
    segment_ids,
    impl=impl,
    scale=scale,
    block_size=block_size,
    skip_tolerance=skip_tolerance,
    skip=skip,
    pallas_backend=pallas_backend,
  )
  return _v.poison_rows(out, bad)


def _attend(q, k, v, bias, segment_ids, *, impl, scale, block_size, skip_tolerance, skip, pallas_backend="auto"):
  """The one dispatch into attention for FPA and FoX, after validation: `bias` an `ops.bias.FPABias`
  or `FoXBias`. The tiled kernels read the bias protocol; quadratic and recurrent take field and
  level, FoX's as the FPA special case field = level = c (exact for a monotone c)."""
  if impl == "pallas":
    return _pallas.pallas_attention(
      q,
      k,
      v,
      bias,
      scale=scale,
      segment_ids=segment_ids,
      block_sizes=block_size,
      skip_tolerance=skip_tolerance,
      backend=pallas_backend,
    )
  if impl in ("quadratic", "recurrent"):
    field, level = (bias.field, bias.level) if isinstance(bias, _bias.FPABias) else (bias.c, bias.c)
    if impl == "quadratic":
      return masked_softmax_attention(
        q, k, v, -penalty_matrix(_bht(field), _bht(level)), scale=scale, segment_ids=segment_ids
      )
    return recurrent_attention(
      q, k, v, field.astype(_v.STATS_DTYPE), level.astype(_v.STATS_DTYPE), scale=scale, segment_ids=segment_ids
    )
  if skip in _READS:
    return _sparse.key_sparse_attention(
      q,
      k,
      v,
      bias,
      scale=scale,
      segment_ids=segment_ids,
      block_size=block_size,
      skip_tolerance=skip_tolerance,
      reads=_READS[skip],
    )
  return _chunked.chunked_attention(
    q, k, v, bias, scale=scale, segment_ids=segment_ids, block_size=block_size, skip_tolerance=skip_tolerance
  )


def fox_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_fgate: jax.Array,
  *,
  impl: Implementation = "chunked",
  scale: float | None = None,
  segment_ids: jax.Array | None = None,
  block_size: int | None = None,
  skip_tolerance: float | None = None,
  skip: Skip = "tiles",
  pallas_backend: PallasBackend = "auto",
) -> jax.Array:
  """Forgetting Attention (FoX): logit_ij = scale * q_i.k_j + sum_{s=j+1..i} log_fgate_s.

  `quadratic` and `recurrent` go through the exact FPA special case field = level =
  cumsum(log_fgate) (monotone, so the first-passage penalty equals the summed decay). `chunked`
  tiles FoX's own cumsum-difference bias c_i - c_j: the cost baseline FPA is benchmarked against.

  Args:
    log_fgate: [batch, seq, kv_heads] log forget gate, <= 0 (e.g. jax.nn.log_sigmoid(...)). A
      concrete array with a positive entry raises ValueError; under jit (a tracer) positive
      entries are clamped to 0 (forget gate 1, gradient 0 there) before any impl sees them, so
      every impl computes the same, defined result. Non-finite entries (NaN, +-inf): ValueError
      where concrete; under jit NaN rows from the bad token on, as in `fpa_attention`.
    skip_tolerance, skip: as in `fpa_attention` (chunked, or pallas for skip="tiles"); the tile floor is min_J c - max_I c,
      a key's floor for query block I is c_j - max_I c.
    pallas_backend: as in `fpa_attention`.
    Others as in `fpa_attention`.
  """
  _v.check_impl(impl, block_size)
  b, t, h, kvh, d = _v.check_qkv(q, k, v)
  block_size = _v.resolve_block_size(impl, block_size, kvh != h)
  _v.check_gate("log_fgate", log_fgate, (b, t, kvh))
  _v.check_segment_ids(segment_ids, (b, t))
  impl = _v.resolve_impl(impl, kvh != h)
  _v.check_skip_tolerance(skip_tolerance, impl)
  _v.check_skip(skip, skip_tolerance, impl)
  _v.check_pallas_skip(impl, block_size, skip_tolerance, pallas_backend)
  _v.check_gate_values("log_fgate", log_fgate)
  _v.check_log_fgate(log_fgate)
  _check_pallas_backend(pallas_backend, impl, skip_tolerance)
  if _v.is_empty(b, t):
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  scale = _v.default_scale(scale, d)
  return _fox_core(
    q,
    k,
    v,
    log_fgate,
    segment_ids,
    impl=impl,
    scale=scale,
    block_size=block_size,
    skip_tolerance=skip_tolerance,
    skip=skip,
    pallas_backend=pallas_backend,
  )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _fox_core(
  q, k, v, log_fgate, segment_ids, *, impl, scale, block_size, skip_tolerance, skip="tiles", pallas_backend="auto"
):
  # The one place all impls share: chunked / pallas tile c_i - c_j, the others the FPA special
  # case, which agree only for a monotone c. Non-finite entries: as in `_fpa_core`.
  gates, bad = _v.sanitize_gates({"log_fgate": log_fgate})
  c = jnp.cumsum(_v.clamp_log_fgate(gates["log_fgate"]), axis=1)
  out = _attend(
    q,
    k,
    v,
    _bias.FoXBias(c),
    segment_ids,
    impl=impl,
    scale=scale,
    block_size=block_size,
    skip_tolerance=skip_tolerance,
    skip=skip,
    pallas_backend=pallas_backend,
  )
  return _v.poison_rows(out, bad)


def softmax_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None, segment_ids: jax.Array | None = None
) -> jax.Array:
  """Plain causal softmax attention (quadratic reference). q: [B, T, H, K], k: [B, T, KVH, K],
  v: [B, T, KVH, Kv] -> [B, T, H, Kv]."""
  b, t, h, kvh, d = _v.check_qkv(q, k, v)
  _v.check_segment_ids(segment_ids, (b, t))
  if _v.is_empty(b, t):
    return jnp.zeros((b, t, h, v.shape[-1]), q.dtype)
  bias = jnp.zeros((b, kvh, t, t), _v.STATS_DTYPE)
  return masked_softmax_attention(q, k, v, bias, scale=_v.default_scale(scale, d), segment_ids=segment_ids)
