"""Structural properties of the FPA ops: the shared walk's live sets, monotone penalties, the FoX
special case, the decode step, jit / vmap / tracing behaviour, and input validation."""

from __future__ import annotations

import functools
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _tol import assert_bitwise, assert_close, rtol
from fpa_jax import ops
from fpa_jax.ops import reference_np as ref

_penalty = jax.jit(ops.first_passage_penalty)
_fpa = jax.jit(ops.fpa_attention, static_argnames=("impl", "scale", "block_size"))


def walks(rng, n, t, kind):
  """[n, T] float32-exact random walks: continuous, or integer steps in {-1, 0, 1} (ties)."""
  if kind == "normal":
    return np.cumsum(rng.normal(size=(n, t)), 1).astype(np.float32)
  return np.cumsum(rng.integers(-1, 2, size=(n, t)), 1).astype(np.float32)


# ----------------------------------------------------------------------------- shared walk


@settings(max_examples=10, derandomize=True)
@given(t=st.integers(1, 32), kind=st.sampled_from(["normal", "int"]), seed=st.integers(0, 2**31 - 1))
def test_shared_walk_live_sets_equal_stack(t, kind, seed):
  field = walks(np.random.default_rng(seed), 4, t, kind)
  pen = np.asarray(_penalty(jnp.asarray(field), jnp.asarray(field)))  # [4, T, T]
  for n in range(field.shape[0]):
    stack = ref.stack_live_sets_np(field[n])
    assert ref.live_sets_from_penalty(pen[n]) == stack
    assert ref.live_sets_from_penalty(ref.penalty_np(field[n], field[n])) == stack
    for i in range(t):
      assert i in stack[i]  # the newest key is always live


def test_stack_live_sets_hand_example():
  # field 0, -1, 2, -3, 1: token 1 pops 0; token 3 pops 2 and 1; token 4 pops nothing.
  assert ref.stack_live_sets_np([0.0, -1.0, 2.0, -3.0, 1.0]) == [{0}, {1}, {1, 2}, {3}, {3, 4}]


@pytest.mark.parametrize("impl,blk", [("quadratic", None), ("recurrent", None), ("chunked", 4)])
def test_shared_walk_live_sets_at_logit_level(impl, blk):
  # q = k = 0 leaves only the penalty in the logits; v = one-hot of the key position reads out the
  # attention weights. On a steep integer walk every dip costs >= 30, so the weights are uniform
  # over the stack's live set and ~0 elsewhere.
  rng = np.random.default_rng(0)
  b, t, h = 2, 13, 2
  field = np.stack([walks(rng, h, t, "int").T for _ in range(b)]) * 30.0  # [B, T, H]
  q = jnp.zeros((b, t, h, 1), jnp.float32)
  v = jnp.broadcast_to(jnp.eye(t, dtype=jnp.float32)[None, :, None, :], (b, t, h, t))
  w = np.asarray(_fpa(q, q, v, jnp.asarray(field), jnp.asarray(field), impl=impl, block_size=blk))  # [B, T, H, T]
  for bb in range(b):
    for hh in range(h):
      for i, live in enumerate(ref.stack_live_sets_np(field[bb, :, hh])):
        want = np.zeros(t)
        want[sorted(live)] = 1.0 / len(live)
        assert_close(w[bb, i, hh], want, dtype=np.float32, n=t, err_msg=f"b={bb} h={hh} i={i}")


# ----------------------------------------------------------------------------- penalty properties


