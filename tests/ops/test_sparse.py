"""Key-sparse attention (`skip="keys"`, `fpa_jax.ops.sparse`): the bound per key, the output and
the gradients against float64 loops, for both schedules of the kept keys.

  * soundness: every key the op drops for a query block has an exact weight (float64 numpy) <= eps / T
    for every query of the block: the bound in the module docstring, checked entry by entry;
  * output: within 2 eps max|v| (+ fp32 round-off) of the exact loop reference, on fields where most
    keys are dropped (asserted, so the check is not vacuous) and on random ones, with GQA, segments
    and a length that is not a multiple of the block;
  * gradients, tight: values and d/d(q, k, v, field, level) (FoX: log_fgate) equal the float64 loop
    reference with the dropped keys masked out (`reference_np.fpa_attention_vjp_np`), to fp32
    round-off, for reads="shared" and "per_head";
  * gradients, bound: against the exact (unmasked) float64 reference, within the per-entry bound of
    `ops.chunked` (`test_ops_skip.grad_bounds`, dropped entries = the dropped keys);
  * a tolerance far below fp32's resolution gives the exact kernel's output; training accepts it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _tol import assert_close, rtol
from fpa_jax import configs as C
from fpa_jax import ops
from fpa_jax.ops import bias, sparse
from fpa_jax.ops import reference_np as ref
from test_skip import dip_gates, f32, grad_bounds, unit_rows, weights_np

B, T, H, D, BLK = 2, 64, 2, 4, 8
SCALE = 0.5


def _inputs(seed, depth=40.0, t=T, kvh=H, grp=1, norm=1.5):
  rng = np.random.default_rng(seed)
  field, level = dip_gates(rng, depth, periods=(16, 24)[:kvh] if kvh <= 2 else (16,) * kvh, t=t)
  q = unit_rows(rng, (B, t, kvh * grp, D), norm)
  k = unit_rows(rng, (B, t, kvh, D), norm)
  v = rng.normal(size=(B, t, kvh, D))
  return q, k, v, field, level


def _sparse(q, k, v, field, level, eps, seg=None, block=BLK):
  return ops.fpa_attention(
    *map(f32, (q, k, v, field, level)),
    scale=SCALE,
    segment_ids=seg,
    block_size=block,
    skip_tolerance=eps,
    skip="keys",
  )


@pytest.mark.parametrize("eps", [1e-3, 0.1])
def test_dropped_keys_have_negligible_weight(eps):
  q, k, v, field, level = _inputs(0)
  live = np.asarray(
    sparse.live_keys(
      f32(q), f32(k), bias.FPABias(f32(field), f32(level)), skip_tolerance=eps, scale=SCALE, block_size=BLK
    )
  )
  p = weights_np(q, k, field, level, SCALE)  # [B, H, T, T]
  nb = live.shape[2]
  dropped = 0
  for blk_i in range(1, nb):
    rows = slice(blk_i * BLK, min((blk_i + 1) * BLK, T))
    before = np.arange(T) < blk_i * BLK
    assert not live[:, :, blk_i, ~before].any()  # the diagonal tile and later keys are never listed
    gone = before[None, None] & ~live[:, :, blk_i]  # [B, H, T]
    worst = p[:, :, rows, :].max(2)  # the block's largest weight per key
    assert (worst[gone] <= eps / T * (1 + 1e-4)).all()
    dropped += gone.sum()
  assert dropped > 0.5 * B * H * BLK * nb * (nb - 1) / 2  # most keys are dropped on these fields


@pytest.mark.parametrize(
  "case",
  [
    dict(seed=1),  # deep dips: most keys dropped
    dict(seed=2, depth=3.0),  # near the threshold
    dict(seed=3, t=45, kvh=1, grp=2, block=16),  # GQA, a length not a multiple of the block
    dict(seed=4, segments=True),
  ],
)
def test_matches_loop_reference_within_bound(case):
  case = dict(case)
  seed, block, segments = case.pop("seed"), case.pop("block", BLK), case.pop("segments", False)
  eps = 1e-2
  q, k, v, field, level = _inputs(seed, **case)
  t, grp = q.shape[1], q.shape[2] // k.shape[2]
  seg = None
  if segments:
    seg = jnp.asarray(np.cumsum(np.random.default_rng(seed).random((B, t)) < 0.05, 1), jnp.int32)
  out = np.asarray(_sparse(q, k, v, field, level, eps, seg, block), np.float64)
  rep = lambda x: np.repeat(x, grp, axis=2)
  want = ref.fpa_attention_np(
    q, rep(k), rep(v), rep(field), rep(level), SCALE, None if seg is None else np.asarray(seg)
  )
  bound = 2 * eps * np.abs(v).max() + 50 * rtol(jnp.float32)
  np.testing.assert_array_less(np.abs(out - want), bound)


def test_random_fields_and_fox_within_bound():
  rng = np.random.default_rng(5)
  q, k, v = rng.normal(size=(B, T, H, D)), rng.normal(size=(B, T, H, D)), rng.normal(size=(B, T, H, D))
  field = np.cumsum(rng.normal(scale=3.0, size=(B, T, H)), 1)
  level = field + rng.normal(size=field.shape)
  eps = 1e-2
  out = np.asarray(_sparse(q, k, v, field, level, eps), np.float64)
  bound = 2 * eps * np.abs(v).max() + 50 * rtol(jnp.float32)
  np.testing.assert_array_less(np.abs(out - ref.fpa_attention_np(q, k, v, field, level, SCALE)), bound)
  lf = np.log(1 / (1 + np.exp(-rng.normal(loc=-1.0, size=(B, T, H)))))  # log sigmoid, strong decay
  got = ops.fox_attention(*map(f32, (q, k, v, lf)), scale=SCALE, block_size=BLK, skip_tolerance=eps, skip="keys")
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - ref.fox_attention_np(q, k, v, lf, SCALE)), bound)


def test_tiny_tolerance_is_the_exact_kernel():
  q, k, v, field, level = _inputs(6, depth=2.0)
  exact = ops.fpa_attention(*map(f32, (q, k, v, field, level)), scale=SCALE, block_size=BLK)
  got = _sparse(q, k, v, field, level, 1e-30)
  np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=10 * rtol(jnp.float32), rtol=0)


def test_bad_settings():
  q, k, v, field, level = map(f32, _inputs(7))
  with pytest.raises(ValueError, match="skip_tolerance"):
    ops.fpa_attention(q, k, v, field, level, skip="keys")
  with pytest.raises(ValueError, match="skip must be one of"):
    ops.fpa_attention(q, k, v, field, level, skip_tolerance=1e-3, skip="rows")
  with pytest.raises(ValueError, match="impl='chunked'"):
    ops.fpa_attention(q, k, v, field, level, impl="quadratic", skip_tolerance=1e-3, skip="keys")
  with pytest.raises(ValueError, match="skip_tolerance"):
    C.ModelConfig(skip="keys").validate()
  with pytest.raises(ValueError, match="skip="):
    C.ModelConfig(skip="rows", skip_tolerance=1e-3).validate()
  fb = bias.FPABias(field, level)
  with pytest.raises(ValueError, match="reads="):
    sparse.key_sparse_attention(q, k, v, fb, scale=SCALE, skip_tolerance=1e-3, reads="rows")
  with pytest.raises(ValueError, match="key_chunk"):
    sparse.key_sparse_attention(q, k, v, fb, scale=SCALE, skip_tolerance=1e-3, block_size=8, key_chunk=3)


# ----------------------------------------------------------------------------- gradients


def _drop_mask(q, k, b, eps, block, grp):
  """[B, H, T, T] bool: key j dropped for query i (its block's live set, repeated over the group)."""
  t = q.shape[1]
  live = np.asarray(sparse.live_keys(f32(q), f32(k), b, skip_tolerance=eps, scale=SCALE, block_size=block))
  blk_of = np.arange(t) // block
  before = np.arange(t)[None, :] < (blk_of * block)[:, None]  # [T(i), T(j)]
  drop = before[None, None] & ~live[:, :, blk_of, :]  # [B, KVH, T, T]
  return np.repeat(drop, grp, axis=1)


@functools.partial(jax.jit, static_argnames=("fox", "eps", "block", "reads", "chunk"))
def _sparse_grads(q, k, v, gates, ct, seg, *, fox, eps, block, reads, chunk=None):
  def loss(q, k, v, gates):
    if fox:
      fb = bias.FoXBias(jnp.cumsum(gates[0], 1))
    else:
      fb = bias.FPABias(*gates)
    o = sparse.key_sparse_attention(
      q, k, v, fb, scale=SCALE, skip_tolerance=eps, segment_ids=seg, block_size=block, reads=reads, key_chunk=chunk
    )
    return jnp.sum(o * ct), o

  (_, out), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, gates)
  return out, g


