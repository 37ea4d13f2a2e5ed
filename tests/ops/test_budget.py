"""Budget in the loop (`fpa_jax.ops.budget`): the keep mask against a loop simulation of the
`fpa_budget` decode cache, the budgeted attention against a float64 loop reference (values and
gradients), a model's forward under the training cut (`cut=`) against
`cached_logits(policy="fpa_budget")` itself, and the training objective's settings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fd import finite_differences
from _helpers_train import FixedBatch, train_fixed
from _tol import assert_close
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import losses
from fpa_jax.models import build_model
from fpa_jax.ops import budget as BL

# ------------------------------------------------------------------------------------------------
# Loop references
# ------------------------------------------------------------------------------------------------


def keep_np(field, level, capacity, recent, segment_ids=None):
  """The fpa_budget cache, token by token (`inference.cache.decode_attend`): bool [B, H, T, T]."""
  field, level = np.asarray(field, np.float64), np.asarray(level, np.float64)
  b_, t, h_ = field.shape
  out = np.zeros((b_, h_, t, t), bool)
  for b in range(b_):
    for h in range(h_):
      held: list[int] = []
      for i in range(t):
        if segment_ids is not None and i > 0 and segment_ids[b, i] != segment_ids[b, i - 1]:
          held = []  # a new sequence: an empty cache
        if len(held) >= capacity:
          pen = {j: max(0.0, level[b, j, h] - field[b, j + 1 : i + 1, h].min()) for j in held}
          cand = [j for j in held if j <= i - recent] or held
          top = max(pen[j] for j in cand)
          held.remove(min(j for j in cand if pen[j] == top))  # largest penalty, ties: the oldest
        held.append(i)
        out[b, h, i, held] = True
  return out


def keep_shared_np(field, level, capacity, recent, segment_ids=None):
  """One cache of capacity * H keys per row for all H heads, token by token: at query i the excess
  over capacity * H - H goes, largest penalty first, ties the oldest, then the lower head, among the
  keys at positions <= i - recent (every held key if fewer than the excess are); then the H new keys
  go in. bool [B, H, T, T]."""
  field, level = np.asarray(field, np.float64), np.asarray(level, np.float64)
  b_, t, h_ = field.shape
  out = np.zeros((b_, h_, t, t), bool)
  for b in range(b_):
    held: list[tuple[int, int]] = []  # (head, position)
    for i in range(t):
      if segment_ids is not None and i > 0 and segment_ids[b, i] != segment_ids[b, i - 1]:
        held = []
      pen = {(h, j): max(0.0, level[b, j, h] - field[b, j + 1 : i + 1, h].min()) for h, j in held}
      excess = max(0, len(held) + h_ - capacity * h_)
      cand = [x for x in held if x[1] <= i - recent]
      cand = cand if len(cand) >= excess else list(held)
      for x in sorted(cand, key=lambda x: (-pen[x], x[1], x[0]))[:excess]:
        held.remove(x)
      held += [(h, i) for h in range(h_)]
      for h, j in held:
        out[b, h, i, j] = True
  return out


def theta_np(field, level, keep):
  """The soft cut's threshold: the largest penalty the cache holds at each query, [B, H, T]."""
  field, level = np.asarray(field, np.float64), np.asarray(level, np.float64)
  b_, t, h_ = field.shape
  th = np.zeros((b_, h_, t))
  for b, g, i in np.ndindex(b_, h_, t):
    th[b, g, i] = (
      max(max(0.0, level[b, j, g] - field[b, j + 1 : i + 1, g].min()) for j in range(i) if keep[b, g, i, j])
      if keep[b, g, i, :i].any()
      else 0.0
    )
  return th


