"""The evictability objective: the soft live count against a float64 loop reference (values and
gradients), the kink, the objective through a tiny model (its gradient reaches the gate; off is the
old LM loss bit for bit), its config checks, and the model's per-layer gate outputs."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers_train import FixedBatch, train_fixed
from _tol import assert_bitwise, assert_close
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import losses, train
from fpa_jax.layers import with_gates
from fpa_jax.models import build_model
from fpa_jax.ops import evictability as E

# ------------------------------------------------------------------------------------------------
# Float64 loop reference, straight from the definition in fpa_jax.ops.evictability
# ------------------------------------------------------------------------------------------------


def live_counts_np(field, level, query_idx, *, window, tau, temp, soft=0.0, segment_ids=None):
  """-> (soft [B, Q, H], hard [B, Q, H], eligible [B, Q]) float64, by loops."""
  field, level = np.asarray(field, np.float64), np.asarray(level, np.float64)
  b_, t, h_ = field.shape
  qs = np.asarray(query_idx)
  nq = qs.shape[1]
  soft_out, hard_out, elig_out = np.zeros((b_, nq, h_)), np.zeros((b_, nq, h_)), np.zeros((b_, nq))
  for b in range(b_):
    for q in range(nq):
      i = int(qs[b, q])
      for j in range(t):
        if j > i - window or (segment_ids is not None and segment_ids[b, j] != segment_ids[b, i]):
          continue
        elig_out[b, q] += 1
        for h in range(h_):
          if j == i:
            d = -math.inf  # empty range (j, i]: penalty 0
          else:
            d = level[b, j, h] - min(field[b, s, h] for s in range(j + 1, i + 1))
          hard = max(0.0, d)
          pen = hard if soft == 0 else (0.0 if d == -math.inf else soft * np.logaddexp(0.0, d / soft))
          soft_out[b, q, h] += 1.0 / (1.0 + math.exp(-(tau - pen) / temp))
          hard_out[b, q, h] += float(hard < tau)
  return soft_out, hard_out, elig_out


def kink_free(rng, b, t, h):
  """field: distinct multiples of 1/4 per (b, h); level: odd multiples of 1/8 (every level - field
  difference >= 1/8 from 0, fields >= 1/4 apart: no relu / min kink within an FD step)."""
  field = np.stack([np.stack([rng.permutation(2 * t)[:t] - t for _ in range(h)], -1) for _ in range(b)]) * 0.25
  level = (rng.integers(-t, t, size=(b, t, h)) + 0.5) * 0.25
  return field.astype(np.float64), level.astype(np.float64)


@functools.partial(jax.jit, static_argnames=("window", "tau", "temp", "soft"))
def live_counts_jit(field, level, q, segment_ids=None, **kw):
  return E.live_counts(field, level, q, segment_ids=segment_ids, **kw)


def jax_counts(field, level, q, seg=None, **kw):
  c = live_counts_jit(
    jnp.asarray(field, jnp.float32),
    jnp.asarray(level, jnp.float32),
    jnp.asarray(q),
    **kw,
    segment_ids=None if seg is None else jnp.asarray(seg),
  )
  return [np.asarray(a) for a in c]


# (B, T, H, Q, window, soft, segments)
CASES = [
  (2, 9, 2, 3, 2, 0.0, False),
  (1, 12, 3, 4, 0, 0.5, False),
  (2, 10, 1, 5, 3, 0.3, True),
  (1, 1, 2, 2, 0, 0.5, False),  # T = 1: the query itself only (W = 0)
  (1, 1, 2, 2, 1, 0.0, False),  # T = 1, W = 1: no eligible key
  (2, 6, 2, 3, 6, 0.5, False),  # W >= T: nothing eligible, counts 0
  (2, 6, 2, 3, 9, 0.0, True),
]


@pytest.mark.parametrize("b,t,h,nq,w,soft,seg", CASES)
def test_live_counts_match_loop_reference(b, t, h, nq, w, soft, seg):
  rng = np.random.default_rng(100 * t + w)
  field, level = rng.normal(size=(b, t, h)) * 2, rng.normal(size=(b, t, h)) * 2
  q = np.asarray(E.sample_queries(jax.random.key(t), b, t, nq, w))
  assert q.shape == (b, nq) and q.dtype == np.int32 and (q >= 0).all() and (q < t).all()
  segs = np.sort(rng.integers(1, 3, size=(b, t)), axis=1) if seg else None
  kw = dict(window=w, tau=1.0, temp=0.7, soft=soft)
  got = jax_counts(field, level, q, segs, **kw)
  want = live_counts_np(field, level, q, segment_ids=segs, **kw)
  for g, r, name in zip(got, want, ("soft", "hard", "eligible")):
    assert_close(g, r, dtype=np.float32, n=t, err_msg=name)
  if w >= t:
    assert not got[2].any() and not got[0].any()
    loss, frac = E.hinge_live_fraction(E.LiveCounts(*map(jnp.asarray, got)), 0.5)
    assert float(loss) == 0.0 and not np.asarray(frac).any()


def hinge_np(soft, eligible, target, shared):
  """The hinge by loops in float64: per (row, query), each head's live share of the eligible keys
  (or, shared, their mean over heads) above the target, weighted by the eligible count."""
  b, nq, h = soft.shape
  num = den = 0.0
  for i in range(b):
    for j in range(nq):
      e = float(eligible[i, j])
      fr = [soft[i, j, k] / max(e, 1.0) for k in range(h)]
      if shared:
        num += e * max(sum(fr) / h - target, 0.0)
      else:
        num += sum(e * max(f - target, 0.0) for f in fr)
      den += e
  return num / max((1 if shared else h) * den, 1.0)


@pytest.mark.parametrize("shared", [False, True])
def test_hinge_matches_loop_reference(shared):
  """Per head or one budget shared by the heads (fpa_global's): values and gradients against float64
  loops; shared lets one head keep more where another keeps less (no loss at a mean under target)."""
  rng = np.random.default_rng(7)
  b, nq, h = 3, 5, 4
  eligible = rng.integers(0, 9, size=(b, nq)).astype(np.float64)
  soft = rng.uniform(0, 1, size=(b, nq, h)) * eligible[..., None]
  target = 0.3
  counts = lambda s: E.LiveCounts(s, jnp.zeros_like(s), jnp.asarray(eligible, jnp.float32))  # noqa: E731
  f = lambda s: E.hinge_live_fraction(counts(s), target, shared)[0]  # noqa: E731
  got = f(jnp.asarray(soft, jnp.float32))
  assert_close(got, hinge_np(soft, eligible, target, shared), dtype=np.float32, n=b * nq * h)
  g = np.asarray(jax.grad(f)(jnp.asarray(soft, jnp.float32)), np.float64)
  eps, fd = 1e-6, np.zeros_like(soft)
  for idx in np.ndindex(soft.shape):
    up, dn = soft.copy(), soft.copy()
    up[idx] += eps
    dn[idx] -= eps
    fd[idx] = (hinge_np(up, eligible, target, shared) - hinge_np(dn, eligible, target, shared)) / (2 * eps)
  assert_close(g, fd, dtype=np.float32, n=b * nq * h)
  # one head holding everything, three nothing: a mean of 0.25 under a 0.3 budget costs nothing shared
  lopsided = np.zeros((1, 1, 4))
  lopsided[0, 0, 0] = 8.0
  loss = float(E.hinge_live_fraction(E.LiveCounts(*map(jnp.asarray, (lopsided, lopsided, [[8.0]]))), 0.3, shared)[0])
  assert loss == (0.0 if shared else pytest.approx(0.7 / 4))


@pytest.mark.parametrize("soft", [0.0, 0.5])
def test_live_count_gradients_match_finite_differences(soft):
  b, t, h, nq, w = 2, 7, 2, 3, 1
  rng = np.random.default_rng(3)
  field, level = kink_free(rng, b, t, h)
  q = np.asarray(E.sample_queries(jax.random.key(1), b, t, nq, w))
  ct = rng.normal(size=(b, nq, h))
  kw = dict(window=w, tau=0.6, temp=0.5, soft=soft)

  def f_np(fi, le):
    return float(np.sum(live_counts_np(fi, le, q, **kw)[0] * ct))

  def f_jax(fi, le):
    return jnp.sum(E.live_counts(fi, le, jnp.asarray(q), **kw).soft * ct)

  g_jax = jax.jit(jax.grad(f_jax, argnums=(0, 1)))(jnp.asarray(field, jnp.float32), jnp.asarray(level, jnp.float32))
  eps = 1e-5
  for arg, g in zip((field, level), g_jax):
    fd = np.zeros_like(arg)
    for idx in np.ndindex(arg.shape):
      up, dn = arg.copy(), arg.copy()
      up[idx] += eps
      dn[idx] -= eps
      a = (up, level) if arg is field else (field, up)
      z = (dn, level) if arg is field else (field, dn)
      fd[idx] = (f_np(*a) - f_np(*z)) / (2 * eps)
    assert np.abs(fd).max() > 0
    assert_close(np.asarray(g), fd, dtype=np.float32, n=t)


def test_kink_hard_penalty_gives_no_gradient_soft_does():
  """A key below the running min: relu'(0) = 0 (no pull); the softplus penalty pulls its level up."""
  field = jnp.asarray([[[0.0], [1.0], [1.0], [1.0]]])  # [1, 4, 1]
  level = jnp.asarray([[[-0.5], [0.0], [0.0], [0.0]]])  # key 0 is 1.5 below the running min 1
  q = jnp.asarray([[3]])

  def grads(soft):
    f = lambda fi, le: E.live_counts(fi, le, q, window=1, tau=1.0, temp=0.5, soft=soft).soft.sum()
    return jax.jit(jax.grad(f, argnums=(0, 1)))(field, level)

  gf, gl = grads(0.0)
  assert float(gl[0, 0, 0]) == 0.0 and not np.asarray(gf).any()
  gf, gl = grads(0.5)
  assert float(gl[0, 0, 0]) < 0  # raising the level lowers the live count
  assert float(gf[0, 1:].sum()) > 0  # lowering the field where it is lowest does too


def test_sample_queries_are_stratified():
  q = np.asarray(E.sample_queries(jax.random.key(0), 64, 100, 4, 20))
  assert q.min() >= 20 and q.max() < 100
  for s in range(4):  # stratum s covers [20 + 20 s, 20 + 20 (s + 1))
    assert (q[:, s] >= 20 + 20 * s).all() and (q[:, s] < 40 + 20 * s).all()


# ------------------------------------------------------------------------------------------------
# The objective through a tiny model
# ------------------------------------------------------------------------------------------------


def tiny(**kw):
  # quadratic attention: the objective does not depend on the impl, and its gradient compiles fastest
  return C.get_config("tiny", **{"task": "synthetic", "seq_len": 16, "batch_size": 4, "attn_impl": "quadratic", **kw})


def old_lm_loss(model, batch):
  """train.lm_loss as it was before the loss module (the reference for evict_weight = 0)."""
  logits = model(batch["inputs"], batch["segment_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask)


@pytest.fixture(scope="module")
def batch():
  b = next(FixedBatch(vocab_size=64, seq_len=16, batch_size=4, seed=1))
  b["segment_ids"][:, 10:] = 2  # two packed segments
  return {k: jnp.asarray(v) for k, v in b.items()}


def value_and_grad(model, fn, batch):
  """jit(value_and_grad(fn(model, batch))) w.r.t. the model's params (the batch an argument, as in the step)."""
  gdef, params, rest = nnx.split(model, nnx.Param, ...)
  vg = jax.jit(jax.value_and_grad(lambda p, b: fn(nnx.merge(gdef, p, rest), b), has_aux=True))
  return vg(params, batch)


@pytest.fixture(scope="module")
def lm_path(batch):
  """The tiny model and its objective at evict_weight = 0: (model, value, aux, grads)."""
  cfg = tiny()
  model = build_model(cfg, seed=0)
  (v, aux), g = value_and_grad(model, lambda m, b: losses.objective(m, b, cfg, 5), batch)
  return model, v, aux, g


def test_weight_zero_is_the_old_lm_loss_bit_for_bit(batch, lm_path):
  model, v_new, aux, g_new = lm_path
  (v_old, n_old), g_old = value_and_grad(model, old_lm_loss, batch)
  assert set(aux) == {"lm_sum", "count"}
  assert_bitwise(v_new, v_old)
  assert_bitwise(aux["lm_sum"], v_old)
  assert_bitwise(aux["count"], n_old)
  jax.tree.map(assert_bitwise, g_new, g_old)
  assert train.lm_loss is losses.lm_loss


def flat(tree):
  return {"/".join(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(tree)}


def test_objective_gradient_reaches_the_gate(batch, lm_path):
  """objective - LM objective = count * weight * hinge: its gradient moves every layer's gate
  read-outs and nothing after the last gate (final norm, output head: only the LM's gradient)."""
  model, _, lm_aux, g_lm = lm_path
  cfg = tiny(evict_weight=1.0, evict_target=0.1, evict_window=2, evict_queries=4)
  (tot, aux), g = value_and_grad(model, lambda m, b: losses.objective(m, b, cfg, 0, jax.random.key(0)), batch)
  h = aux["evict_loss"]
  assert float(h) > 0 and 0 < float(aux["evict_live"]) <= 1
  assert {"evict_live_l0", "evict_live_l1", "evict_target", "evict_live_hard"} <= set(aux)
  assert_close(aux["lm_sum"], lm_aux["lm_sum"], n=64 * 64)
  assert_close(tot, aux["lm_sum"] + aux["count"] * h, n=64)
  g, g_lm = flat(g), flat(g_lm)
  gate = [k for k in g if "/gate/" in k]
  assert gate and all(np.isfinite(g[k]).all() for k in gate)
  for layer in ("blocks/0/", "blocks/1/"):
    diff = max(np.abs(g[k] - g_lm[k]).max() for k in gate if k.startswith(layer))
    scale = max(np.abs(g_lm[k]).max() for k in gate if k.startswith(layer))
    assert diff > 1e-2 * scale, layer
  assert_close(g["final_norm/scale"], g_lm["final_norm/scale"], n=64 * 64)  # after the last gate: the LM's only


def test_shared_budget_reaches_the_trainer(batch, lm_path):
  """`evict_shared`: the trainer's hinge is the heads' shared one, never above the per-head one
  (the relu of a mean is at most the mean of the relus) and still pressing at a low target."""
  model = lm_path[0]
  kw = dict(evict_weight=1.0, evict_target=0.1, evict_window=2, evict_queries=4)
  run = lambda cfg: losses.objective(model, batch, cfg, 0, jax.random.key(0))[1]["evict_loss"]  # noqa: E731
  each, shared = float(run(tiny(**kw))), float(run(tiny(**kw, evict_shared=True)))
  assert 0 < shared <= each


def test_target_ramp_is_dms():
  cfg = tiny(evict_weight=1.0, evict_target=0.25, evict_ramp_steps=10, evict_window=4)
  r = [float(losses.evict_target(s, cfg)) for s in (0, 5, 10, 50)]
  assert_close(r, [1.0, 1 / (1 + 3 * 0.5), 0.25, 0.25], dtype=np.float32)
  assert float(losses.evict_target(0, tiny(evict_target=0.3))) == pytest.approx(0.3)
  # retrofitting a run at step 100: no pressure before it, the same ramp after it
  late = tiny(evict_weight=1.0, evict_target=0.25, evict_ramp_steps=10, evict_ramp_start=100, evict_window=4)
  assert_close([float(losses.evict_target(s, late)) for s in (0, 100, 105, 110, 500)], [1.0, *r], dtype=np.float32)


@pytest.mark.slow
def test_train_logs_evict_metrics(tmp_path):
  cfg = tiny(evict_weight=0.5, evict_window=4, steps=2, grad_accum=2, ckpt_every=100, evict_ramp_steps=1)
  out = train_fixed(cfg, str(tmp_path))
  rec = out["history"][-1]
  for k in ("evict_loss", "evict_target", "evict_live", "evict_live_hard", "evict_live_l0", "evict_live_l1"):
    assert k in rec and math.isfinite(rec[k]), k
  assert rec["evict_target"] == pytest.approx(0.25) and out["traces"] == 1


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(evict_target=0.0), "evict_target"),
    (dict(evict_target=1.0), "evict_target"),
    (dict(evict_target=1.5), "evict_target"),
    (dict(evict_weight=-1.0), "evict_weight"),
    (dict(evict_weight=float("nan")), "evict_weight"),
    (dict(evict_temp=0.0), "evict_temp"),
    (dict(evict_soft=-0.1), "evict_soft"),
    (dict(evict_queries=0), "evict_queries"),
    (dict(evict_window=-1), "evict_window"),
    (dict(evict_ramp_steps=-1), "evict_ramp_steps"),
    (dict(evict_ramp_start=-5), "evict_ramp_start"),
    (dict(evict_weight=1.0, attention="softmax"), "gated"),
    (dict(evict_weight=1.0, evict_window=16), "evict_window"),
  ],
)
def test_bad_settings_raise(kw, match):
  with pytest.raises(ValueError, match=match):
    tiny(**kw)


# ------------------------------------------------------------------------------------------------
# with_gates: the gate's outputs from the same forward pass (what the layers sow), both layouts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "attention,scan", [("fpa", False), ("fpa", True), pytest.param("fox", True, marks=pytest.mark.slow)]
)
def test_return_gates_equal_the_gate(batch, scan, attention):
  cfg = tiny(attention=attention, scan_layers=scan)
  model = build_model(cfg, seed=0)
  gdef, state = nnx.split(model)

  @jax.jit
  def probe(state, tok, seg):
    m = nnx.merge(gdef, state)
    logits, gates = with_gates(m, tok, seg)
    sugar = m(tok, seg, return_gates=True)[1]  # DecoderLM's shorthand for the same capture
    x, ref = jnp.take(m.embed[...], tok, axis=0), []
    for block in m.layer_blocks():  # the gate applied directly to each block's normed input
      ref.append(block.attn.gate(block.attn_norm(x)))
      x = block(x, seg)
    plain = m(tok, seg)
    assert not nnx.state(m, nnx.Intermediate)  # outside a capture the layers sow nothing: same state
    return logits, gates, sugar, plain, tuple(jnp.stack(a) for a in zip(*ref))

  tok, seg = batch["inputs"], batch["segment_ids"]
  logits, (field, level), sugar, plain, (f_ref, l_ref) = probe(state, tok, seg)
  assert_bitwise(sugar[0], field)
  assert_bitwise(sugar[1], level)
  L, b, t, kvh = cfg.n_layers, *tok.shape, cfg.kv_heads
  assert field.shape == level.shape == (L, b, t, kvh)
  assert_close(logits, plain, n=cfg.d_model * L)
  assert_close(field, f_ref, n=cfg.d_model * L)
  assert_close(level, l_ref, n=cfg.d_model * L)
  if attention == "fox":
    assert_bitwise(field, level)


