"""fpa_jax.ops against the float64 numpy loop references in fpa_jax.ops.reference_np.

Random shapes and gates come from hypothesis (derandomized, modest example counts); the arrays
themselves come from a numpy Generator seeded by a drawn integer, so a failing example is
reproducible from the printed draw alone.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _tol import assert_bitwise, assert_close, eps
from fpa_jax import ops
from fpa_jax.ops import reference_np as ref

# Jitted entry points: one compile per (shape, impl, block, segment_ids present).
_fpa = jax.jit(ops.fpa_attention, static_argnames=("impl", "scale", "block_size"))
_fox = jax.jit(ops.fox_attention, static_argnames=("impl", "scale", "block_size"))
_softmax = jax.jit(ops.softmax_attention, static_argnames=("scale",))
_penalty = jax.jit(ops.first_passage_penalty)

BLOCKS = (4, 8, 16, None)


def impl_blocks(blk):
  """(impl, block_size) pairs checked per example: one chunked tile size each, to bound compiles.
  Examples draw blk from BLOCKS, so T is often not a multiple of the tile."""
  return [("quadratic", None), ("recurrent", None), ("chunked", blk)]


# ----------------------------------------------------------------------------- input generation


def make_gates(rng, b, t, h, gate_scale, mode):
  """field, level [B, T, H] float64 for a gate mode.

  iid: independent normals; walk: random walk field with levels near it; shared: level = field
  (the shared walk); spikes: a small walk with +-1e3 excursions at random tokens.
  """
  shape = (b, t, h)
  if mode == "iid":
    field = rng.normal(size=shape) * gate_scale
    level = rng.normal(size=shape) * gate_scale
  elif mode == "walk":
    field = np.cumsum(rng.normal(size=shape), axis=1) * gate_scale
    level = field + rng.normal(size=shape) * gate_scale
  elif mode == "shared":
    field = np.cumsum(rng.normal(size=shape), axis=1) * gate_scale
    level = field
  elif mode == "spikes":
    field = np.cumsum(rng.normal(size=shape), axis=1) * gate_scale
    spike = rng.random(shape) < 0.25
    field = np.where(spike, rng.choice([-1e3, 1e3], size=shape), field)
    level = np.where(rng.random(shape) < 0.5, field, field + rng.normal(size=shape))
  else:
    raise ValueError(mode)
  return field, level


def make_segments(rng, b, t, mode):
  """[B, T] int32 segment ids: None, sorted (packed documents), or unsorted (arbitrary)."""
  if mode == "none":
    return None
  if mode == "sorted":
    return np.sort(rng.integers(0, 4, size=(b, t)), axis=1).astype(np.int32)
  if mode == "unsorted":
    return rng.integers(-1, 3, size=(b, t)).astype(np.int32)
  if mode == "isolated":  # every token its own segment: attends only to itself
    return np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  raise ValueError(mode)


def round_to(x, dtype):
  """Round float64 numbers to `dtype` and back, so the reference sees exactly the op's inputs."""
  return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


cases = st.fixed_dictionaries(
  dict(
    b=st.integers(1, 2),
    t=st.integers(1, 40),
    h=st.integers(1, 3),
    d=st.integers(1, 8),
    dv=st.one_of(st.none(), st.integers(1, 8)),  # None: v_dim == head_dim
    seg=st.sampled_from(["none", "sorted", "unsorted"]),
    gate_scale=st.sampled_from([0.1, 1.0, 10.0, 1e3]),
    mode=st.sampled_from(["iid", "walk", "shared", "spikes"]),
    scale=st.sampled_from([None, 0.7]),
    blk=st.sampled_from(BLOCKS),
    seed=st.integers(0, 2**31 - 1),
  )
)


def make_case(c, dtype=jnp.float32, gate_dtype=jnp.float32):
  rng = np.random.default_rng(c["seed"])
  b, t, h, d = c["b"], c["t"], c["h"], c["d"]
  dv = d if c["dv"] is None else c["dv"]
  q = round_to(rng.normal(size=(b, t, h, d)), dtype)
  k = round_to(rng.normal(size=(b, t, h, d)), dtype)
  v = round_to(rng.normal(size=(b, t, h, dv)), dtype)
  field, level = make_gates(rng, b, t, h, c["gate_scale"], c["mode"])
  field, level = round_to(field, gate_dtype), round_to(level, gate_dtype)
  seg = make_segments(rng, b, t, c["seg"])
  jx = dict(
    q=jnp.asarray(q, dtype),
    k=jnp.asarray(k, dtype),
    v=jnp.asarray(v, dtype),
    field=jnp.asarray(field, gate_dtype),
    level=jnp.asarray(level, gate_dtype),
    segment_ids=None if seg is None else jnp.asarray(seg),
  )
  npx = dict(q=q, k=k, v=v, field=field, level=level, segment_ids=seg)
  return jx, npx


# ----------------------------------------------------------------------------- penalty