def attention_np(q, k, v, field, level, keep, scale, soft=0.0, theta=None):
  """float64 loops: softmax over the kept keys of scale q.k - penalty. q [B, T, H, K] (grouped).
  soft > 0: evicted keys too, at - log(1 + exp((penalty - theta) / soft + SOFT_TIE)) more (theta
  held fixed, as the op stops it)."""
  q, k, v, field, level = (np.asarray(a, np.float64) for a in (q, k, v, field, level))
  b_, t, h_, _ = q.shape
  kvh = k.shape[2]
  out = np.zeros((b_, t, h_, v.shape[-1]))
  for b in range(b_):
    for h in range(h_):
      g = h // (h_ // kvh)
      for i in range(t):
        js = [j for j in range(i + 1) if keep[b, g, i, j] or soft]
        pen = lambda j: max(0.0, level[b, j, g] - field[b, j + 1 : i + 1, g].min()) if j < i else 0.0
        cut = lambda j: (
          0.0 if keep[b, g, i, j] else -math.log1p(math.exp((pen(j) - theta[b, g, i]) / soft + BL.SOFT_TIE))
        )
        logit = np.array([scale * q[b, i, h] @ k[b, j, g] - pen(j) + cut(j) for j in js])
        p = np.exp(logit - logit.max())
        p /= p.sum()
        out[b, i, h] = sum(pj * v[b, j, g] for pj, j in zip(p, js))
  return out


# ------------------------------------------------------------------------------------------------
# The keep mask
# ------------------------------------------------------------------------------------------------


# (B, T, H, capacity, recent, integer fields (many exact ties), segments)
KEEP_CASES = [
  (2, 12, 2, 4, 0, False, False),
  (2, 12, 2, 4, 1, True, False),
  (1, 16, 3, 5, 2, True, True),
  (2, 9, 1, 1, 0, False, False),  # capacity 1: only the query itself
  (1, 10, 2, 10, 3, False, False),  # capacity = T: nothing is ever evicted
  (1, 10, 2, 3, 2, True, True),
]


@pytest.mark.parametrize("b,t,h,cap,w,ties,seg", KEEP_CASES)
def test_keep_matches_the_decode_loop(b, t, h, cap, w, ties, seg):
  rng = np.random.default_rng(10 * t + cap)
  if ties:  # small integers: many penalties exactly 0 or equal, the tie rule decides
    field, level = rng.integers(-2, 3, size=(b, t, h)) * 1.0, rng.integers(-2, 3, size=(b, t, h)) * 1.0
  else:
    field, level = rng.normal(size=(b, t, h)), rng.normal(size=(b, t, h))
  segs = np.sort(rng.integers(1, 3, size=(b, t)), axis=1) if seg else None
  got = np.asarray(
    jax.jit(BL.budget_keep)(
      jnp.asarray(field, jnp.float32),
      jnp.asarray(level, jnp.float32),
      cap,
      w,
      None if segs is None else jnp.asarray(segs),
    )
  )
  want = keep_np(field, level, cap, w, segs)
  np.testing.assert_array_equal(got, want)
  assert got[:, :, np.arange(t), np.arange(t)].all()  # the query's own key
  assert not np.triu(got, 1).any()  # never a later key
  assert (got.sum(-1) <= cap).all()
  if cap >= t:
    assert (got == np.tril(np.ones((t, t), bool))).all()


@pytest.mark.parametrize("b,t,h,cap,w,ties,seg", KEEP_CASES)
def test_shared_keep_matches_its_loop(b, t, h, cap, w, ties, seg):
  """shared=True: one cache of capacity * H keys per row, fpa_global's rule within the layer."""
  rng = np.random.default_rng(10 * t + cap + 1)
  if ties:
    field, level = rng.integers(-2, 3, size=(b, t, h)) * 1.0, rng.integers(-2, 3, size=(b, t, h)) * 1.0
  else:
    field, level = rng.normal(size=(b, t, h)) * 2, rng.normal(size=(b, t, h))
  segs = np.sort(rng.integers(1, 3, size=(b, t)), axis=1) if seg else None
  f = jax.jit(lambda f_, l_, s_: BL.budget_keep(f_, l_, cap, w, s_, shared=True))
  got = np.asarray(
    f(jnp.asarray(field, jnp.float32), jnp.asarray(level, jnp.float32), None if segs is None else jnp.asarray(segs))
  )
  np.testing.assert_array_equal(got, keep_shared_np(field, level, cap, w, segs))
  assert got[:, :, np.arange(t), np.arange(t)].all()
  assert (got.sum((1, 3)) <= cap * h).all()  # the row's keys, over every head
  if h == 1:  # one head: the per-head cache
    np.testing.assert_array_equal(got, keep_np(field, level, cap, w, segs))
  if cap < t and not ties:  # the heads' shares differ: one head's keys pay for another's
    assert len(np.unique(got.sum(-1)[..., -1])) > 1 or h == 1


