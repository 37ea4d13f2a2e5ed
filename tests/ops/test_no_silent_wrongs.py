"""No silent wrongs: inputs that used to give a plausible, wrong result now give an error (concrete
arrays) or one defined, documented result under jit, the same in every impl (docs/ops.md,
"Non-finite inputs"; `fpa_jax.ops.validate.ALLOWED`).

  * a NaN / -inf field, a NaN level, a non-finite log_fgate: ValueError naming the argument and the
    count; under jit NaN in exactly the query rows at or after the bad token (per kv head group),
    every other row as for finite inputs, a NaN gradient at the bad entries only;
  * `ops.decode_step` past its capacity: ValueError; under jit nothing written, output NaN;
  * the inference cache with fewer slots than its policy's capacity, a measuring step past its
    slots, a pool without a free slot: an error, or NaN and `overflow`, never an overwritten key;
  * the layer's input shapes: errors naming x, segment_ids, positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tol import assert_close, rtol
from flax import nnx

from fpa_jax import ops
from fpa_jax.inference import cache as K
from fpa_jax.inference import pool as P
from fpa_jax.inference.policies import make_policy
from fpa_jax.layers import FirstPassageAttention
from fpa_jax.ops import reference_np as ref

B, T, H, KVH, D = 2, 12, 4, 2, 3
G = H // KVH
# Every impl and skipping path: (impl, block_size, skip_tolerance, skip).
PATHS = [
  ("quadratic", None, None, "tiles"),
  ("chunked", 4, None, "tiles"),
  ("chunked", 4, 1e-3, "tiles"),
  ("chunked", 4, 1e-3, "keys"),
  ("recurrent", None, None, "tiles"),
  ("pallas", 8, None, "tiles"),
]
# Bad entries: (batch, position, kv head) -> the first bad position per (batch, kv head).
BAD = [(0, 5, 1), (0, 9, 1), (1, 2, 0)]
FIRST = {(0, 1): 5, (1, 0): 2}


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda x: np.asarray(x, np.float32)
  q = f32(rng.normal(size=(B, T, H, D)))
  k, v = (f32(rng.normal(size=(B, T, KVH, D))) for _ in range(2))
  field = f32(np.cumsum(rng.normal(size=(B, T, KVH)), 1))
  level = f32(field + rng.normal(size=(B, T, KVH)))
  ct = f32(rng.normal(size=(B, T, H, D)))
  return q, k, v, field, level, ct


def _with(x, value, at=BAD):
  x = np.array(x)
  for idx in at:
    x[idx] = value
  return x


def _expected_nan_rows():
  """[B, T, H] bool: query rows at or after the first bad token of their kv head (h // G)."""
  rows = np.zeros((B, T, H), bool)
  for (b, g), t in FIRST.items():
    rows[b, t:, g * G : (g + 1) * G] = True
  return rows


def _reference(q, k, v, field, level):
  """float64 loops on the query heads (k, v, gates repeated per group)."""
  rep = lambda x: np.repeat(x, G, axis=2)
  return ref.fpa_attention_np(q, rep(k), rep(v), rep(field), rep(level))


# ----------------------------------------------------------------------------- eager errors


@pytest.mark.parametrize(
  "name,value,kind",
  [("field", np.nan, "NaN"), ("field", -np.inf, "-inf"), ("level", np.nan, "NaN")],
)
def test_disallowed_gate_values_raise_naming_the_argument_and_count(name, value, kind):
  q, k, v, field, level, _ = _inputs()
  gates = {"field": field, "level": level}
  gates[name] = _with(gates[name], value)
  msg = rf"{name} has 3 entries that are not allowed \(3 {kind}; the first at batch 0, position 5, kv head 1\)"
  for impl in ("quadratic", "chunked", "recurrent", "pallas"):
    with pytest.raises(ValueError, match=msg):
      ops.fpa_attention(q, k, v, gates["field"], gates["level"], impl=impl)
  f, lv = jnp.asarray(gates["field"]), jnp.asarray(gates["level"])  # made outside the traced function
  with pytest.raises(ValueError, match=msg):  # a concrete array closed over under jit is concrete too
    jax.jit(lambda q: ops.fpa_attention(q, k, v, f, lv))(q)
  with pytest.raises(ValueError, match=rf"{name} has 3 entries"):
    ops.first_passage_penalty(np.swapaxes(gates["field"], 1, 2), np.swapaxes(gates["level"], 1, 2))
  with pytest.raises(ValueError, match=rf"{name} has 1 entry that is not allowed"):
    cache = ops.init_recurrent_cache(B, 4, KVH, D)
    ops.decode_step(cache, q[:, 5], k[:, 5], v[:, 5], gates["field"][:, 5], gates["level"][:, 5], scale=1.0)


@pytest.mark.parametrize("value,kind", [(np.nan, "NaN"), (-np.inf, "-inf"), (np.inf, "\\+inf")])
def test_non_finite_log_fgate_raises(value, kind):
  q, k, v, _, _, _ = _inputs()
  lf = _with(np.full((B, T, KVH), -0.1, np.float32), value)
  for impl in ("quadratic", "chunked"):
    with pytest.raises(ValueError, match=rf"log_fgate has 3 entries that are not allowed \(3 {kind}"):
      ops.fox_attention(q, k, v, lf, impl=impl)


def test_allowed_infinities_pass():
  # field +inf (lowers no minimum), level +inf (dead) and -inf (never penalised): no error, finite out.
  q, k, v, field, level, _ = _inputs()
  field = _with(field, np.inf, [(0, 3, 0), (1, 7, 1)])
  level = _with(_with(level, -np.inf, [(0, 1, 1), (1, 4, 0)]), np.inf, [(0, 6, 0)])
  out = ops.fpa_attention(q, k, v, field, level, block_size=4)
  assert np.all(np.isfinite(np.asarray(out)))
  assert_close(np.asarray(out), _reference(q, k, v, field, level), n=T)


# ----------------------------------------------------------------------------- under jit: one result


@functools.partial(jax.jit, static_argnames=("impl", "blk", "tol", "skip"))
def _run(q, k, v, field, level, ct, *, impl, blk, tol, skip):
  """(out, d sum(out * ct) / d (field, level))."""
  op = lambda f, lv: ops.fpa_attention(q, k, v, f, lv, impl=impl, block_size=blk, skip_tolerance=tol, skip=skip)
  out, pull = jax.vjp(op, field, level)
  return out, pull(jnp.where(jnp.isnan(out), 0.0, ct))  # the loss of the finite rows


@pytest.fixture(scope="module")
def nan_case():
  """Inputs, the bad cases {what: (field, level)}, the float64 result on the finite inputs, and the
  quadratic impl's gradients of each case (what every other impl's must equal)."""
  q, k, v, field, level, ct = _inputs(1)
  cases = {"field NaN": (_with(field, np.nan), level), "field -inf": (_with(field, -np.inf), level)}
  cases["level NaN"] = (field, _with(level, np.nan))
  kw = dict(impl="quadratic", blk=None, tol=None, skip="tiles")
  grads = {what: [np.asarray(g) for g in _run(q, k, v, *fl, ct, **kw)[1]] for what, fl in cases.items()}
  return (q, k, v, ct), cases, _reference(q, k, v, field, level), grads


@pytest.mark.parametrize("impl,blk,tol,skip", PATHS)
def test_under_jit_nan_exactly_in_the_rows_at_or_after_a_bad_token(nan_case, impl, blk, tol, skip):
  (q, k, v, ct), cases, clean, want_grads = nan_case
  rows = np.broadcast_to(_expected_nan_rows()[..., None], clean.shape)
  for what, (field, level) in cases.items():
    out, g = _run(q, k, v, field, level, ct, impl=impl, blk=blk, tol=tol, skip=skip)
    out = np.asarray(out)
    assert np.array_equal(np.isnan(out), rows), (impl, what)
    # the rows before the bad token never read it: the finite inputs' result (skipping: within its bound)
    vmax = np.abs(v).max()
    if tol is None:
      assert_close(out[~rows], clean[~rows], n=T, err_msg=f"{impl} {what}")
    else:  # the skipping bound: each output component moves by <= 2 eps max|v|
      assert np.abs(out[~rows] - clean[~rows]).max() <= 2 * tol * vmax + rtol(np.float32, T) * vmax, (impl, what)
    bad = np.isnan(field) | np.isneginf(field) | np.isnan(level)
    for name, gx, gq in zip(("field", "level"), g, want_grads[what]):
      gx = np.asarray(gx)
      # NaN exactly at the bad entries of the gate that holds them; elsewhere the quadratic impl's
      own = bad if name == what.split()[0] else np.zeros_like(bad)
      assert np.array_equal(np.isnan(gx), own), (impl, what, name)
      assert_close(gx[~own], gq[~own], n=T, err_msg=f"{impl} {what} d/d{name} vs quadratic")


@pytest.mark.parametrize("impl", ["quadratic", "chunked", "recurrent", "pallas"])
def test_fox_under_jit_nan_rows_in_every_impl(impl):
  q, k, v, _, _, _ = _inputs(2)
  lf = np.asarray(jax.nn.log_sigmoid(np.random.default_rng(2).normal(size=(B, T, KVH)) + 1.0), np.float32)
  for value in (np.nan, -np.inf, np.inf):
    bad = _with(lf, value)
    out = np.asarray(
      jax.jit(lambda *a: ops.fox_attention(*a, impl=impl, block_size=8 if impl == "pallas" else None))(q, k, v, bad)
    )
    rows = _expected_nan_rows()
    assert np.array_equal(np.isnan(out), np.broadcast_to(rows[..., None], out.shape)), (impl, value)
    rep = lambda x: np.repeat(x, G, axis=2)
    want = ref.fox_attention_np(q, rep(k), rep(v), rep(lf))
    assert_close(out[~np.isnan(out)], want[~np.isnan(out)], n=T)


def test_penalty_under_jit_nan_rows():
  field = np.cumsum(np.random.default_rng(3).normal(size=(2, 7)), -1).astype(np.float32)
  bad = _with(field, np.nan, [(0, 3)])
  pen = np.asarray(jax.jit(ops.first_passage_penalty)(bad, bad))
  assert np.all(np.isnan(pen[0, 3:])) and not np.isnan(pen[0, :3]).any() and not np.isnan(pen[1]).any()


# ----------------------------------------------------------------------------- decode_step


def _stream(seed=4, t=6):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(1, t, 2, 4)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, t, 1, 4)), jnp.float32) for _ in range(2))
  field = jnp.asarray(np.cumsum(rng.normal(size=(1, t, 1)), 1), jnp.float32)
  return q, k, v, field, field + 0.5