def _check_grads(args, ct, eps, *, seg=None, block=BLK, reads=("shared", "per_head"), chunk=None, bound=True):
  """Tight check against the masked float64 loops for each schedule; the bound against the exact
  ones (no segments). Returns the share of (query, key) pairs before each block that are dropped."""
  q, k, v, field, level = args
  t, grp = q.shape[1], q.shape[2] // k.shape[2]
  fb = bias.FPABias(f32(field), f32(level))
  drop = _drop_mask(q, k, fb, eps, block, grp)
  rep = lambda x: np.repeat(x, grp, axis=2)
  unrep = lambda x: x.reshape(x.shape[:2] + (-1, grp) + x.shape[3:]).sum(3)  # sum over the group
  segn = None if seg is None else np.asarray(seg)
  want = ref.fpa_attention_vjp_np(q, rep(k), rep(v), rep(field), rep(level), ct, SCALE, segn, drop)
  want = [want[0], want[1]] + [unrep(w) for w in want[2:]]
  for r in reads:
    out, (dq, dk, dv, (dfield, dlevel)) = _sparse_grads(
      *map(f32, (q, k, v)),
      (f32(field), f32(level)),
      f32(ct),
      seg,
      fox=False,
      eps=eps,
      block=block,
      reads=r,
      chunk=chunk,
    )
    for name, g, w in zip(NAMES, (out, dq, dk, dv, dfield, dlevel), want):
      assert_close(g, w, n=t, err_msg=f"{r}: {name} against the masked loops")
  if bound and seg is None and grp == 1:
    exact = ref.fpa_attention_vjp_np(q, k, v, field, level, ct, SCALE)
    p = weights_np(q, k, field, level, SCALE)
    assert (p * drop).sum(-1).max() <= eps
    out_b, g_b = grad_bounds(list(args), ct, p, drop, eps, SCALE)
    tol = lambda w: rtol(np.float32, t) * float(np.abs(w).max())
    for name, g, w, bnd in zip(NAMES, (out, dq, dk, dv, dfield, dlevel), exact, [out_b] + g_b):
      err = np.abs(np.asarray(g, np.float64) - w)
      assert np.all(err <= bnd + tol(w)), (name, float((err - bnd).max()))
  before = np.tril(np.ones((t, t), bool), -1)
  return float(drop.sum() / max(before.sum() * drop.shape[0] * drop.shape[1], 1))