def test_keep_with_flat_field_is_a_window_with_a_protected_tail():
  """Penalties all 0 (no forgetting yet): ties go to the oldest, so the cache is the last C keys."""
  z = jnp.zeros((1, 10, 1))
  keep = np.asarray(BL.budget_keep(z, z, 4, 1))[0, 0]
  for i in range(10):
    assert keep[i].nonzero()[0].tolist() == list(range(max(0, i - 3), i + 1))


# ------------------------------------------------------------------------------------------------
# The attention
# ------------------------------------------------------------------------------------------------


def kink_free(rng, b, t, h):
  """Distinct fields 1/4 apart, levels at odd multiples of 1/8: no relu / min kink (and no change of
  the keep mask's ranking) within a finite-difference step."""
  field = np.stack([np.stack([rng.permutation(2 * t)[:t] - t for _ in range(h)], -1) for _ in range(b)]) * 0.25
  level = (rng.integers(-t, t, size=(b, t, h)) + 0.5) * 0.25
  return field, level


def random_case(rng, b, t, heads, kv_heads, d):
  """float64 q [B, T, H, K], k, v [B, T, KVH, K] and kink-free field, level [B, T, KVH]."""
  q, k, v = (
    rng.normal(size=(b, t, heads, d)),
    rng.normal(size=(b, t, kv_heads, d)),
    rng.normal(size=(b, t, kv_heads, d)),
  )
  return (q, k, v, *kink_free(rng, b, t, kv_heads))


@pytest.mark.parametrize("heads,kv_heads,cap,w", [(2, 2, 4, 1), (4, 2, 3, 0), (2, 1, 8, 2)])
def test_budgeted_attention_matches_loop_reference_and_finite_differences(heads, kv_heads, cap, w):
  b, t, d = 2, 8, 3
  rng = np.random.default_rng(heads * 10 + cap)
  q, k, v, field, level = random_case(rng, b, t, heads, kv_heads, d)
  scale = d**-0.5
  keep = keep_np(field, level, cap, w)
  args32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v, field, level)]
  f = jax.jit(lambda *a: BL.budgeted_attention(*a, capacity=cap, recent=w))
  assert_close(np.asarray(f(*args32)), attention_np(q, k, v, field, level, keep, scale), dtype=np.float32, n=t * d)
  ct = rng.normal(size=(b, t, heads, d))
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3, 4)))(*args32)
  fds = finite_differences(lambda *a: attention_np(*a, keep, scale), [q, k, v, field, level], ct)
  for n, (g, fd) in enumerate(zip(grads, fds)):
    if n >= 3:
      assert np.abs(fd).max() > 0  # the gate gets a gradient through the kept keys' penalties
    assert_close(np.asarray(g), fd, dtype=np.float32, n=t * d, scale=max(np.abs(fd).max(), 1.0))