@settings(max_examples=15, derandomize=True)
@given(
  t=st.integers(1, 24),
  lead=st.sampled_from([(), (2,), (2, 3)]),
  gate_scale=st.sampled_from([0.1, 1.0, 1e3]),
  mode=st.sampled_from(["iid", "walk", "shared", "spikes"]),
  seed=st.integers(0, 2**31 - 1),
)
@example(t=1, lead=(), gate_scale=1.0, mode="iid", seed=0)
def test_penalty_matches_loop_reference(t, lead, gate_scale, mode, seed):
  rng = np.random.default_rng(seed)
  n = int(np.prod(lead, dtype=int))
  field, level = make_gates(rng, 1, t, n, gate_scale, mode)  # [1, T, n]
  field = round_to(np.moveaxis(field[0], 0, -1).reshape(lead + (t,)), jnp.float32)
  level = round_to(np.moveaxis(level[0], 0, -1).reshape(lead + (t,)), jnp.float32)
  got = np.asarray(_penalty(jnp.asarray(field, jnp.float32), jnp.asarray(level, jnp.float32)))
  assert got.shape == lead + (t, t) and got.dtype == np.float32
  want = np.stack([ref.penalty_np(f, l) for f, l in zip(field.reshape(-1, t), level.reshape(-1, t))])
  want = want.reshape(lead + (t, t))
  upper = np.triu(np.ones((t, t), bool), 1)
  assert np.all(np.isposinf(got[..., upper])), "entries above the diagonal must be +inf"
  assert_bitwise(np.diagonal(got, axis1=-2, axis2=-1), 0.0)
  # level_j - min(field) of fp32 inputs: one fp32 rounding at most (<= eps / 2 of each entry; tiny: FTZ).
  lower = ~upper
  np.testing.assert_allclose(got[..., lower], want[..., lower], rtol=eps(np.float32), atol=np.finfo(np.float32).tiny)


def test_penalty_hand_example():
  # field:  0   -1    2   -3 ;  level = field.  penalty[i, j] = max(0, l_j - min f(j, i]).
  f = np.array([0.0, -1.0, 2.0, -3.0])
  inf = np.inf
  want = np.array([[0, inf, inf, inf], [1, 0, inf, inf], [1, 0, 0, inf], [3, 2, 5, 0]], np.float64)
  np.testing.assert_array_equal(ref.penalty_np(f, f), want)
  np.testing.assert_array_equal(np.asarray(ops.first_passage_penalty(jnp.asarray(f), jnp.asarray(f))), want)


# ----------------------------------------------------------------------------- fpa_attention fp32


def _check_all_impls(jx, npx, scale, blk, **tol):
  """Every impl against the float64 reference: `_tol.assert_close(**tol)` at the scale of v (outputs
  are convex combinations of v)."""
  want = ref.fpa_attention_np(
    npx["q"], npx["k"], npx["v"], npx["field"], npx["level"], scale=scale, segment_ids=npx["segment_ids"]
  )
  for impl, bs in impl_blocks(blk):
    got = _fpa(
      jx["q"],
      jx["k"],
      jx["v"],
      jx["field"],
      jx["level"],
      impl=impl,
      scale=scale,
      segment_ids=jx["segment_ids"],
      block_size=bs,
    )
    assert got.shape == want.shape and got.dtype == jx["q"].dtype, (impl, blk)
    assert_close(got, want, scale=np.abs(npx["v"]).max(), err_msg=f"impl={impl} block_size={bs}", **tol)


@settings(max_examples=3, derandomize=True)
@given(c=cases)
@example(c=dict(b=1, t=1, h=1, d=1, dv=None, seg="none", gate_scale=1.0, mode="iid", scale=None, blk=None, seed=1))
@example(c=dict(b=2, t=37, h=2, d=3, dv=5, seg="unsorted", gate_scale=1e3, mode="spikes", scale=None, blk=8, seed=2))
@example(c=dict(b=1, t=21, h=3, d=8, dv=2, seg="sorted", gate_scale=1.0, mode="walk", scale=0.7, blk=4, seed=3))
@example(c=dict(b=2, t=40, h=1, d=2, dv=None, seg="none", gate_scale=1e3, mode="shared", scale=None, blk=16, seed=4))
def test_fpa_attention_matches_reference_fp32(c):
  jx, npx = make_case(c)
  _check_all_impls(jx, npx, c["scale"], blk=c["blk"], n=c["t"])  # sums over t keys


def test_fpa_isolated_segments_return_own_value():
  # Every token its own segment: attention reduces to out_i = v_i, whatever the gates.
  t = 13
  c = dict(b=2, t=t, h=2, d=3, dv=4, seg="isolated", gate_scale=1e3, mode="spikes", scale=None, seed=t)
  jx, npx = make_case(c)
  assert_close(
    ref.fpa_attention_np(npx["q"], npx["k"], npx["v"], npx["field"], npx["level"], segment_ids=npx["segment_ids"]),
    npx["v"],
    n=t,
  )
  _check_all_impls(jx, npx, None, blk=4)  # one key per query: no sum