@settings(max_examples=10, derandomize=True)
@given(t=st.integers(2, 32), spikes=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_penalty_monotone_in_query(t, spikes, seed):
  rng = np.random.default_rng(seed)
  field = rng.normal(size=(3, t)) * 5
  if spikes:
    field = np.where(rng.random((3, t)) < 0.2, rng.choice([-1e3, 1e3], size=(3, t)), field)
  level = rng.normal(size=(3, t)) * 5
  pen = np.asarray(_penalty(jnp.asarray(field, jnp.float32), jnp.asarray(level, jnp.float32)))
  lower = np.tril(np.ones((t, t), bool))
  assert np.all(pen[:, lower] >= 0)
  # For each key j the penalty never decreases as the query i moves on (j <= i < i + 1).
  rows_i, cols_j = np.nonzero(lower[:-1])  # j <= i < T - 1
  assert np.all(pen[:, rows_i + 1, cols_j] >= pen[:, rows_i, cols_j])


@settings(max_examples=8, derandomize=True)
@given(t=st.integers(1, 40), shift=st.sampled_from([-3.0, 0.0, 4.0]), seed=st.integers(0, 2**31 - 1))
def test_fox_special_case_penalty_is_sum_of_log_gates(t, shift, seed):
  rng = np.random.default_rng(seed)
  logf = np.asarray(jax.nn.log_sigmoid(jnp.asarray(rng.normal(size=(2, t)) * 2 + shift, jnp.float32)), np.float64)
  c = jnp.cumsum(jnp.asarray(logf, jnp.float32), axis=-1)
  pen = np.asarray(_penalty(c, c))
  for n in range(2):
    for i in range(t):
      for j in range(i + 1):
        want = -sum(logf[n, s] for s in range(j + 1, i + 1))
        # differences of fp32 cumsums over t gates: rounding at the scale of the whole sum
        assert abs(pen[n, i, j] - want) <= rtol(np.float32, t) * max(1.0, float(-np.sum(logf[n]))), (n, i, j)


# ----------------------------------------------------------------------------- decode step


@pytest.mark.parametrize("seg_kind,extra_capacity", [("none", 0), ("sorted", 3), ("unsorted", 2)])
def test_decode_loop_matches_quadratic(seg_kind, extra_capacity):
  rng = np.random.default_rng(1)
  b, t, h, d, dv = 2, 10, 2, 3, 4
  scale = 0.6
  q, k = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
  field = jnp.asarray(np.cumsum(rng.normal(size=(b, t, h)), 1) * 2, jnp.float32)
  level = jnp.asarray(np.asarray(field) + rng.normal(size=(b, t, h)), jnp.float32)
  seg = None
  if seg_kind == "sorted":
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, t)), 1), jnp.int32)
  elif seg_kind == "unsorted":
    seg = jnp.asarray(rng.integers(0, 3, size=(b, t)), jnp.int32)
  want = np.asarray(_fpa(q, k, v, field, level, impl="quadratic", scale=scale, segment_ids=seg))
  pen = np.asarray(_penalty(jnp.swapaxes(field, 1, 2), jnp.swapaxes(level, 1, 2)))  # [B, H, T, T]

  step = jax.jit(functools.partial(ops.decode_step, scale=scale))
  cache = ops.init_recurrent_cache(b, t + extra_capacity, h, d, dv)
  assert isinstance(cache, ops.RecurrentCache)
  prev = None
  for i in range(t):
    out, cache = step(
      cache, q[:, i], k[:, i], v[:, i], field[:, i], level[:, i], segment=None if seg is None else seg[:, i]
    )
    assert int(cache.length) == i + 1
    assert_close(out, want[:, i], n=t, err_msg=f"step {i}")
    cp = np.asarray(ops.cache_penalty(cache))  # [B, S, H]
    # The cache's penalty of key j after token i is row i of the penalty matrix.
    scale = np.abs(np.asarray(field)).max() + np.abs(np.asarray(level)).max()  # differences of fields / levels
    assert_close(np.moveaxis(cp[:, : i + 1], 1, 2), pen[:, :, i, : i + 1], n=t, scale=scale)
    if prev is not None:  # eviction safety: a cached key's penalty never decreases
      assert np.all(cp[:, :i] >= prev[:, :i])
    prev = cp


# ----------------------------------------------------------------------------- jit / vmap / tracing