def test_decode_step_past_capacity_raises_and_under_jit_writes_nothing():
  q, k, v, field, level = _stream()
  cache = ops.init_recurrent_cache(1, 4, 1, 4)
  for i in range(4):
    _, cache = ops.decode_step(cache, q[:, i], k[:, i], v[:, i], field[:, i], level[:, i], scale=0.5)
  with pytest.raises(ValueError, match=r"the cache is full \(length 4 = capacity 4\)"):
    ops.decode_step(cache, q[:, 4], k[:, 4], v[:, 4], field[:, 4], level[:, 4], scale=0.5)
  step = jax.jit(functools.partial(ops.decode_step, scale=0.5))
  out, after = step(cache, q[:, 4], k[:, 4], v[:, 4], field[:, 4], level[:, 4])
  assert np.all(np.isnan(np.asarray(out)))
  for name, a, b in zip(ops.RecurrentCache._fields, after, cache):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)  # unchanged, length 4


def test_decode_step_remembers_a_bad_gate_value_like_the_parallel_rows():
  q, k, v, field, level = _stream(t=8)
  step = jax.jit(functools.partial(ops.decode_step, scale=0.5))
  for f, lv, first in ((field.at[0, 3, 0].set(jnp.nan), level, 3), (field, level.at[0, 0, 0].set(jnp.nan), 0)):
    cache, outs = ops.init_recurrent_cache(1, 8, 1, 4), []
    for i in range(8):
      o, cache = step(cache, q[:, i], k[:, i], v[:, i], f[:, i], lv[:, i])
      outs.append(np.asarray(o))
    nan = np.array([np.isnan(o).all() for o in outs])
    assert nan.tolist() == [i >= first for i in range(8)]
    assert not any(np.isnan(o).any() for o in outs[:first])
    parallel = jax.jit(lambda *a: ops.fpa_attention(*a, impl="chunked"))(q, k, v, f, lv)
    assert np.array_equal(np.isnan(np.asarray(parallel))[0, :, 0, 0], nan)


