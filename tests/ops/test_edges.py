"""Edge cases of the attention ops, the same in every impl: level = +inf (a dead key), log_fgate > 0
(FoX), empty inputs (batch 0 / seq 0), and the chunked backward pass under another XLA:CPU
optimisation level (backends fuse differently; no inf - inf or 0 * inf may hide in a pullback).

Small shapes throughout; values against the float64 numpy loop reference, gradients against the
quadratic impl (itself checked against finite differences of the reference in test_ops_grad).
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_bitwise, assert_close, rtol
from fpa_jax import ops
from fpa_jax.ops import bias, chunked
from fpa_jax.ops import reference_np as ref

INF = np.inf
B, T, H, D, DV, BLK = 1, 12, 2, 3, 2, 4
# (impl, block_size, skip_tolerance): every path a level of +inf must survive. chunked at tile 4
# runs the in-tile scan on its diagonal tiles; the sub-tiled diagonal path is checked below.
IMPLS = [
  ("quadratic", None, None),
  ("recurrent", None, None),
  ("chunked", BLK, None),
  ("chunked", BLK, 1e-3),
  ("pallas", 8, None),
]
NAMES = ("q", "k", "v", "field", "level")


def _inputs(seed, b=B, t=T, h=H, dead_block=True):
  """fp32-representable float64 q, k, v, field, level, ct; some levels +inf (all of the first key
  block of batch 0, head 0, so the tile after next is dead for the skipping path), field finite
  with +-1e3 excursions."""
  rng = np.random.default_rng(seed)
  f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)
  q, k = (f32(rng.normal(size=(b, t, h, D))) for _ in range(2))
  v = f32(rng.normal(size=(b, t, h, DV)))
  field = np.cumsum(rng.normal(size=(b, t, h)), 1)
  field = np.where(rng.random((b, t, h)) < 0.2, rng.choice([-1e3, 1e3], size=(b, t, h)), field)
  level = field + rng.normal(size=(b, t, h))
  level = np.where(rng.random((b, t, h)) < 0.3, INF, level)
  if dead_block:
    level[0, :BLK, 0] = INF
  ct = f32(rng.normal(size=(b, t, h, DV)))
  return q, k, v, f32(field), f32(level), ct


@functools.partial(jax.jit, static_argnames=("impl", "blk", "tol"))
def _value_and_grads(q, k, v, field, level, ct, *, impl, blk, tol):
  def loss(q, k, v, field, level):
    out = ops.fpa_attention(q, k, v, field, level, impl=impl, block_size=blk, skip_tolerance=tol)
    return jnp.sum(out * ct), out

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, field, level)


def _grads(args, ct, impl, blk, tol):
  """(out, [d/dq, d/dk, d/dv, d/dfield, d/dlevel]) of sum(out * ct), numpy."""
  j = lambda x: jnp.asarray(x, jnp.float32)
  (_, out), g = _value_and_grads(*map(j, args), j(ct), impl=impl, blk=blk, tol=tol)
  return np.asarray(out), [np.asarray(x) for x in g]


# ----------------------------------------------------------------------------- level = +inf


def test_inf_level_penalty_matches_reference():
  _, _, _, field, level, _ = _inputs(0)
  got = np.asarray(
    ops.first_passage_penalty(
      jnp.asarray(np.swapaxes(field, 1, 2), jnp.float32), jnp.asarray(np.swapaxes(level, 1, 2), jnp.float32)
    )
  )
  for b in range(B):
    for h in range(H):
      want = ref.penalty_np(field[b, :, h], level[b, :, h])
      assert np.all(np.diag(got[b, h]) == 0.0), "the diagonal (empty range) is never penalised"
      np.testing.assert_array_equal(np.isinf(got[b, h]), np.isinf(want))
      fin = np.isfinite(want)
      assert_close(got[b, h][fin], want[fin], n=T)
  # cache_penalty (the decode state) agrees: +inf keys are dead once a field value is seen.
  cache = ops.init_recurrent_cache(1, 3, 1, 2)
  x = jnp.zeros((1, 1, 2))
  for fld, lvl in ((0.5, INF), (0.2, 0.0), (0.7, INF)):
    g = lambda v: jnp.full((1, 1), v, jnp.float32)
    _, cache = ops.decode_step(cache, x, x, x, g(fld), g(lvl), scale=1.0)
  assert np.asarray(ops.cache_penalty(cache))[0, :, 0].tolist() == [INF, 0.0, 0.0]


@pytest.fixture(scope="module")
def inf_case():
  args, ct = _inputs(1)[:5], _inputs(1)[5]
  want = ref.fpa_attention_np(*args)
  out_q, g_q = _grads(args, ct, "quadratic", None, None)
  return args, ct, want, out_q, g_q


@pytest.mark.parametrize(  # the skipping and pallas cases are heavy compiles: -m slow
  "impl,blk,tol", IMPLS[:3] + [pytest.param(*c, marks=pytest.mark.slow) for c in IMPLS[3:]]
)
def test_inf_level_every_impl_agrees_values_and_grads(inf_case, impl, blk, tol):
  args, ct, want, _, g_q = inf_case
  out, g = _grads(args, ct, impl, blk, tol)
  assert np.all(np.isfinite(out)), impl
  assert_close(out, want, n=T)
  # A +inf key: dead off its diagonal, penalty exactly 0 on it: no level gradient anywhere.
  dead = np.isinf(args[4])
  for name, x, w in zip(NAMES, g, g_q):
    assert np.all(np.isfinite(x)), (impl, name)
    assert_close(x, w, n=T, err_msg=f"{impl} d/d{name} vs quadratic")
  assert np.all(g[4][dead] == 0.0), "a dead key's level gets no gradient"
  if tol is not None:  # the first key block of (batch 0, head 0) is dead for query block 2 on
    dead_tiles = np.asarray(
      chunked.dead_tiles(
        *(jnp.asarray(a, jnp.float32) for a in args[:2]),
        bias.FPABias(*(jnp.asarray(a, jnp.float32) for a in args[3:])),
        skip_tolerance=tol,
        block_size=blk,
      )
    )
    assert dead_tiles[0, 0, 2, 0] and dead_tiles[0, 0, 2:, 0].all()


@pytest.mark.parametrize("impl,blk,tol", IMPLS)
def test_all_dead_rows_normalise_to_the_diagonal(impl, blk, tol):
  # Every level +inf and a finite field: each query keeps only its own key, out_i = v_i.
  q, k, v, field, _, ct = _inputs(2, b=1, dead_block=False)
  level = np.full_like(field, INF)
  out, g = _grads((q, k, v, field, level), ct, impl, blk, tol)
  assert_close(out, v, n=T)
  assert_close(g[2], ct, n=T)  # d/dv = ct: all weight on the diagonal
  # The rest vanishes up to the rounding of ds = p (do.v_i - do.o_i) with o_i = v_i.
  for name, x in zip(("q", "k", "field", "level"), (g[0], g[1], g[3], g[4])):
    assert_close(x, np.zeros_like(x), n=T, scale=np.abs(ct).max() * np.abs(v).max(), err_msg=f"{impl} d/d{name}")


def test_inf_level_sub_tiled_diagonal_matches_quadratic(monkeypatch):
  # The sub-tiled diagonal path (tiles of >= 2 * DIAG_SUB tokens), at a small DIAG_SUB.
  monkeypatch.setattr(bias, "DIAG_SUB", 4)
  args, ct = _inputs(3, b=1, t=12)[:5], _inputs(3, b=1, t=12)[5]
  assert bias._diag_sub(8) == 4
  out_q, g_q = _grads(args, ct, "quadratic", None, None)
  out, g = _grads(args, ct, "chunked", 8, None)  # traced only here (block 8): the patched DIAG_SUB
  assert_close(out, ref.fpa_attention_np(*args), n=12)
  for name, x, w in zip(NAMES, g, g_q):
    assert np.all(np.isfinite(x)), name
    assert_close(x, w, n=12, err_msg=f"sub-tiled d/d{name}")


# ----------------------------------------------------------------------------- field +inf, level -inf


@pytest.fixture(scope="module")
def other_inf_case():
  """The other infinities `ops.validate.ALLOWED` allows: field +inf (a token that lowers no minimum,
  a whole run of them in batch 0, head 1) and level -inf (a key never penalised), beside +inf levels."""
  q, k, v, field, level, ct = _inputs(5)
  rng = np.random.default_rng(5)
  field = np.where(rng.random(field.shape) < 0.25, INF, field)
  field[0, 3:7, 1] = INF
  level = np.where(rng.random(level.shape) < 0.2, -INF, level)
  args = (q, k, v, field, level)
  return args, ct, ref.fpa_attention_np(*args), _grads(args, ct, "quadratic", None, None)[1]


@pytest.mark.parametrize("impl,blk,tol", IMPLS)
def test_field_plus_inf_and_level_minus_inf_every_impl_agrees(other_inf_case, impl, blk, tol):
  args, ct, want, g_q = other_inf_case
  out, g = _grads(args, ct, impl, blk, tol)
  assert_close(out, want, n=T)
  for name, x, w in zip(NAMES, g, g_q):
    assert np.all(np.isfinite(x)), (impl, name)
    assert_close(x, w, n=T, err_msg=f"{impl} d/d{name} vs quadratic")
  assert np.all(g[3][np.isinf(args[3])] == 0.0), "a +inf field value is never the minimum that bites"
  assert np.all(g[4][np.isneginf(args[4])] == 0.0), "a -inf level is never penalised"
  if impl == "chunked" and tol is not None:  # the key-sparse forward too
    j = lambda x: jnp.asarray(x, jnp.float32)
    sparse = ops.fpa_attention(*map(j, args), block_size=blk, skip_tolerance=tol, skip="keys")
    vmax = np.abs(args[2]).max()
    assert np.abs(np.asarray(sparse) - want).max() <= 2 * tol * vmax + rtol(np.float32, T) * vmax
    loss = lambda *a: jnp.sum(ops.fpa_attention(*a, block_size=blk, skip_tolerance=tol, skip="keys") * j(ct))
    for name, x, w in zip(NAMES, jax.grad(loss, argnums=tuple(range(5)))(*map(j, args)), g_q):
      assert np.all(np.isfinite(x)), ("keys", name)
      assert_close(x, w, n=T, err_msg=f"keys d/d{name} vs quadratic")


# ----------------------------------------------------------------------------- FoX log_fgate > 0


def _fox_inputs(seed):
  rng = np.random.default_rng(seed)
  q, k, v, ct = (jnp.asarray(rng.normal(size=(1, 9, 2, 3)), jnp.float32) for _ in range(4))
  lf = jnp.asarray(jax.nn.log_sigmoid(rng.normal(size=(1, 9, 2)) + 1.0), jnp.float32)
  # Positive entries only where the tests put them. (An exact 0 elsewhere would put the FPA
  # special case of quadratic / recurrent on a relu kink, c_j = c_i, where its subgradient is not
  # FoX's; at a clamped entry both give 0 for that entry and equal ones for all others.)
  return q, k, v, lf.at[0, 3].set(0.5).at[0, 6, 1].set(2.0), ct


def test_positive_log_fgate_raises_on_concrete_arrays():
  q, k, v, lf, _ = _fox_inputs(4)
  for impl in ("quadratic", "chunked", "recurrent", "pallas", "auto"):
    with pytest.raises(ValueError, match=r"log_fgate must be <= 0: pass jax.nn.log_sigmoid\(f\)"):
      ops.fox_attention(q, k, v, lf, impl=impl)
    with pytest.raises(ValueError, match="log_fgate must be <= 0"):
      ops.fox_attention(q, k, v, np.asarray(lf), impl=impl)  # numpy arrays are concrete too


def test_log_fgate_closed_over_by_a_jitted_function_is_checked_not_traced():
  """A concrete log_fgate captured by a jitted function: checked like any concrete array (it used
  to raise a TracerBoolConversionError there, the check itself being traced)."""
  q, k, v, lf, _ = _fox_inputs(4)
  ok = -jnp.abs(lf)  # concrete jax arrays, made outside the traced functions
  bad = jnp.abs(lf) + 1.0
  out = jax.jit(lambda q: ops.fox_attention(q, k, v, ok, block_size=8))(q)
  assert_close(out, ref.fox_attention_np(q, k, v, np.asarray(ok, np.float64)), n=q.shape[1])
  with pytest.raises(ValueError, match="log_fgate must be <= 0"):
    jax.jit(lambda q: ops.fox_attention(q, k, v, bad, block_size=8))(q)


def test_positive_log_fgate_under_jit_is_clamped_in_every_impl():
  q, k, v, lf, ct = _fox_inputs(5)
  clamped = np.minimum(np.asarray(lf, np.float64), 0.0)
  want = ref.fox_attention_np(q, k, v, clamped)

  @jax.jit
  def run(q, k, v, lf):
    outs, grads = [], []
    for impl, blk in (("quadratic", None), ("chunked", 4), ("recurrent", None), ("pallas", 8)):
      f = lambda lf: (lambda o: (jnp.sum(o * ct), o))(ops.fox_attention(q, k, v, lf, impl=impl, block_size=blk))
      (_, out), g = jax.value_and_grad(f, has_aux=True)(lf)
      outs.append(out)
      grads.append(g)
    return outs, grads

  outs, grads = run(q, k, v, lf)
  for out in outs:
    assert_close(np.asarray(out), want, n=9)
  pos = np.asarray(lf) > 0
  for g in grads:
    assert_close(np.asarray(g), np.asarray(grads[0]), n=9)
    assert np.all(np.asarray(g)[pos] == 0.0), "a clamped gate gets no gradient"
  assert np.abs(np.asarray(grads[0])[~pos]).max() > 1e-3


# ----------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("b,t", [(0, 5), (2, 0)])
@pytest.mark.parametrize("impl", ["quadratic", "chunked", "recurrent", "pallas", "auto"])
def test_empty_inputs_give_empty_outputs_and_grads(b, t, impl):
  q, k = jnp.zeros((b, t, 4, 3)), jnp.zeros((b, t, 2, 3))
  v, g = jnp.zeros((b, t, 2, 5)), jnp.zeros((b, t, 2))
  fns = {
    "fpa": lambda q, k, v, g: ops.fpa_attention(q, k, v, g, g, impl=impl),
    "fox": lambda q, k, v, g: ops.fox_attention(q, k, v, g, impl=impl),
  }
  if impl == "quadratic":
    fns["softmax"] = lambda q, k, v, g: ops.softmax_attention(q, k, v)
  for name, fn in fns.items():
    out = fn(q, k, v, g)
    assert out.shape == (b, t, 4, 5) and out.dtype == q.dtype, name
    assert jax.jit(fn)(q, k, v, g).shape == (b, t, 4, 5)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2, 3))(q, k, v, g)
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, g.shape], name
  with pytest.raises(ValueError, match="block_size"):  # still validated when there is nothing to run
    ops.fpa_attention(q, k, v, g, g, impl="chunked", block_size=0)


# ----------------------------------------------------------------------------- XLA opt level 0

_O0_SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from _tol import assert_bitwise, assert_close, rtol
from fpa_jax import ops
rng = np.random.default_rng(0)
b, t, h, d = 1, 10, 1, 2
q, k, v, ct = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(4))
field = np.cumsum(rng.normal(size=(b, t, h)), 1)
field = np.where(rng.random((b, t, h)) < 0.3, rng.choice([-1e3, 1e3], size=(b, t, h)), field)
level = np.where(rng.random((b, t, h)) < 0.3, np.inf, field + rng.normal(size=(b, t, h)))
field, level = jnp.asarray(field, jnp.float32), jnp.asarray(level, jnp.float32)
seg = jnp.asarray([[0, 0, 1, 0, 0, 0, 1, 1, 2, 0]], jnp.int32)  # query rows masked in whole tiles

def grads(impl, blk):
  f = lambda *a: jnp.sum(ops.fpa_attention(*a, impl=impl, block_size=blk, segment_ids=seg) * ct)
  return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k, v, field, level)

want = grads("quadratic", None)
for name, g, w in zip("q k v field level".split(), grads("chunked", 4), want):
  assert np.all(np.isfinite(np.asarray(g))), name
  assert_close(np.asarray(g), np.asarray(w), n=t, err_msg=name)

# The model case that found it: one 32-token tile (nb = 1), whose block minima get a zero cotangent;
# their reduce-min pullback divided it by a tie count of 0 (`test_block_min_grad_finite_at_xla_opt_level_0`).
from flax import nnx
from fpa_jax.configs import get_config
from fpa_jax.models import DecoderLM
tok = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 33)), jnp.int32)  # failed before the fix
def model_grads(impl):
  model = DecoderLM(get_config("tiny", attention="fpa", attn_impl=impl, n_layers=1).model, rngs=nnx.Rngs(0))
  def loss(m):
    lg = jax.nn.log_softmax(m(tok[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(lg, tok[:, 1:, None], -1))
  return jax.tree.leaves(nnx.state(nnx.jit(nnx.grad(loss))(model)))
flat = lambda leaves: np.concatenate([np.ravel(x) for x in leaves])
g, w = flat(model_grads("chunked")), flat(model_grads("quadratic"))
assert np.all(np.isfinite(g))
assert_close(g, w, n=32)  # one scale for all: some leaves are ~1e-9 sums that cancel
print("OK")
"""


