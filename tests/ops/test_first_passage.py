"""The first-passage core (`fpa_jax.ops.first_passage`) against the float64 loop reference.

Every form of min field over (j, i] -- the decode recurrence, the prompt's suffix min, the
associative scan, the tile identity and the sparse table -- gives the loop penalty
`reference_np.penalty_np` bit for bit (min is exact and one fp32 subtraction is correctly rounded,
so the float64 loop rounded to fp32 is the fp32 result), +inf levels included. Gradients: each
differentiable form's fp32 `jax.grad` against central finite differences of the float64 loop, on
kink-free gates (`test_ops_grad.kink_free_gates`: every level - field difference and every two
fields far apart from each other at the FD step). The eviction rules against plain loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_bitwise, assert_close
from fpa_jax.ops import first_passage as fp
from fpa_jax.ops import reference_np as ref
from fpa_jax.ops.penalty import first_passage_penalty
from test_grad import kink_free_gates

T, BLK = 12, 4  # three blocks: one pair (2, 0) with a block between, for R


def _gates(seed, t=T, inf_level=True):
  """field, level [t] fp32: a random walk and levels around it; one +inf level (a dead key)."""
  rng = np.random.default_rng(seed)
  field = np.cumsum(rng.normal(size=t)).astype(np.float32)
  level = (field + rng.normal(scale=1.5, size=t)).astype(np.float32)
  if inf_level:
    level[2] = np.inf
  return field, level


def _want(field, level):
  """The loop penalty [T, T] in fp32, 0 above the diagonal (where the forms below put 0)."""
  pen = ref.penalty_np(field, level)
  return np.where(np.tril(np.ones(pen.shape, bool)), pen, 0.0).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# The forms of min over (j, i], as [T] field, level -> [T, T] penalty (0 above the diagonal)
# ------------------------------------------------------------------------------------------------


def decode_form(field, level):
  """One token at a time: `advance` every earlier key, write the new one with +inf."""
  t = field.shape[0]
  run_min, rows = jnp.full((t,), jnp.inf), []
  for i in range(t):
    run_min = jnp.where(jnp.arange(t) < i, fp.advance(run_min, field[i]), jnp.inf)
    rows.append(jnp.where(jnp.arange(t) <= i, fp.penalty(level, run_min), 0.0))
  return jnp.stack(rows)


def sampled_form(field, level):
  """Every query sampled at once (`run_min_at`): [B=1, Q=T, T, H=1]."""
  t = field.shape[0]
  run_min = fp.run_min_at(field[None, :, None], jnp.arange(t)[None])
  return fp.penalty(level[None, None, :, None], run_min)[0, :, :, 0]


def scan_form(field, level):
  pen = first_passage_penalty(field, level)
  return jnp.where(jnp.tril(jnp.ones(pen.shape, bool)), pen, 0.0)


def tile_form(field, level, blk=BLK):
  """The tiling identity: min(S_j, R[I, J], C_i) off the diagonal blocks, `column_min` on them."""
  t = field.shape[0]
  nb = t // blk
  s, c, r = fp.block_stats(field.reshape(nb, blk))
  diag = fp.column_min(field.reshape(nb, blk))  # [nb, blk, blk]
  rows = []
  for ib in range(nb):
    cols = []
    for jb in range(nb):
      if jb < ib:
        cols.append(jnp.minimum(jnp.minimum(s[jb][None, :], r[ib, jb]), c[ib][:, None]))
      elif jb == ib:
        cols.append(diag[ib])
      else:
        cols.append(jnp.full((blk, blk), jnp.inf))
    rows.append(jnp.concatenate(cols, 1))
  m = jnp.concatenate(rows, 0)
  return fp.penalty(level[None, :], m)


def table_form(field, level):
  """The sparse table: min(N_k[j], M_k[i]) for 2^k <= i - j < 2^(k+1)."""
  t = field.shape[0]
  ms, ns = fp.window_mins(field, fp.n_levels(t))
  dist = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
  m = fp.table_min([n[None, :] for n in ns], [x[:, None] for x in ms], dist)
  return fp.penalty(level[None, :], m)


FORMS = {"decode": decode_form, "sampled": sampled_form, "scan": scan_form, "tile": tile_form, "table": table_form}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_form_is_the_loop_penalty_bitwise(form, seed):
  field, level = _gates(seed)
  got = np.asarray(FORMS[form](jnp.asarray(field), jnp.asarray(level)))
  assert_bitwise(got, _want(field, level), err_msg=form)
  assert np.isinf(got[5:, 2]).all() and got[2, 2] == 0.0  # the +inf level: dead after its diagonal


def test_ties_and_a_flat_field():
  """Equal field values everywhere (the min is set by many tokens at once) and a constant field."""
  rng = np.random.default_rng(4)
  for field in (np.cumsum(rng.integers(-1, 2, size=T)).astype(np.float32), np.zeros(T, np.float32)):
    level = field + rng.integers(-1, 2, size=T).astype(np.float32)
    for name, form in FORMS.items():
      assert_bitwise(np.asarray(form(jnp.asarray(field), jnp.asarray(level))), _want(field, level), err_msg=name)


def test_suffix_min_and_the_prompt_state():
  """`suffix_min` along any axis is the loop min over (j, end), +inf for the last key; masked-out
  tokens (+inf) drop out of every range."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, T, 2)).astype(np.float32)
  want = np.stack([[min(x[b, j + 1 :, h], default=np.inf) for j in range(T)] for b in range(3) for h in range(2)])
  got = np.asarray(fp.suffix_min(jnp.asarray(x), axis=1)).transpose(0, 2, 1).reshape(6, T)
  assert_bitwise(got, want.astype(np.float32))
  assert_bitwise(np.asarray(fp.suffix_min(jnp.asarray(x), axis=-2)), np.asarray(fp.suffix_min(jnp.asarray(x), 1)))


