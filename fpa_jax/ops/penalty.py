"""The first-passage penalty: the deepest dip of the field below a key's level on (j, i].

penalty[i, j] = max(0, level_j - min(field_{j+1}, ..., field_i)),  j <= i
                0 on the diagonal (empty range), +inf above it (j > i, not causal).

max(0, level - min) is evaluated as `first_passage.dip` (level - min where level > min, else 0), which
also defines it for infinite values: a key with level_j = +inf has penalty 0 on its diagonal and
+inf (it is dead, weight exactly 0) as soon as a finite field value lies in (j, i]; the gradient
w.r.t. its level is 0 everywhere. Every impl of `fpa_jax.ops` follows this definition.

This is the associative-scan form of the all-pairs running min (`ops.first_passage` lists the
other two, the tile identity and the sparse table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fpa_jax.ops import validate as _v
from fpa_jax.ops.common import STATS_DTYPE
from fpa_jax.ops.first_passage import dip


def _min_level_monoid(a, b):
  # (running min of the field, level) pairs combine componentwise by (min, max): a column
  # "starts" on the diagonal, where its level replaces -inf, and the field entries at or above
  # the diagonal are +inf, so the pair after the scan at row i is (min over (j, i], level_j).
  return jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])


def first_passage_penalty(field: jax.Array, level: jax.Array) -> jax.Array:
  """Penalty matrix for causal first-passage attention.

  Args:
    field: [..., T] field value phi_t per token.
    level: [..., T] level l_j per key.
  Returns:
    [..., T, T] fp32, penalty[..., i, j] (query i, key j) >= 0 for j <= i, +inf for j > i.
    Disallowed values (`validate.ALLOWED`: a NaN, a field of -inf) raise ValueError where concrete;
    under jit every row i at or after the first one is NaN, as the attention ops' rows.
  """
  if field.shape != level.shape:
    raise ValueError(f"field and level must have the same shape [..., T], got {field.shape} and {level.shape}")
  if field.ndim < 1:
    raise ValueError("field and level need a trailing time axis [..., T]")
  axes = tuple(f"axis {a}" for a in range(field.ndim - 1)) + ("position",)
  _v.check_gate_values("field", field, axes)
  _v.check_gate_values("level", level, axes)
  gates, bad = _v.sanitize_gates({"field": field, "level": level})
  rows = jnp.cumsum(bad, axis=-1, dtype=jnp.int32) > 0  # [..., T]
  return jnp.where(rows[..., :, None], jnp.nan, penalty_matrix(gates["field"], gates["level"]))


def penalty_matrix(field: jax.Array, level: jax.Array) -> jax.Array:
  """`first_passage_penalty` of fp32 gates holding only allowed values, without the checks (the
  quadratic impl, whose caller has checked and replaced them): [..., T] -> [..., T, T]."""
  t = field.shape[-1]
  i = jnp.arange(t)[:, None]
  j = jnp.arange(t)[None, :]
  inf = jnp.asarray(jnp.inf, STATS_DTYPE)
  # Scan elements at (row i, column j): field_i strictly below the diagonal, +inf elsewhere;
  # level_j exactly on the diagonal, -inf elsewhere.
  mins = jnp.where(i > j, field[..., :, None], inf)
  lvls = jnp.where(i == j, level[..., None, :], -inf)
  run_min, run_lvl = jax.lax.associative_scan(_min_level_monoid, (mins, lvls), axis=-2)
  # On and above the diagonal the range is empty (run_min = +inf): `dip` gives exactly 0 there,
  # also for level = +inf (no inf - inf), with gradient 0, not NaN.
  pen = dip(run_lvl, run_min)
  return jnp.where(i >= j, pen, inf)