@pytest.mark.parametrize(
  "heads,kv_heads,cap,w,soft,shared",
  [(2, 2, 3, 1, 0.5, False), (2, 2, 3, 1, 0.5, True), pytest.param(4, 2, 2, 0, 2.0, False, marks=pytest.mark.slow)],
)
def test_soft_cut_matches_loop_reference_and_finite_differences(heads, kv_heads, cap, w, soft, shared):
  """soft > 0: kept keys exact, evicted keys at the soft bias beyond the cache's threshold; the
  gate's gradient now reaches the evicted keys' penalties (theta and the mask held, as the op stops them).
  shared: the layer's one cache, its threshold the largest penalty held over every kv head."""
  b, t, d = 1, 8, 3
  rng = np.random.default_rng(heads * 7 + cap)
  q, k, v, field, level = random_case(rng, b, t, heads, kv_heads, d)
  scale = d**-0.5
  keep = (keep_shared_np if shared else keep_np)(field, level, cap, w)
  assert (~keep & np.tril(np.ones((t, t), bool))).any()  # something is evicted
  theta = theta_np(field, level, keep)
  if shared:
    theta = np.broadcast_to(theta.max(1, keepdims=True), theta.shape)
  ref = lambda *a: attention_np(*a, keep, scale, soft=soft, theta=theta)
  args32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v, field, level)]
  f = jax.jit(lambda *a: BL.budgeted_attention(*a, capacity=cap, recent=w, soft=soft, shared=shared))
  out = np.asarray(f(*args32))
  assert_close(out, ref(q, k, v, field, level), dtype=np.float32, n=t * d)
  hard = attention_np(q, k, v, field, level, keep, scale)
  assert np.abs(out - hard).max() > 1e-3  # the evicted keys do weigh in
  ct = rng.normal(size=(b, t, heads, d))
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3, 4)))(*args32)
  for g, fd in zip(grads, finite_differences(ref, [q, k, v, field, level], ct)):
    assert_close(np.asarray(g), fd, dtype=np.float32, n=t * d, scale=max(np.abs(fd).max(), 1.0))
  # the levels' gradient now includes the evicted keys' (the hard cut's has none from them)
  hard_cut = lambda lv: BL.budgeted_attention(*args32[:4], lv, capacity=cap, recent=w, shared=shared)  # noqa: E731
  g_hard = jax.grad(lambda lv: jnp.sum(hard_cut(lv) * ct))(args32[4])
  assert np.abs(np.asarray(grads[4]) - np.asarray(g_hard)).max() > 1e-4


def test_budgeted_attention_bad_arguments():
  x = jnp.zeros((1, 4, 2, 3))
  g = jnp.zeros((1, 4, 2))
  with pytest.raises(ValueError, match="capacity"):
    BL.budgeted_attention(x, x, x, g, g, capacity=0, recent=0)
  with pytest.raises(ValueError, match="recent"):
    BL.budgeted_attention(x, x, x, g, g, capacity=3, recent=3)
  with pytest.raises(ValueError, match="field"):
    BL.budgeted_attention(x, x, x, g[:, :3], g, capacity=3, recent=0)
  for soft in (-1.0, float("nan"), "1"):
    with pytest.raises(ValueError, match="soft"):
      BL.budgeted_attention(x, x, x, g, g, capacity=3, recent=0, soft=soft)


# ------------------------------------------------------------------------------------------------
# A model: the budgeted training forward is the fpa_budget decode
# ------------------------------------------------------------------------------------------------


def tiny(**kw):
  return C.get_config("tiny", **{"task": "synthetic", "seq_len": 16, "batch_size": 4, "attn_impl": "quadratic", **kw})


@pytest.mark.parametrize(
  "attention,scan,kv",
  [
    ("fpa", False, None),
    pytest.param("fpa", True, 1, marks=pytest.mark.slow),
    pytest.param("fox", False, None, marks=pytest.mark.slow),
    pytest.param("stack", True, None, marks=pytest.mark.slow),
  ],
)
def test_model_cut_forward_equals_fpa_budget_decode(attention, scan, kv):
  from fpa_jax.inference import cached_logits

  extra = {} if kv is None else {"n_kv_heads": kv}
  model = build_model(tiny(attention=attention, scan_layers=scan, vocab_size=32, **extra), seed=1)
  toks = np.random.default_rng(0).integers(0, 32, (2, 20))
  for cap, w in [(5, 0), (6, 2), (20, 2)]:
    got = model(jnp.asarray(toks), cut=(jnp.int32(cap), jnp.int32(w)))
    want, _ = cached_logits(model, toks, policy="fpa_budget", budget=cap, recent=w)
    assert_close(np.asarray(got), np.asarray(want), dtype=np.float32, n=64 * 64)
  full = np.asarray(model(jnp.asarray(toks)))
  assert np.abs(np.asarray(model(jnp.asarray(toks), cut=(jnp.int32(5), jnp.int32(0)))) - full).max() > 1e-3