def test_dip_on_infinite_values():
  inf = np.inf
  level = jnp.asarray([inf, inf, -inf, 1.0, 1.0, 2.0])
  low = jnp.asarray([inf, 0.0, 0.0, inf, 2.0, 0.5])
  assert np.asarray(fp.dip(level, low)).tolist() == [0.0, inf, 0.0, 0.0, 0.0, 1.5]
  gl, gm = jax.grad(lambda a, b: jnp.sum(fp.dip(a, b)), argnums=(0, 1))(level, low)
  assert np.asarray(gl).tolist() == [0, 1, 0, 0, 0, 1] and np.asarray(gm).tolist() == [0, -1, 0, 0, 0, -1]


# ------------------------------------------------------------------------------------------------
# Gradients against finite differences of the float64 loop
# ------------------------------------------------------------------------------------------------


def _fd_np(field, level, ct, eps=1e-5):
  """Central FD of sum(ct * penalty_np) over the causal pairs, w.r.t. field and level (float64)."""
  causal = np.tril(np.ones(ct.shape, bool))
  loss = lambda f, lv: float(np.sum(np.where(causal, ct * np.where(causal, ref.penalty_np(f, lv), 0.0), 0.0)))
  grads = []
  for n in range(2):
    g = np.zeros(T)
    for s in range(T):
      plus, minus = [field.copy(), level.copy()], [field.copy(), level.copy()]
      plus[n][s] += eps
      minus[n][s] -= eps
      g[s] = (loss(*plus) - loss(*minus)) / (2 * eps)
    grads.append(g)
  return grads


@pytest.mark.parametrize("form", FORMS)
def test_gradients_match_fd_of_the_loop(form):
  rng = np.random.default_rng(6)
  field, level = (x[0, :, 0] for x in kink_free_gates(rng, 1, T, 1))
  ct = rng.normal(size=(T, T)).astype(np.float32).astype(np.float64)
  want = _fd_np(field, level, ct)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss = lambda f, lv: jnp.sum(f32(np.tril(ct)) * FORMS[form](f, lv))
  got = jax.grad(loss, argnums=(0, 1))(f32(field), f32(level))
  for name, g, w in zip(("field", "level"), got, want):
    # each entry sums <= T^2 cotangents; the FD of a piecewise-linear loss is exact up to rounding
    assert_close(g, w, dtype=np.float32, n=T * T, err_msg=f"{form}: d/d{name}")