NAMES = ("out", "q", "k", "v", "field", "level")


def _case(seed, depth=40.0, t=T, kvh=H, grp=1, norm=1.5):
  q, k, v, field, level = _inputs(seed, depth, t, kvh, grp, norm)
  rng = np.random.default_rng(seed + 100)
  ct = rng.normal(size=q.shape[:3] + (v.shape[-1],))
  args = [np.asarray(np.float32(x), np.float64) for x in (q, k, v, field, level)]
  return args, np.asarray(np.float32(ct), np.float64)


@pytest.mark.slow  # test_gradients_near_threshold_and_loose_eps
def test_gradients_mostly_dropped():
  args, ct = _case(10, depth=40.0)
  assert _check_grads(args, ct, 1e-2) > 0.5


def test_gradients_near_threshold_and_loose_eps():
  # Dips close to the threshold with eps = 0.3: the dropped weights are large enough for the
  # bound to be checked where it has to hold.
  args, ct = _case(11, depth=6.0)
  assert _check_grads(args, ct, 0.3, reads=("auto",)) > 0.02


def test_gradients_gqa_padding_segments_chunks():
  args, ct = _case(12, t=45, kvh=1, grp=2)
  seg = jnp.asarray(np.sort(np.random.default_rng(12).integers(0, 3, size=(B, 45)), 1), jnp.int32)
  assert _check_grads(args, ct, 1e-2, seg=seg, block=16, chunk=8) > 0.2


def test_gradients_eps_dropping_nothing_is_exact():
  args, ct = _case(13, depth=2.0)
  assert _check_grads(args, ct, 1e-30, reads=("per_head",)) == 0.0


def test_gradients_random_fields():
  rng = np.random.default_rng(14)
  q, k = (unit_rows(rng, (B, T, H, D), 1.5) for _ in range(2))
  v, ct = (rng.normal(size=(B, T, H, D)) for _ in range(2))
  field = rng.normal(size=(B, T, H)) * 30
  level = rng.normal(size=(B, T, H)) * 30
  args = [np.asarray(np.float32(x), np.float64) for x in (q, k, v, field, level)]
  assert _check_grads(args, np.asarray(np.float32(ct), np.float64), 1e-2, reads=("auto",)) > 0.1