# ----------------------------------------------------------------------------- inference caches


def _token(i, value=None):
  x = jnp.full((1, 1, 1, 1), float(i) if value is None else value, jnp.float32)
  return x, jnp.zeros((1, 1, 1), jnp.float32)


def test_layer_cache_with_fewer_slots_than_the_policy_capacity_raises():
  cache = K.init_layer_cache(1, 4, 1, 1)
  x, z = _token(0)
  with pytest.raises(ValueError, match=r"the cache has 4 slots per \(row, head\), fewer than the 8 keys"):
    K.decode_attend(cache, x, x, x, z, z, z, policy=make_policy("full", 8), scale=1.0, positions=jnp.array([0]))


def test_measuring_step_past_the_slots_raises_and_under_jit_flags_overflow():
  pol = make_policy("full", 6)
  attend = lambda c, x, z, i: K.decode_attend(
    c, x, x, x, z, z, z, policy=pol, scale=1.0, positions=jnp.array([i]), step=i, measure=True
  )
  cache = K.init_layer_cache(1, 4, 1, 1)
  for i in range(4):
    _, cache = attend(cache, *_token(i), jnp.int32(i))
  with pytest.raises(ValueError, match=r"measure=True writes slot step=4, but the cache has 4 slots"):
    attend(cache, *_token(4), jnp.int32(4))
  out, after = jax.jit(attend)(cache, *_token(4), jnp.int32(4))
  assert np.isnan(np.asarray(out)).all() and bool(after.overflow.all())
  np.testing.assert_array_equal(np.asarray(after.pos), np.asarray(cache.pos))  # nothing overwritten
  np.testing.assert_array_equal(np.asarray(after.k), np.asarray(cache.k))


