"""The tolerance helper (`tests/_tol.py`): loose enough for a reordered sum, tight enough for a real error."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_bitwise, assert_close, assert_trees_close, eps, rtol


def _sums(n=4096, m=8, seed=0):
  """[m] row sums of an fp32 [m, n] matrix (signed, so they cancel) in two orders and in float64."""
  x = np.random.default_rng(seed).normal(size=(m, n)).astype(np.float32)
  pairwise = x.sum(1)  # numpy: pairwise
  sequential = np.zeros(m, np.float32)
  for j in range(n)[::-1]:  # the other end first, one term at a time
    sequential += x[:, j]
  return pairwise, sequential, x.astype(np.float64).sum(1)


def test_eps_and_rtol():
  assert eps(np.float32) == 2.0**-23 and eps(jnp.bfloat16) == 2.0**-7 and eps(np.float64) == 2.0**-52
  assert rtol(np.float32, 400) == pytest.approx(16 * 2.0**-23 * 20)
  assert rtol(np.float32, 0) == rtol(np.float32, 1)


def test_reordered_long_sum_passes():
  pairwise, sequential, exact = _sums()
  assert np.any(pairwise != sequential)  # the two orders do round differently
  assert_close(sequential, pairwise, n=4096)
  assert_close(pairwise, exact, dtype=np.float32, n=4096)  # float64 reference: fp32 eps
  assert_close(sequential, exact, dtype=np.float32, n=4096)


@pytest.mark.parametrize("err", [0.02, -0.05])
def test_error_of_a_few_percent_fails(err):
  pairwise, _, exact = _sums()
  wrong = pairwise.copy()
  wrong[3] += err * np.abs(exact).max()  # one entry off by a few percent of the scale
  with pytest.raises(AssertionError):
    assert_close(wrong, exact, dtype=np.float32, n=4096)
  with pytest.raises(AssertionError):
    assert_close(pairwise * np.float32(1 + err), pairwise, n=4096)


def test_zeros_and_infinities():
  z = np.zeros(4, np.float32)
  assert_close(z, z)
  assert_close(-z, z)
  with pytest.raises(AssertionError):  # an all-zero expectation takes (nearly) exact zeros
    assert_close(z + np.float32(1e-20), z)
  # near-zero entries are held to the scale of their neighbours, not to an impossible relative error
  assert_close(np.float32([1.0, 1e-9]), np.float32([1.0, 0.0]))
  inf = np.float32([np.inf, -np.inf, 1.0])
  assert_close(inf, inf)  # infinities match by position and sign, and do not set the scale
  for other in (np.float32([np.inf, np.inf, 1.0]), np.float32([1.0, -np.inf, 1.0])):
    with pytest.raises(AssertionError):
      assert_close(other, inf)
  with pytest.raises(AssertionError):
    assert_close(np.float32([np.inf, -np.inf, 1.01]), inf)


def test_bf16_uses_its_own_eps():
  x = np.linspace(1.0, 2.0, 16, dtype=np.float32)
  off = x * np.float32(1 + 0.5 * eps(jnp.bfloat16))  # half a bf16 ulp: far beyond fp32 noise
  assert_close(jnp.asarray(off, jnp.bfloat16), x)  # dtype: the lower precision of the two
  with pytest.raises(AssertionError):
    assert_close(off, x)


def test_trees_and_zero_leaves():
  want = {"w": np.float32([1.0, -2.0]), "b": np.float32([1e-8, -3e-8])}  # b: rounding noise around 0
  got = {"w": want["w"] * np.float32(1 + 1e-7), "b": np.float32([-2e-8, 1e-8])}
  with pytest.raises(AssertionError):
    assert_trees_close(got, want)  # b alone at its own scale: noise vs noise
  assert_trees_close(got, want, zero_leaves=("b",))
  with pytest.raises(AssertionError):  # a genuinely nonzero "zero" leaf still fails
    assert_trees_close({**got, "b": np.float32([1e-2, 0.0])}, want, zero_leaves=("b",))
  with pytest.raises(AssertionError):  # a misspelt name leaves b at its own scale
    assert_trees_close(got, want, zero_leaves=("no such leaf",))


def test_bitwise():
  x = np.float32([1.0, 2.0])
  assert_bitwise(x, x.copy())
  with pytest.raises(AssertionError):
    assert_bitwise(np.nextafter(x, np.float32(3)), x)