def _run_at_level_0(script: str) -> None:
  """Run `script` in a fresh interpreter (XLA_FLAGS is read when jax initialises its backend) at
  XLA's backend optimisation level 0; it must print OK."""
  tests = pathlib.Path(__file__).resolve().parents[1]  # tests/ (its helpers), then the repository
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent), env.get("PYTHONPATH", "")])
  res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
  assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow  # a level users do not run; with its xfail sibling
def test_chunked_grads_finite_at_xla_opt_level_0():
  _run_at_level_0(_O0_SCRIPT)


_O0_TILES_SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from fpa_jax.configs import get_config
from fpa_jax.models import build_model
cfg = get_config("tiny", seq_len=40, block_size=8, attn_impl="chunked")  # 5 tiles, 2 layers
model = build_model(cfg, seed=0)
tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 41)), jnp.int32)
def loss(m):
  lg = jax.nn.log_softmax(m(tok[:, :-1]))
  return -jnp.mean(jnp.take_along_axis(lg, tok[:, 1:, None], -1))
g = nnx.state(nnx.jit(nnx.grad(loss))(model))
bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(g) if not np.all(np.isfinite(x))]
assert not bad, bad
print("OK")
"""


@pytest.mark.slow  # a level users do not run; the block-min check below is its fast sibling
def test_chunked_model_grads_finite_at_xla_opt_level_0_with_several_tiles():
  _run_at_level_0(_O0_TILES_SCRIPT)


# The mechanism alone, what the two scripts above found inside the model: XLA duplicates the field
# (a cumsum plus a matmul's output times a scale) into the block minimum's fusion and into the
# fusion of its reduce-min pullback, which counts the entries equal to the min and divides by the
# count; at level 0 one copy is compiled as multiply then add and the other as an FMA, so where they
# round differently at the minimum the count is 0 and the gradient 0/0 = NaN (about a third of
# these seeds before `block_stats` took the minimum as a gather at its argmin).
_O0_BLOCK_MIN_SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from fpa_jax.ops.first_passage import block_stats
def loss(w, x):
  r = 10 * (x @ w)
  phi = (jnp.cumsum(r[:, 0]) + r[:, 1]).reshape(1, 2, 8)  # 2 blocks of 8
  return sum(jnp.sum(s) for s in block_stats(phi))
grad = jax.jit(jax.grad(loss))
for seed in range(16):
  rng = np.random.default_rng(seed)
  x, w = rng.normal(size=(16, 8)), rng.normal(size=(8, 2)) * 0.01
  g = np.asarray(grad(jnp.asarray(w, jnp.float32), jnp.asarray(x, jnp.float32)))
  assert np.all(np.isfinite(g)), seed
print("OK")
"""