@pytest.mark.parametrize("scan,remat", [(True, "none"), pytest.param(False, "full", marks=pytest.mark.slow)])
def test_soft_cut_through_scanned_and_rematerialised_models(scan, remat):
  """The soft width rides in the cut tuple, which nnx.scan / remat trace: a traced 0 is the hard
  cut, a traced width the soft one (= the plain model's with a Python float)."""
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 20)))
  model = build_model(tiny(scan_layers=scan, remat=remat, vocab_size=32), seed=1)
  cap, w = jnp.int32(5), jnp.int32(0)
  gdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, s: nnx.merge(gdef, st)(t, cut=(cap, w, s)))
  run = lambda t, s: fwd(state, t, s)  # noqa: E731
  hard = np.asarray(model(toks, cut=(cap, w)))
  assert_close(np.asarray(run(toks, jnp.float32(0.0))), hard, dtype=np.float32, n=64 * 64)
  soft = np.asarray(run(toks, jnp.float32(1.0)))
  assert np.abs(soft - hard).max() > 1e-4
  if not scan:  # the same layers unscanned: the soft width as a Python float
    plain = build_model(tiny(vocab_size=32), seed=1)
    assert_close(np.asarray(plain(toks, cut=(cap, w, 1.0))), soft, dtype=np.float32, n=64 * 64)


def test_cut_needs_a_gate_and_a_pair():
  model = build_model(tiny(attention="softmax", vocab_size=32), seed=0)
  with pytest.raises(ValueError, match="gated"):
    model(jnp.zeros((1, 8), jnp.int32), cut=(jnp.int32(4), jnp.int32(0)))
  with pytest.raises(ValueError, match="capacity, recent"):
    build_model(tiny(vocab_size=32), seed=0)(jnp.zeros((1, 8), jnp.int32), cut=4)


# ------------------------------------------------------------------------------------------------
# The training objective
# ------------------------------------------------------------------------------------------------