def test_layer_cache_bad_gate_value_under_jit():
  # NaN output for that step; the key is stored dead (level +inf) and later steps are defined.
  pol = make_policy("full", 4)
  attend = jax.jit(
    lambda c, x, f, i: K.decode_attend(c, x, x, x, f, f, f, policy=pol, scale=1.0, positions=jnp.array([i]))
  )
  cache = K.init_layer_cache(1, 4, 1, 1)
  outs = []
  for i, f in enumerate([0.0, np.nan, 0.5, 0.2]):
    o, cache = attend(cache, _token(i)[0], jnp.full((1, 1, 1), f, jnp.float32), i)
    outs.append(float(np.asarray(o).ravel()[0]))
  assert [np.isnan(o) for o in outs] == [False, True, False, False]
  assert np.asarray(cache.level)[0, 1, 0] == np.inf and np.asarray(cache.alive)[0, :, 0].all()
  with pytest.raises(ValueError, match="field has 1 entry that is not allowed"):
    x, _ = _token(0)
    K.decode_attend(
      cache, x, x, x, x[..., 0] * np.nan, x[..., 0], x[..., 0], policy=pol, scale=1.0, positions=jnp.array([4])
    )


def test_pool_without_a_free_slot_writes_nothing():
  pol = make_policy("fpa_global", 8, budget=2)
  gc = P.init_global_cache(1, 2, 1, 1, 1)  # 2 slots, 1 layer, 1 kv head
  pool = gc.pool._replace(alive=jnp.ones((1, 2), bool), owner=jnp.zeros((1, 2), jnp.int32), pos=jnp.array([[0, 1]]))
  gc = P.prepare(gc._replace(pool=pool), pol)  # the default pool_impl ("packed") reads its PackIndex
  view = P.PoolView(pool=gc.pool, carry=gc.carry[0], layer=0, index=gc.index)
  x, z = _token(2, 3.0)
  out, new = P.pool_decode_attend(view, x, x, x, z, z, z, policy=pol, scale=1.0, positions=jnp.array([2]))
  assert np.isnan(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(new.pool.k), np.asarray(gc.pool.k))


# ----------------------------------------------------------------------------- the layer's inputs


@pytest.fixture(scope="module")
def layer():
  return FirstPassageAttention.from_args(16, 2, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "args,kw,match",
  [
    ((np.zeros((5, 16)),), {}, r"x must be \[batch, seq, d_model\] \(rank 3\), got shape \(5, 16\) \(add a batch axis"),
    ((np.zeros((2, 5, 8), np.float32),), {}, r"x's last axis must be d_model=16"),
    ((np.zeros((2, 5, 16), np.int32),), {}, r"x must be a float array"),
    (
      (np.zeros((2, 5, 16), np.float32), np.zeros((2, 6), np.int32)),
      {},
      r"segment_ids must be int \[batch, seq\] = \(2, 5\)",
    ),
    ((np.zeros((2, 5, 16), np.float32), np.zeros((2, 5))), {}, r"segment_ids must be an integer array"),
    ((np.zeros((2, 5, 16), np.float32),), {"positions": np.zeros((1, 5), np.int32)}, r"positions must be int"),
  ],
)
def test_layer_input_errors_name_the_argument(layer, args, kw, match):
  with pytest.raises(ValueError, match=match):
    layer(*(jnp.asarray(a) for a in args), **{k: jnp.asarray(v) for k, v in kw.items()})


def test_python_api_errors_name_python_arguments():
  for kw, name in (
    (dict(n_heads=3), "n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(n_heads=4, gate="x"), "gate"),
  ):
    with pytest.raises(ValueError, match=name) as err:
      FirstPassageAttention.from_args(16, rngs=nnx.Rngs(0), **kw)
    assert "--set" not in str(err.value)