def test_block_min_grad_finite_at_xla_opt_level_0():
  _run_at_level_0(_O0_BLOCK_MIN_SCRIPT)


def test_first_passage_state_is_one_definition_equal_to_the_reference():
  """The decode state (`ops.first_passage`: advance per token, suffix_min for a prompt, penalty)
  equals the float64 loop penalty at every step, +inf levels included; `decode_step`, the
  inference caches and the budget simulation all use these functions."""
  from fpa_jax.ops import first_passage as fp

  rng = np.random.default_rng(3)
  t, h = 9, 2
  field = rng.normal(size=(1, t, h)).astype(np.float32)
  level = (field + rng.normal(size=(1, t, h))).astype(np.float32)
  level[0, 2, 0] = np.inf  # dead once any finite field value follows it, live on its diagonal
  want = np.stack([ref.penalty_np(field[0, :, i], level[0, :, i]) for i in range(h)], -1)  # [T, T, H]
  run_min = jnp.full((1, t, h), jnp.inf)
  for i in range(t):  # decode: lower every earlier key's minimum, then write key i with +inf
    run_min = fp.advance(run_min, jnp.asarray(field[:, i])[:, None, :]).at[:, i].set(jnp.inf)
    got = np.asarray(fp.penalty(jnp.asarray(level), run_min))[0, : i + 1]
    assert_bitwise(got, want[i, : i + 1].astype(np.float32))
  prefill = fp.penalty(jnp.asarray(level), fp.suffix_min(jnp.asarray(field), axis=1))
  assert_bitwise(np.asarray(prefill)[0], want[-1].astype(np.float32))