def test_gradient_of_a_dead_key_level_is_zero():
  field, level = _gates(7)

  def loss(lv):
    pen = tile_form(jnp.asarray(field), lv)
    return jnp.sum(jnp.where(jnp.isfinite(pen), pen, 0.0))

  g = jax.grad(loss)(jnp.asarray(level))
  assert np.all(np.isfinite(np.asarray(g))) and float(g[2]) == 0.0


# ------------------------------------------------------------------------------------------------
# The eviction rule
# ------------------------------------------------------------------------------------------------


def test_a_key_past_the_threshold_never_comes_back():
  """`survives` along a decode: once a key's penalty reaches tau it stays there (run_min only falls)."""
  rng = np.random.default_rng(8)
  t, tau = 40, 1.0
  field = jnp.asarray(np.cumsum(rng.normal(size=(3, t)), 1), jnp.float32)
  level = field + jnp.asarray(rng.normal(size=(3, t)), jnp.float32)
  run_min, gone = jnp.full((3, t), jnp.inf), jnp.zeros((3, t), bool)
  for i in range(t):
    run_min = jnp.where(jnp.arange(t) < i, fp.advance(run_min, field[:, i : i + 1]), jnp.inf)
    alive = fp.survives(fp.penalty(level, run_min), tau)
    assert not np.any(np.asarray(gone & alive)), f"a key came back at step {i}"
    gone = gone | ~alive
  assert np.asarray(gone).any()


def _victim_loop(pen, pos, held, now, recent):
  cand = [s for s in range(len(pen)) if held[s] and pos[s] <= now - recent] or [s for s in range(len(pen)) if held[s]]
  if not cand:
    return None
  best = max(pen[s] for s in cand)
  return min((s for s in cand if pen[s] == best), key=lambda s: pos[s])


@pytest.mark.parametrize("recent", [0, 2, 5])
def test_victim_is_the_largest_penalty_oldest_on_ties(recent):
  rng = np.random.default_rng(9 + recent)
  b, s = 64, 10
  pen = rng.integers(0, 3, size=(b, s)).astype(np.float32)  # many ties
  pen[rng.random((b, s)) < 0.1] = np.inf  # dead keys go first
  pos = np.stack([rng.permutation(20)[:s] for _ in range(b)]).astype(np.int32)  # slots out of order
  held = rng.random((b, s)) < 0.8
  now = pos.max(1) + 1
  got = np.asarray(fp.victim(*map(jnp.asarray, (pen, pos, held)), jnp.asarray(now)[:, None], recent))
  for r in range(b):
    want = _victim_loop(pen[r], pos[r], held[r], now[r], recent)
    assert want is None or got[r] == want, (r, got[r], want)
  # a traced window (the budget simulation's) picks the same keys
  traced = jax.jit(lambda w: fp.victim(*map(jnp.asarray, (pen, pos, held)), jnp.asarray(now)[:, None], w))
  assert_bitwise(traced(jnp.int32(recent)), got)


def test_evict_largest_is_the_global_order():
  rng = np.random.default_rng(10)
  b, n = 16, 24
  pen = rng.integers(0, 4, size=(b, n)).astype(np.float32)
  pos = rng.integers(0, 6, size=(b, n)).astype(np.int32)
  owner = rng.integers(0, 4, size=(b, n)).astype(np.int32)
  cand = rng.random((b, n)) < 0.7
  count = rng.integers(0, 12, size=b).astype(np.int32)
  got = np.asarray(fp.evict_largest(*map(jnp.asarray, (pen, pos, owner, cand, count))))
  for r in range(b):
    order = sorted((s for s in range(n) if cand[r, s]), key=lambda s: (-pen[r, s], pos[r, s], owner[r, s], s))
    assert set(np.flatnonzero(got[r])) == set(order[: count[r]]), r
