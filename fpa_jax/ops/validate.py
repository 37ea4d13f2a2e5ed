"""Input checks shared by every attention op: clear errors before tracing, never silent casts.

The scalar settings (impl, block_size, skip_tolerance, skip) are checked by the same functions for
an op call and for the model fields that set them (`fpa_jax.configs.ModelConfig`: attn_impl,
block_size, skip_tolerance, skip): `name=` and friends say what the caller calls the setting, so
an error names the argument or field the user wrote."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

# Re-exported: the names are defined once in `common` (imported by chunked / pallas as well).
from fpa_jax.ops.common import BLOCKED, IMPLS, SKIPS, STATS_DTYPE, BlockSizes, Implementation, Skip

__all__ = ["BLOCKED", "IMPLS", "SKIPS", "STATS_DTYPE", "BlockSizes", "Implementation", "Skip", "GateName"]


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)  # callers check the shape first: x is an array


def check_impl(impl: Implementation, block_size: int | None = None, *, name="impl", block_name="block_size") -> None:
  """impl one of IMPLS; a block_size (None: unset) only for the tiled impls, and >= 1 if an int."""
  if impl not in IMPLS:
    raise ValueError(f"unknown {name} {impl!r}: the {name} must be one of {IMPLS}")
  if block_size is not None and impl not in BLOCKED:
    raise ValueError(
      f"{block_name} only applies to {name} in {BLOCKED}, got {name}={impl!r}: leave {block_name} unset "
      f"or use a tiled {name}"
    )
  # Checked here as well as by the impls: an empty input returns before reaching them.
  if isinstance(block_size, int) and block_size < 1:
    raise ValueError(f"{block_name} must be a positive int (block sizes are tile lengths in tokens), got {block_size}")


def resolve_impl(impl: Implementation, grouped: bool = False) -> str:
  """ "auto": the XLA-tiled "chunked" on every backend. The Pallas kernels are opt-in
  (impl="pallas") until their compiled Mosaic / Triton path has passed on an accelerator (only the
  CPU interpreter has run them; docs/ops.md, "Verifying the Pallas kernels on an accelerator"). `grouped`
  (kv_heads < heads) is kept for callers; it will matter again when auto can pick Pallas. Other
  names pass through."""
  del grouped
  return "chunked" if impl == "auto" else impl


def resolve_block_size(impl: Implementation, block_size, grouped: bool = False):
  """The block_size to hand the impl `impl` resolves to. A `pallas.BlockSizes` under "auto" where
  that picks "chunked" (today: every backend) becomes its forward block (chunked tiles its backward like its
  forward, so `bwd` has no counterpart); with impl="chunked" itself it is an error. Others pass."""
  if not isinstance(block_size, BlockSizes) or resolve_impl(impl, grouped) != "chunked":
    return block_size
  if impl != "auto":
    raise ValueError(
      f"impl={impl!r} takes an int block_size, got {block_size!r} (a BlockSizes is for "
      f"impl='pallas' / 'auto'); pass block_size={block_size.fwd}"
    )
  return block_size.fwd


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
  """q: [batch, seq, heads, head_dim]; k: [batch, seq, kv_heads, head_dim]; v: [batch, seq,
  kv_heads, v_dim]; one float dtype. kv_heads divides heads (grouped-query attention; kv_heads ==
  heads is plain multi-head). Returns (B, T, H, KVH, K)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    if not _is_float(x):
      raise ValueError(f"{name} must be a float array (fp32 or bf16), got dtype {x.dtype}")
  b, t, h, d = q.shape
  kvh = k.shape[2]
  if k.shape[:2] != (b, t) or k.shape[3] != d:
    raise ValueError(
      f"q and k must have the same shape up to heads (k: [batch, seq, kv_heads, head_dim] "
      f"with q's batch, seq, head_dim {(b, t, d)}), got {q.shape} and {k.shape}"
    )
  if kvh < 1 or h % kvh:
    raise ValueError(f"q's heads ({h}) must be a multiple of k's kv_heads ({kvh}), got q {q.shape}, k {k.shape}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"v must be [batch, seq, kv_heads, v_dim] matching k's {k.shape[:3]}, got {v.shape}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  return b, t, h, kvh, d


def is_empty(b: int, t: int) -> bool:
  """batch 0 or seq 0: every op returns its [batch, seq, heads, v_dim] output of zeros (empty)
  without running an impl (their tilings divide by the shape)."""
  return b == 0 or t == 0


def check_log_fgate(log_fgate) -> None:
  """FoX's log forget gate must be <= 0. Checked on concrete arrays only (a device sync of one
  bool); under jit the ops clamp it instead (`clamp_log_fgate`)."""
  if isinstance(log_fgate, jax.core.Tracer):
    return
  # numpy, not jnp: inside a trace (a concrete array closed over by a jitted function) a jnp
  # comparison would itself be traced and could not be turned into a bool.
  x = np.asarray(log_fgate)
  if x.size and bool(np.any(x > 0)):
    raise ValueError(
      "log_fgate must be <= 0: pass jax.nn.log_sigmoid(f) (a log forget gate in (-inf, 0]), "
      f"got a max of {float(np.max(x))}"
    )


def clamp_log_fgate(log_fgate: jax.Array) -> jax.Array:
  """fp32 log_fgate with positive entries (only reachable under jit) set to 0, a forget gate of
  1: the one definition every FoX impl then shares, with gradient 0 there (1 at exactly 0)."""
  lf = log_fgate.astype(STATS_DTYPE)
  return jnp.where(lf > 0, 0.0, lf)


def check_gate(name: str, x, bth: tuple[int, int, int]) -> None:
  """A per-token, per-kv-head scalar gate: [batch, seq, kv_heads], float."""
  if getattr(x, "shape", None) != tuple(bth):
    raise ValueError(
      f"{name} must have shape [batch, seq, kv_heads] = {tuple(bth)} (one entry per k/v "
      f"head), got {getattr(x, 'shape', None)}"
    )
  if not _is_float(x):
    raise ValueError(f"{name} must be a float array, got dtype {x.dtype}")


def check_segment_ids(segment_ids, bt: tuple[int, int]) -> None:
  if segment_ids is None:
    return
  if getattr(segment_ids, "shape", None) != tuple(bt):
    raise ValueError(
      f"segment_ids must have shape [batch, seq] = {tuple(bt)}, got {getattr(segment_ids, 'shape', None)}"
    )
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")


def default_scale(scale, head_dim: int) -> float:
  if scale is None and head_dim < 1:
    raise ValueError(f"head_dim must be at least 1 for the default scale head_dim ** -0.5, got {head_dim}")
  return head_dim**-0.5 if scale is None else float(scale)


# The tiled kernels that drop dead tiles: chunked ("auto" resolves to it) and the block-sparse
# Pallas kernels (`ops.pallas.block_sparse`).
SKIPPING = ("chunked", "pallas")

PALLAS_SKIP_GPU = (
  "impl='pallas' with skip_tolerance runs block-sparse kernels over scalar-prefetched index lists "
  "(Mosaic TPU, or the interpreter off TPU / GPU); Triton on GPU has neither: use impl='chunked' (the "
  "same tiles dropped) or skip_tolerance=None there"
)


def check_skip_tolerance(skip_tolerance, impl: str | None = None, *, name="skip_tolerance", impl_name="impl") -> None:
  """None (exact) or a Python float eps in (0, 1); with `impl` given, for the tiled kernels that skip
  dead tiles only (SKIPPING; "auto" resolves to chunked)."""
  if skip_tolerance is None:
    return
  # A Python float only: it sets a static threshold, so arrays / tracers have no meaning here.
  if not isinstance(skip_tolerance, float) or not 0.0 < skip_tolerance < 1.0:
    raise ValueError(f"{name}={skip_tolerance!r}: use None (exact) or a float in (0, 1), e.g. 1e-3")
  if impl is not None and resolve_impl(impl) not in SKIPPING:
    raise ValueError(
      f"{name} only applies to the tiled kernels ({impl_name}='chunked', 'auto' or 'pallas'), got "
      f"{impl_name}={impl!r}: set {impl_name}='chunked' or {name}=None"
    )


def check_pallas_skip(
  impl, block_size, skip_tolerance, backend="auto", *, name="skip_tolerance", block_name="block_size"
) -> None:
  """impl="pallas" with a tolerance (the block-sparse kernels): one tile size for the forward and
  backward kernels (they drop the same tiles), and a target with scalar prefetch. The target is
  `backend` (the kernels' `pallas_backend`) where one is chosen, whatever JAX runs on: "tpu" or
  "interpret" pass on a GPU host too (lowering a TPU step there), "gpu" is refused on any host;
  "auto" is JAX's backend."""
  if impl != "pallas" or skip_tolerance is None:
    return
  if isinstance(block_size, BlockSizes) and block_size.backward != block_size.fwd:
    raise ValueError(
      f"{name} drops the same tiles in the Pallas forward and backward kernels, so they take one tile "
      f"size, got {block_name}={block_size}: pass {block_name}={block_size.fwd}"
    )
  if (jax.default_backend() if backend == "auto" else backend) == "gpu":
    raise ValueError(PALLAS_SKIP_GPU)


def check_skip_name(skip, *, name="skip") -> None:
  """What skip_tolerance drops: one of SKIPS."""
  if skip not in SKIPS:
    raise ValueError(f"{name}={skip!r}: the {name} must be one of {SKIPS}")


def check_skip(
  skip, skip_tolerance, impl=None, *, name="skip", tolerance_name="skip_tolerance", impl_name="impl"
) -> None:
  """skip: "tiles" (default) or "keys" / "keys_shared" / "keys_per_head" (key-sparse, which needs a
  tolerance and the chunked kernel)."""
  check_skip_name(skip, name=name)
  if skip != "tiles" and skip_tolerance is None:
    raise ValueError(
      f"{name}={skip!r} drops keys under a tolerance: set {tolerance_name}=eps in (0, 1) (e.g. 1e-3) or {name}='tiles'"
    )
  if skip != "tiles" and impl is not None and resolve_impl(impl) == "pallas":
    raise ValueError(
      f"{name}={skip!r} (key-sparse attention) is the chunked kernel's; the Pallas kernels skip whole tiles: "
      f"set {name}='tiles' or {impl_name}='chunked'"
    )


# ------------------------------------------------------------------------------------------------
# Non-finite gate values (docs/ops.md, "Non-finite inputs")
# ------------------------------------------------------------------------------------------------

# The per-token gate arrays the ops take, by their argument names.
GateName = Literal["field", "level", "log_fgate"]

# What each gate may hold besides finite numbers, and the value a disallowed entry is replaced by
# inside the kernels (it never reaches an output: every row that could read it is NaN).
#   field  +inf: a token that lowers no key's minimum (padding, a "transparent" token). -inf is not
#          allowed: the gates make the field a running sum, where -inf is an overflow, and it would
#          kill every earlier key for good (segment_ids say "forget everything before" instead).
#   level  +inf: a dead key (weight exactly 0 once a finite field value follows it); -inf: a key
#          that is never penalised (penalty 0 for every query).
#   log_fgate  finite only: -inf (a forget gate of exactly 0) turns FoX's cumulative sum into
#          -inf - -inf for every later pair; +inf is not a log probability (finite positive
#          entries are clamped to 0 under jit, `clamp_log_fgate`).
ALLOWED: dict[str, str] = {
  "field": "finite or +inf (a token that lowers no minimum)",
  "level": "finite, +inf (a dead key) or -inf (a key never penalised)",
  "log_fgate": "finite (<= 0, e.g. jax.nn.log_sigmoid(f) of a finite f)",
}
FILL: dict[str, float] = {"field": float("inf"), "level": float("inf"), "log_fgate": 0.0}


def allowed(name: GateName, x):
  """bool array, True where the gate `name` holds an allowed value (`ALLOWED`); jnp or numpy in."""
  xp = np if isinstance(x, np.ndarray) else jnp
  if name == "field":
    return x > -xp.inf  # False for NaN and -inf
  if name == "level":
    return ~xp.isnan(x)
  return xp.isfinite(x)


def check_gate_values(
  name: GateName, x, axes: tuple[str, ...] = ("batch", "position", "kv head"), *, label: str | None = None, mask=None
) -> None:
  """ValueError if a concrete gate array holds a value `ALLOWED` does not allow, naming the argument,
  how many entries and where the first one is. Tracers pass (under jit the ops make the rows that
  read such an entry NaN: `poison_rows`). A device-to-host copy of the gate, as `check_log_fgate`.
  `axes` names x's axes in the message; `label` the argument (default `name`, whose rule applies);
  `mask` (bool, x's shape): only the True entries are checked (the filled slots of a cache)."""
  if isinstance(x, jax.core.Tracer) or isinstance(mask, jax.core.Tracer):
    return
  a = np.asarray(x).astype(np.float32)  # numpy, not jnp: see check_log_fgate
  if not a.size:
    return
  bad = ~allowed(name, a)
  if mask is not None:
    bad &= np.asarray(mask, bool)
  n = int(bad.sum())
  if not n:
    return
  counts = {"NaN": np.isnan(a), "-inf": np.isneginf(a), "+inf": np.isposinf(a)}
  found = ", ".join(f"{int((m & bad).sum())} {k}" for k, m in counts.items() if (m & bad).any())
  first = tuple(int(i) for i in np.argwhere(bad)[0])
  where = ", ".join(f"{axis} {i}" for axis, i in zip(axes, first))
  raise ValueError(
    f"{label or name} has {n} {'entry that is' if n == 1 else 'entries that are'} not allowed ({found}; the first "
    f"at {where}): {label or name} must be {ALLOWED[name]}. Find where the gate computing it overflows or divides by zero "
    f"(under jit these entries make every query row from their position on NaN)"
  )


@jax.custom_vjp
def _replace(x, bad, fill):
  return jnp.where(bad, fill, x)


def _replace_fwd(x, bad, fill):
  return _replace(x, bad, fill), bad


def _replace_bwd(bad, g):
  # The gradient w.r.t. a disallowed entry is NaN (so a gate's parameters get a NaN gradient, as a
  # NaN would give them in any differentiable computation); every other entry's passes unchanged.
  return jnp.where(bad, jnp.nan, g), None, None


_replace.defvjp(_replace_fwd, _replace_bwd)


def sanitize_gates(gates: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array]:
  """Gates {name: [B, T, KVH]} -> (the gates fp32 with disallowed entries replaced by `FILL`, the bad
  mask [B, T, KVH] bool: any gate disallowed at that token). Gradient: NaN at the replaced entries."""
  out, bad = {}, None
  for name, x in gates.items():
    x = x.astype(STATS_DTYPE)
    b = ~allowed(name, x)
    out[name] = _replace(x, b, jnp.asarray(FILL[name], STATS_DTYPE))
    bad = b if bad is None else bad | b
  return out, bad


def poison_rows(out: jax.Array, bad: jax.Array) -> jax.Array:
  """out [B, T, H, Kv] with NaN in every row (b, i, h) where the gates of kv head h // G (G = H / KVH)
  hold a disallowed entry at some position t <= i, whatever the segments; bad [B, T, KVH] bool. Those
  rows pass no cotangent back (the NaN is a constant)."""
  b, t, h, dv = out.shape
  kvh = bad.shape[-1]
  rows = jnp.cumsum(bad, axis=1, dtype=jnp.int32) > 0  # [B, T, KVH]: at or after a bad token
  o = out.reshape(b, t, kvh, h // kvh, dv)
  return jnp.where(rows[:, :, :, None, None], jnp.asarray(jnp.nan, out.dtype), o).reshape(out.shape)