def test_fox_gradients():
  # FoX = the FPA loops with field = level = c (c non-increasing): d log f_s = sum_{t >= s} d c_t.
  rng = np.random.default_rng(15)
  q, k = (unit_rows(rng, (B, T, H, D), 1.5) for _ in range(2))
  v, ct = (rng.normal(size=(B, T, H, D)) for _ in range(2))
  logf = np.asarray(jax.nn.log_sigmoid(rng.normal(size=(B, T, H)) + 1.0), np.float64)
  q, k, v, logf, ct = (np.asarray(np.float32(x), np.float64) for x in (q, k, v, logf, ct))
  eps = 1e-2
  c32 = jnp.cumsum(f32(logf), 1)  # the kernel's own fp32 cumsum: the same live keys
  drop = _drop_mask(q, k, bias.FoXBias(c32), eps, BLK, 1)
  assert drop.sum() > 0.2 * B * H * T * T / 2
  c = np.asarray(c32, np.float64)
  rc = lambda x: np.flip(np.cumsum(np.flip(x, 1), 1), 1)
  w = ref.fpa_attention_vjp_np(q, k, v, c, c, ct, SCALE, None, drop)
  want = [w[0], w[1], w[2], w[3], rc(w[4] + w[5])]
  for r in ("shared", "per_head"):
    out, (dq, dk, dv, (dlogf,)) = _sparse_grads(
      *map(f32, (q, k, v)), (f32(logf),), f32(ct), None, fox=True, eps=eps, block=BLK, reads=r
    )
    for name, g, wv in zip(("out", "q", "k", "v", "log_fgate"), (out, dq, dk, dv, dlogf), want):
      assert_close(g, wv, n=T, err_msg=f"{r}: {name}")
  # The bound against the exact loops (c_t is field and level at once: both bounds add).
  e = ref.fpa_attention_vjp_np(q, k, v, c, c, ct, SCALE)
  p = weights_np(q, k, c, c, SCALE)
  out_b, (bq, bk, bv, bfield, blevel) = grad_bounds([q, k, v, c, c], ct, p, drop, eps, SCALE)
  exact = [e[0], e[1], e[2], e[3], rc(e[4] + e[5])]
  for g, wv, bnd in zip((out, dq, dk, dv, dlogf), exact, (out_b, bq, bk, bv, rc(bfield + blevel))):
    assert np.all(np.abs(np.asarray(g, np.float64) - wv) <= bnd + rtol(np.float32, T) * np.abs(wv).max())


def test_live_key_stats_reads():
  q, k, v, field, level = map(f32, _inputs(16))
  st = sparse.live_key_stats(q, k, bias.FPABias(field, level), skip_tolerance=1e-2, scale=SCALE, block_size=BLK)
  assert st["kept_per_head"] <= st["read_per_head"] <= st["read_shared"] + 1e-9
  assert min(st["read_per_head"], st["read_shared"]) - 1e-9 <= st["read_auto"] <= st["read_shared"] + 1e-9


@pytest.mark.slow  # the op: test_sparse's gradient tests
def test_model_prefill_with_keys_and_training_with_it(tmp_path):
  from fpa_jax.models import build_model

  cfg = C.get_config("tiny", seq_len=40, block_size=8, attn_impl="chunked")
  exact = build_model(cfg, seed=0)
  fast = build_model(C.replace(cfg, skip_tolerance=1e-6, skip="keys"), seed=0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
  fwd = nnx.jit(lambda m, t: m(t))  # eager dispatch would compile the forward op by op
  np.testing.assert_allclose(np.asarray(fwd(fast, tokens)), np.asarray(fwd(exact, tokens)), atol=1e-4, rtol=0)
  from _helpers_train import train_fixed

  short = dict(steps=3, log_every=1, ckpt_every=100, batch_size=2)
  base = train_fixed(C.replace(cfg, **short), str(tmp_path / "exact"))
  keys = train_fixed(C.replace(cfg, skip_tolerance=1e-3, skip="keys", **short), str(tmp_path / "keys"))
  lb, lk = (np.asarray([m["loss"] for m in r["history"]]) for r in (base, keys))
  assert len(lb) == 3
  np.testing.assert_allclose(lk, lb, rtol=1e-4)