def test_draw_capacity():
  caps = [BL.draw_capacity(jax.random.key(s), 100, 1.0, 0.1, 0.3) for s in range(50)]
  assert all(10 <= int(c) <= 30 and int(w) == int(c) // 8 for c, w in caps)
  assert len({int(c) for c, _ in caps}) > 5
  assert all(int(BL.draw_capacity(jax.random.key(s), 100, 0.0, 0.1, 0.3)[0]) == 100 for s in range(10))
  on = np.mean([int(BL.draw_capacity(jax.random.key(s), 100, 0.5, 0.1, 0.3)[0]) < 100 for s in range(200)])
  assert 0.35 < on < 0.65


def _objective(cfg, batch, key=0):
  model = build_model(cfg, seed=0)
  gdef, params, rest = nnx.split(model, nnx.Param, ...)
  f = lambda p: losses.objective(nnx.merge(gdef, p, rest), batch, cfg, 0, jax.random.key(key))  # noqa: E731
  return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


@pytest.fixture(scope="module")
def batch():
  return {k: jnp.asarray(v) for k, v in FixedBatch(vocab_size=64, seq_len=16, batch_size=4).batch.items()}


def test_budget_objective(batch):
  (v, aux), g = _objective(tiny(budget_loop_prob=1.0, budget_loop_min=0.25, budget_loop_max=0.25), batch)
  assert float(aux["budget_kept"]) == 0.25 and math.isfinite(float(v))
  gate = [np.asarray(x) for p, x in nnx.to_flat_state(g) if "gate" in map(str, p)]
  assert gate and all(np.isfinite(x).all() for x in gate) and max(np.abs(x).max() for x in gate) > 0
  # a budget of the whole sequence evicts nothing: the LM loss
  (v_full, aux_full), _ = _objective(tiny(budget_loop_prob=1.0, budget_loop_min=1.0, budget_loop_max=1.0), batch)
  (v_lm, _), _ = _objective(tiny(), batch)
  assert float(aux_full["budget_kept"]) == 1.0
  assert_close(v_full, v_lm, n=64 * 64)
  assert float(v) > float(v_lm)  # a quarter of the cache loses information


@pytest.mark.slow  # the shared cut's mask and soft cut: test_shared_keep_matches_its_loop, test_soft_cut_*
def test_budget_objective_shared_cut(batch):
  """budget_loop_shared reaches the model: one cache per layer for its kv heads, another cut of the
  same size (another loss)."""
  quarter = dict(budget_loop_prob=1.0, budget_loop_min=0.25, budget_loop_max=0.25)
  (v, _), _ = _objective(tiny(**quarter), batch)
  (v_shared, aux_shared), _ = _objective(tiny(**quarter, budget_loop_shared=True), batch)
  assert float(aux_shared["budget_kept"]) == 0.25 and math.isfinite(float(v_shared))
  assert abs(float(v_shared) - float(v)) > 1e-6


@pytest.mark.slow
def test_budget_objective_soft_cut(batch):
  """The soft cut: evicted keys weigh in again (loss between the hard cut's and the full cache's),
  and the gate's gradient changes (it now reaches the penalties of the keys the cache lost)."""
  hard = dict(budget_loop_prob=1.0, budget_loop_min=0.25, budget_loop_max=0.25)
  (v, _), g = _objective(tiny(**hard), batch)
  (v_lm, _), _ = _objective(tiny(), batch)
  (v_soft, _), g_soft = _objective(tiny(**hard, budget_loop_soft=1.0), batch)
  assert float(v_lm) < float(v_soft) < float(v)
  gate, gate_soft = ([np.asarray(x) for p, x in nnx.to_flat_state(gr) if "gate" in map(str, p)] for gr in (g, g_soft))
  assert max(np.abs(a - b).max() for a, b in zip(gate, gate_soft)) > 0


@pytest.mark.slow  # test_budget_objective
def test_budget_objective_with_the_hinge_and_a_late_start(batch):
  (v_lm, _), _ = _objective(tiny(), batch)
  # with the evictability hinge as well: both terms' metrics
  (_, aux2), _ = _objective(tiny(budget_loop_prob=1.0, evict_weight=1.0, evict_window=2), batch)
  assert {"budget_kept", "evict_loss", "evict_live"} <= set(aux2)
  # budget_loop_start: before it, the plain step (the step count is the optimizer's)
  soft = dict(budget_loop_prob=1.0, budget_loop_min=0.25, budget_loop_max=0.25, budget_loop_soft=1.0)
  (v_early, aux_early), _ = _objective(tiny(**soft, budget_loop_start=5), batch)
  assert float(aux_early["budget_kept"]) == 1.0
  assert_close(v_early, v_lm, n=64 * 64)


def test_train_logs_budget_kept(tmp_path):
  cfg = tiny(budget_loop_prob=1.0, budget_loop_min=0.5, budget_loop_max=0.5, steps=2, ckpt_every=100, log_every=1)
  out = train_fixed(cfg, str(tmp_path))
  assert out["history"][-1]["budget_kept"] == 0.5 and out["traces"] == 1
  distil = tiny(budget_loop_prob=1.0, distill_weight=1.0, steps=2, ckpt_every=100, log_every=1)
  assert train_fixed(distil, str(tmp_path / "distil"))["history"][-1]["distill_kl"] >= 0


def distill_kl_np(teacher, student, mask):
  """float64 loop reference of `losses.distill_kl`: sum over masked (b, t) of KL(p_teacher || p_student)."""
  total = 0.0
  for b in range(teacher.shape[0]):
    for t in range(teacher.shape[1]):
      if mask[b, t]:
        p = np.exp(teacher[b, t] - teacher[b, t].max())
        p /= p.sum()
        q = np.exp(student[b, t] - student[b, t].max())
        q /= q.sum()
        total += float(np.sum(p * (np.log(p) - np.log(q))))
  return np.asarray(total)


def test_distill_kl_matches_loop_reference_and_finite_differences():
  rng = np.random.default_rng(0)
  teacher, student = rng.normal(size=(2, 3, 5)) * 2, rng.normal(size=(2, 3, 5)) * 2
  mask = np.array([[1, 1, 0], [1, 0, 1]])
  want = distill_kl_np(teacher, student, mask)
  got = losses.distill_kl(jnp.asarray(teacher, jnp.float32), jnp.asarray(student, jnp.float32), jnp.asarray(mask))
  assert_close(got, want, dtype=np.float32, n=5 * 4)
  g_t, g_s = jax.grad(losses.distill_kl, argnums=(0, 1))(
    jnp.asarray(teacher, jnp.float32), jnp.asarray(student, jnp.float32), jnp.asarray(mask)
  )
  assert float(jnp.abs(g_t).max()) == 0.0  # the teacher is a target, not trained by it
  (fd_s,) = finite_differences(lambda s_: distill_kl_np(teacher, s_, mask), [student], np.ones(()))
  assert_close(g_s, fd_s, dtype=np.float32, n=5 * 4, scale=np.abs(fd_s).max())
  assert float(losses.distill_kl(jnp.asarray(teacher), jnp.asarray(teacher), jnp.asarray(mask))) == pytest.approx(
    0, abs=1e-6
  )
  with pytest.raises(ValueError, match="must match"):
    losses.distill_kl(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 4)), jnp.ones((2, 3)))