# ----------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("gate_dtype,seg", [(jnp.float32, "none"), (jnp.bfloat16, "unsorted")])
def test_fpa_attention_bf16(gate_dtype, seg):
  c = dict(b=2, t=19, h=2, d=8, dv=4, seg=seg, gate_scale=1.0, mode="walk", scale=None, seed=11)
  jx, npx = make_case(c, dtype=jnp.bfloat16, gate_dtype=gate_dtype)
  # bf16 weights/outputs: 8 mantissa bits; allow a few roundings of the largest |v|.
  _check_all_impls(jx, npx, None, blk=8, dtype=jnp.bfloat16, factor=2)


# ----------------------------------------------------------------------------- FoX


fox_cases = st.fixed_dictionaries(
  dict(
    b=st.integers(1, 2),
    t=st.integers(1, 40),
    h=st.integers(1, 3),
    d=st.integers(1, 8),
    dv=st.one_of(st.none(), st.integers(1, 8)),
    seg=st.sampled_from(["none", "sorted", "unsorted"]),
    gate_shift=st.sampled_from([-3.0, 0.0, 4.0]),
    blk=st.sampled_from(BLOCKS),
    seed=st.integers(0, 2**31 - 1),
  )
)


@settings(max_examples=2, derandomize=True)
@given(c=fox_cases)
@example(c=dict(b=2, t=27, h=2, d=4, dv=3, seg="unsorted", gate_shift=0.0, blk=8, seed=5))
def test_fox_attention_matches_cumsum_reference(c):
  rng = np.random.default_rng(c["seed"])
  b, t, h, d = c["b"], c["t"], c["h"], c["d"]
  dv = d if c["dv"] is None else c["dv"]
  q, k = (round_to(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(2))
  v = round_to(rng.normal(size=(b, t, h, dv)), jnp.float32)
  # log sigmoid: <= 0; shift +4 gives slow decay, -3 fast decay (sums to ~-130 over 40 tokens).
  logf = np.asarray(
    jax.nn.log_sigmoid(jnp.asarray(rng.normal(size=(b, t, h)) * 2 + c["gate_shift"], jnp.float32)), np.float64
  )
  assert np.all(logf <= 0)
  seg = make_segments(rng, b, t, c["seg"])
  segj = None if seg is None else jnp.asarray(seg)
  want = ref.fox_attention_np(q, k, v, logf, segment_ids=seg)
  tol = dict(dtype=np.float32, n=t, scale=np.abs(v).max())  # sums over t keys, at the scale of v
  qj, kj, vj, lj = (jnp.asarray(x, jnp.float32) for x in (q, k, v, logf))
  cum = jnp.cumsum(lj, axis=1)
  fpa_fox = _fpa(qj, kj, vj, cum, cum, impl="quadratic", segment_ids=segj)
  assert_close(fpa_fox, want, err_msg="fpa(field=level=cumsum)", **tol)
  for impl, blk in impl_blocks(c["blk"]):
    got = _fox(qj, kj, vj, lj, impl=impl, segment_ids=segj, block_size=blk)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert_close(got, want, err_msg=f"fox impl={impl} block={blk}", **tol)
    assert_close(got, fpa_fox, err_msg=f"fox vs fpa special case, impl={impl} block={blk}", **tol)


def test_fox_reference_is_fpa_special_case_np():
  # The two numpy references agree with each other (they are written independently).
  rng = np.random.default_rng(7)
  b, t, h, d = 1, 9, 2, 3
  q, k, v = (rng.normal(size=(b, t, h, d)) for _ in range(3))
  logf = -np.abs(rng.normal(size=(b, t, h)))
  cum = np.cumsum(logf, axis=1)
  assert_close(ref.fox_attention_np(q, k, v, logf), ref.fpa_attention_np(q, k, v, cum, cum), n=t)  # float64


# ----------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("t,seg,dv", [(1, "none", 3), (13, "none", 5), (13, "sorted", 2), (22, "unsorted", 4)])
def test_softmax_attention_matches_reference(t, seg, dv):
  rng = np.random.default_rng(t)
  b, h, d = 2, 2, 3
  q, k = (round_to(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(2))
  v = round_to(rng.normal(size=(b, t, h, dv)), jnp.float32)
  s = make_segments(rng, b, t, seg)
  got = _softmax(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), segment_ids=None if s is None else jnp.asarray(s))
  tol = dict(dtype=np.float32, n=t, scale=np.abs(v).max())  # sums over t keys, at the scale of v
  assert_close(got, ref.softmax_attention_np(q, k, v, segment_ids=s), **tol)
  # FPA with a constant field (never dips below any level) is plain softmax attention.
  zero = jnp.zeros((b, t, h), jnp.float32)
  assert_close(
    got,
    np.asarray(
      _fpa(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
        zero,
        zero,
        impl="quadratic",
        segment_ids=None if s is None else jnp.asarray(s),
      )
    ),
    **tol,
  )