def test_gate_stats_match_a_float64_loop():
  """`losses.gate_stats` (the trainer's eval-time gate statistics) equals loops over the penalty's
  definition: field range, active / forgotten shares and mean penalty over same-segment pairs."""
  from fpa_jax.ops.reference_np import penalty_np

  rng = np.random.default_rng(0)
  n_layers, b, t, kvh = 2, 3, 9, 2
  field = np.cumsum(rng.normal(scale=3.0, size=(n_layers, b, t, kvh)), 2).astype(np.float32)
  level = (field + rng.normal(scale=3.0, size=field.shape)).astype(np.float32)
  seg = np.asarray([[0] * 9, [0] * 4 + [1] * 5, [0, 0, 1, 1, 1, 2, 2, 2, 2]], np.int32)
  got = jax.jit(losses.gate_stats)((jnp.asarray(field), jnp.asarray(level)), jnp.asarray(seg))
  for li in range(n_layers):
    per = {"active": [], "forgotten": [], "penalty": []}
    for bi in range(b):
      vals = {k: [] for k in per}
      for h in range(kvh):
        pen = penalty_np(field[li, bi, :, h].astype(np.float64), level[li, bi, :, h].astype(np.float64))
        ps = [pen[i, j] for i in range(t) for j in range(i) if seg[bi, i] == seg[bi, j]]
        vals["active"].append(np.mean([p > 0 for p in ps]))
        vals["forgotten"].append(np.mean([p > losses.FORGOTTEN for p in ps]))
        vals["penalty"].append(np.mean(ps))
      for k in per:
        per[k].append(np.mean(vals[k]))
    want_range = np.mean(field[li].max(1) - field[li].min(1))
    assert_close(got[f"gate_field_range_l{li}"], want_range, dtype=np.float32, n=t)
    for k in per:
      assert_close(got[f"gate_{k}_l{li}"], np.mean(per[k]), dtype=np.float32, n=t * t)
  assert 0 < float(got["gate_active_l0"]) < 1 and float(got["gate_forgotten_l0"]) > 0  # the case is not trivial