def test_distill_objective_is_the_full_lm_loss_plus_the_weighted_kl(batch):
  """Self-distillation through the cut: the LM loss on the full forward plus the weight times the KL
  of the cut forward from it; a cut of the whole sequence has nothing to distil."""
  cut = dict(budget_loop_prob=1.0, budget_loop_min=0.25, budget_loop_max=0.25)
  (v, aux), g = _objective(tiny(**cut, distill_weight=0.5), batch)
  (v_lm, aux_lm), _ = _objective(tiny(), batch)
  assert_close(aux["lm_sum"], aux_lm["lm_sum"], n=64 * 64)  # the text loss is the full forward's
  kl = float(aux["distill_kl"]) * float(aux["count"])
  assert kl > 0 and float(aux["budget_kept"]) == 0.25
  assert float(v) == pytest.approx(float(aux_lm["lm_sum"]) + 0.5 * kl, rel=1e-5)
  gate = [np.asarray(x) for p, x in nnx.to_flat_state(g) if "gate" in map(str, p)]
  assert gate and all(np.isfinite(x).all() for x in gate)
  whole = dict(budget_loop_prob=1.0, budget_loop_min=1.0, budget_loop_max=1.0)
  (v_whole, aux_whole), _ = _objective(tiny(**whole, distill_weight=0.5), batch)
  assert float(aux_whole["distill_kl"]) == pytest.approx(0, abs=1e-5)
  assert_close(v_whole, v_lm, n=64 * 64, scale=float(v_lm))


@pytest.mark.parametrize(
  "kw,match",
  [
    (dict(distill_weight=1.0), "budget_loop_prob > 0"),
    (dict(distill_weight=-1.0, budget_loop_prob=1.0), "distill_weight"),
    (dict(budget_loop_prob=1.5), "budget_loop_prob"),
    (dict(budget_loop_prob=-0.1), "budget_loop_prob"),
    (dict(budget_loop_min=0.0), "budget_loop_min"),
    (dict(budget_loop_max=1.2), "budget_loop_max"),
    (dict(budget_loop_soft=-1.0), "budget_loop_soft"),
    (dict(budget_loop_min=0.5, budget_loop_max=0.2), "min <= max"),
    (dict(budget_loop_prob=0.5, attention="softmax"), "gated"),
  ],
)
def test_bad_budget_settings_raise(kw, match):
  with pytest.raises(ValueError, match=match):
    tiny(**kw)
