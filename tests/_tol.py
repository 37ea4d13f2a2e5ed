"""Tolerances that follow from what is compared, so a comparison passes on any CPU (and XLA version).

Two computations of one quantity agree bit for bit only when the *same program* runs on the same
inputs (`assert_bitwise`). Anything else -- another impl, a sharded program, jit vs eager, a
cached decode against the parallel forward, another tile size -- sums in another order, and the
backend may fuse, reassociate or use FMA differently on another CPU. The rounding error of a sum
of n terms in a dtype with unit roundoff eps is then bounded by ~n * eps * sum|terms| (worst case)
and is ~sqrt(n) * eps * |terms| typically (random rounding). So:

    rtol(dtype, n) = factor * eps(dtype) * sqrt(n)

relative to the *scale of the compared values* (the largest |expected| unless `scale` is given), so
that entries that are near zero by cancellation are held to the same absolute accuracy as their
neighbours instead of to an impossible relative one. `n` is the length of the longest reduction on
the path from inputs to the compared value (head dim for a logit, keys for an attention output,
model dim x depth for a model's logits: a rough count is enough, it enters as a square root), and
`factor` (default 16) absorbs the chain of a few such reductions (softmax: max, exp, sum, divide).
Float64 references compared with fp32 results use the fp32 eps: the reference is exact to fp32.

Where the scale of what cancels is not the scale of the result, say so with `scale`: a loss
sum(out * ct) of N unit random terms is ~sqrt(N) whatever it comes to (`scale=sqrt(N)`), a
penalty (a difference of fields) has the fields' scale, an attention output that of v. A leaf of a
gradient tree that is zero up to rounding by construction goes in `zero_leaves`. bf16 results use
bf16's eps (the default dtype is the lower precision of the two sides); one bf16 rounding per term
accumulated in fp32 is a couple of eps, not sqrt(n) of them (`factor=2`, n=1).

Bounds from the theory (lost mass <= eps, |skip - exact| <= 2 eps max|v|) are not rounding
tolerances; their slack for rounding is `rtol(...) * scale`, never a bare 1e-6.
"""

from __future__ import annotations

import numpy as np

FACTOR = 16.0


def eps(dtype) -> float:
  """Machine epsilon (spacing at 1) of a float dtype (jax's bfloat16 included)."""
  return float(np.finfo(np.dtype(dtype)).eps)


def rtol(dtype=np.float32, n: int = 1, factor: float = FACTOR) -> float:
  """Relative tolerance for two evaluations of one value of `dtype` through reductions of length `n`."""
  return factor * eps(dtype) * float(np.sqrt(max(int(n), 1)))


def _is_float(dt: np.dtype) -> bool:
  # ml_dtypes' bfloat16 is no np.floating subtype (its kind is "V"), but np.finfo knows it.
  if np.issubdtype(dt, np.floating):
    return True
  try:
    return dt.kind == "V" and np.finfo(dt).bits < 64
  except ValueError:
    return False


def _lowest_precision(*arrays) -> np.dtype:
  dts = [np.asarray(a).dtype for a in arrays if _is_float(np.asarray(a).dtype)]
  if not dts:
    return np.dtype(np.float64)
  return max(dts, key=eps)


def assert_close(actual, desired, *, dtype=None, n: int = 1, factor: float = FACTOR, scale=None, err_msg: str = ""):
  """assert |actual - desired| <= r * (|desired| + scale) elementwise, r = rtol(dtype, n, factor).

  `dtype` defaults to the lower-precision float dtype of the two; `scale` to max |desired|
  (at least the smallest normal number, so an all-zero expectation needs an exactly zero result
  up to denormals).
  """
  dtype = _lowest_precision(actual, desired) if dtype is None else np.dtype(dtype)
  a = np.asarray(actual, np.float64)
  d = np.asarray(desired, np.float64)
  r = rtol(dtype, n, factor)
  if scale is None:
    finite = np.abs(d[np.isfinite(d)])
    scale = float(finite.max()) if finite.size else 0.0
  scale = max(float(scale), float(np.finfo(dtype).tiny))
  np.testing.assert_allclose(a, d, rtol=r, atol=r * scale, err_msg=err_msg)


def assert_trees_close(actual, desired, *, zero_leaves: tuple[str, ...] = (), **kw):
  """`assert_close` on every leaf of two pytrees of arrays (same structure); each leaf has its own scale.

  `zero_leaves`: substrings of leaf paths ("gate/absolute/b": keys joined by "/") whose values are zero up to
  rounding by construction (e.g. the gradient of a bias that shifts field and level alike: a sum
  that cancels). Their own scale is that rounding noise, so they are held to the largest other
  leaf's scale instead (the terms that cancel are of that order): both sides must be ~0. A name
  that matches nothing is no error (a model without that parameter); a misspelt one leaves the
  noisy leaf at its own scale, where it fails.
  """
  import jax

  la, ta = jax.tree_util.tree_flatten(actual)
  ld, td = jax.tree_util.tree_flatten(desired)
  assert ta == td, f"tree structures differ: {ta} vs {td}"
  paths = ["/".join(_key_name(k) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(desired)[0]]
  is_zero = [any(z in path for z in zero_leaves) for path in paths]
  others = [float(np.max(np.abs(np.asarray(d, np.float64)), initial=0.0)) for d, z in zip(ld, is_zero) if not z]
  for path, a, d, z in zip(paths, la, ld, is_zero):
    leaf_kw = dict(kw, scale=max(others, default=0.0)) if z and "scale" not in kw else kw
    assert_close(a, d, err_msg=f"leaf {path}", **leaf_kw)


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def assert_bitwise(actual, desired, err_msg: str = ""):
  """Exact equality: only for the same program on the same inputs (or a documented exact identity)."""
  np.testing.assert_array_equal(np.asarray(actual), np.asarray(desired), err_msg=err_msg)