def _inputs(rng, lead, t=9, h=2, d=3, dv=2):
  q, k = (jnp.asarray(rng.normal(size=lead + (t, h, d)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=lead + (t, h, dv)), jnp.float32)
  f = jnp.asarray(np.cumsum(rng.normal(size=lead + (t, h)), -2) * 3, jnp.float32)
  l = jnp.asarray(rng.normal(size=lead + (t, h)) * 3, jnp.float32)
  return q, k, v, f, l


@pytest.mark.parametrize(
  "impl,blk",
  [
    pytest.param("quadratic", None, marks=pytest.mark.slow),
    pytest.param("recurrent", None, marks=pytest.mark.slow),
    ("chunked", 4),
  ],
)
def test_jit_and_vmap(impl, blk):
  rng = np.random.default_rng(2)
  n, b, t = 2, 2, 9
  q, k, v, f, l = _inputs(rng, (n, b))
  seg = jnp.asarray(np.sort(rng.integers(0, 2, size=(n, b, t)), -1), jnp.int32)
  fn = functools.partial(ops.fpa_attention, impl=impl, block_size=blk)
  batched = jax.jit(jax.vmap(fn))(q, k, v, f, l, segment_ids=seg)
  assert batched.shape == (n, b, t, 2, 2)
  single = jax.jit(fn)
  for m in range(n):
    want = single(q[m], k[m], v[m], f[m], l[m], segment_ids=seg[m])
    assert_close(batched[m], want, n=t, err_msg=f"vmap row {m}")  # vmap: another program
  pen = jax.vmap(ops.first_passage_penalty)(jnp.swapaxes(f, -1, -2), jnp.swapaxes(l, -1, -2))
  # min, relu and one subtraction per entry (no sums): exact under any batching
  assert_bitwise(pen, ops.first_passage_penalty(jnp.swapaxes(f, -1, -2), jnp.swapaxes(l, -1, -2)))


def test_no_retrace_for_same_shapes():
  @jax.jit
  @chex.assert_max_traces(n=1)  # raises on a second trace
  def f(q, k, v, field, level):
    return (
      ops.fpa_attention(q, k, v, field, level, impl="chunked", block_size=4)
      + ops.fpa_attention(q, k, v, field, level, impl="recurrent")
      + ops.fox_attention(q, k, v, -jnp.abs(field), impl="chunked", block_size=4)
    )

  rng = np.random.default_rng(3)
  for _ in range(3):
    f(*_inputs(rng, (1,), t=6, d=2, dv=2)).block_until_ready()  # traced once, then cached
  with pytest.raises(AssertionError, match="trace"):
    f(*_inputs(rng, (1,), t=7, d=2, dv=2))  # a new shape does retrace (and the counter sees it)


def test_eager_calls_compile_one_program_per_configuration():
  """An eager call runs the kernel as one jitted program (validated first, in Python), cached per
  (impl, scale, tiles, tolerance, shapes), so a notebook's second call compiles nothing."""
  from fpa_jax.ops import attention as A

  rng = np.random.default_rng(5)
  q, k, v, f, l = _inputs(rng, (1,), t=11, d=2, dv=2)
  lf = -jnp.abs(f)
  n_fpa, n_fox = A._fpa_core._cache_size(), A._fox_core._cache_size()
  for _ in range(2):
    ops.fpa_attention(q, k, v, f, l, impl="chunked", block_size=4)
    ops.fox_attention(q, k, v, lf, impl="chunked", block_size=4)
  assert (A._fpa_core._cache_size(), A._fox_core._cache_size()) == (n_fpa + 1, n_fox + 1)
  ops.fpa_attention(q, k, v, f, l, impl="chunked", block_size=8)  # another tiling: another program
  assert A._fpa_core._cache_size() == n_fpa + 2
  with pytest.raises(ValueError, match="log_fgate"):  # validation still runs on every eager call
    ops.fox_attention(q, k, v, -lf, impl="chunked", block_size=4)


# ----------------------------------------------------------------------------- validation


def _valid():
  return _inputs(np.random.default_rng(4), (2,), t=5)


@pytest.mark.parametrize("fn", ["fpa", "fox", "softmax"])
def test_qkv_errors(fn):
  q, k, v, f, l = _valid()

  def call(q, k, v, **kw):
    if fn == "fpa":
      return ops.fpa_attention(q, k, v, f, l, **kw)
    if fn == "fox":
      return ops.fox_attention(q, k, v, -jnp.abs(f), **kw)
    return ops.softmax_attention(q, k, v, **kw)

  with pytest.raises(ValueError, match="rank 4"):
    call(q[0], k[0], v[0])  # rank-3 q (and k, v)
  with pytest.raises(ValueError, match="rank 4"):
    call(q[0], k, v)
  with pytest.raises(ValueError, match="same shape"):
    call(q, k[:, :, :, :2], v)  # mismatched k
  with pytest.raises(ValueError, match="float"):
    call(q.astype(jnp.int32), k, v)  # int q
  with pytest.raises(ValueError, match="dtype"):
    call(q, k.astype(jnp.bfloat16), v)  # mixed float dtypes
  with pytest.raises(ValueError, match="v must be"):
    call(q, k, v[:, :3])
  with pytest.raises(ValueError, match="segment_ids"):
    call(q, k, v, segment_ids=jnp.zeros((2, 5), jnp.float32))  # float segment ids
  with pytest.raises(ValueError, match="segment_ids"):
    call(q, k, v, segment_ids=jnp.zeros((2, 4), jnp.int32))  # wrong shape


def test_gate_impl_and_block_errors():
  q, k, v, f, l = _valid()
  with pytest.raises(ValueError, match="field"):
    ops.fpa_attention(q, k, v, f[:, :4], l)
  with pytest.raises(ValueError, match="level"):
    ops.fpa_attention(q, k, v, f, l[..., None])
  with pytest.raises(ValueError, match="field"):
    ops.fpa_attention(q, k, v, f.astype(jnp.int32), l)
  with pytest.raises(ValueError, match="log_fgate"):
    ops.fox_attention(q, k, v, f[:, :, :1])
  for fn in (lambda **kw: ops.fpa_attention(q, k, v, f, l, **kw), lambda **kw: ops.fox_attention(q, k, v, f, **kw)):
    with pytest.raises(ValueError, match="impl must be one of"):
      fn(impl="flash")
    for impl in ("quadratic", "recurrent"):
      with pytest.raises(ValueError, match="block_size"):
        fn(impl=impl, block_size=4)
    for bad in (0, -4):
      with pytest.raises(ValueError, match="block_size"):
        fn(impl="chunked", block_size=bad)
  with pytest.raises(ValueError, match="same shape"):
    ops.first_passage_penalty(f[0, :, 0], l[0, :4, 0])
  assert ops.IMPLS == ("quadratic", "chunked", "recurrent", "pallas", "auto") == typing.get_args(ops.Implementation)
