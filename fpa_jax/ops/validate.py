"""Input checks shared by every attention op: clear errors before tracing, never silent casts."""

from __future__ import annotations

from typing import Literal, get_args

import jax.numpy as jnp

# The one definition of the implementation names (typed as `jax.nn.dot_product_attention` types
# its `implementation`); IMPLS is derived from it for runtime checks and listings.
Implementation = Literal["quadratic", "chunked", "recurrent"]
IMPLS: tuple[str, ...] = get_args(Implementation)

# Field, levels, penalties and softmax statistics are always fp32, whatever q/k/v are.
STATS_DTYPE = jnp.float32


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)  # callers check the shape first: x is an array


def check_impl(impl: Implementation, block_size: int | None = None) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if block_size is not None and impl != "chunked":
    raise ValueError(f"block_size only applies to impl='chunked', got impl={impl!r}")


def check_qkv(q, k, v) -> tuple[int, int, int, int]:
  """q, k, v: [batch, seq, heads, head_dim] of one float dtype. Returns (B, T, H, D)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
          f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    if not _is_float(x):
      raise ValueError(f"{name} must be a float array (fp32 or bf16), got dtype {x.dtype}")
  if q.shape != k.shape:
    raise ValueError(f"q and k must have the same shape, got {q.shape} and {k.shape}")
  if v.shape[:3] != q.shape[:3]:
    raise ValueError(f"v must be [batch, seq, heads, v_dim] matching q's {q.shape[:3]}, got {v.shape}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, h, d = q.shape
  if t == 0:
    raise ValueError("seq must be at least 1")
  return b, t, h, d


def check_gate(name: str, x, bth: tuple[int, int, int]) -> None:
  """A per-token, per-head scalar gate: [batch, seq, heads], float."""
  if getattr(x, "shape", None) != tuple(bth):
    raise ValueError(f"{name} must have shape [batch, seq, heads] = {tuple(bth)}, got {getattr(x, 'shape', None)}")
  if not _is_float(x):
    raise ValueError(f"{name} must be a float array, got dtype {x.dtype}")


def check_segment_ids(segment_ids, bt: tuple[int, int]) -> None:
  if segment_ids is None:
    return
  if getattr(segment_ids, "shape", None) != tuple(bt):
    raise ValueError(f"segment_ids must have shape [batch, seq] = {tuple(bt)}, got {getattr(segment_ids, 'shape', None)}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")


def default_scale(scale, head_dim: int) -> float:
  return head_dim ** -0.5 if scale is None else float(scale)
