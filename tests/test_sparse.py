"""Key-sparse prefill (`skip="keys"`, `fpa_jax.ops.sparse`): the bound per key, the output against
float64 loops, and its forward-only contract.

  * soundness: every key the op drops for a query block has an exact weight (float64 numpy) <= eps / T
    for every query of the block: the bound in the module docstring, checked entry by entry;
  * output: within 2 eps max|v| (+ fp32 round-off) of the exact loop reference, on fields where most
    keys are dropped (asserted, so the check is not vacuous) and on random ones, with GQA, segments
    and a length that is not a multiple of the block;
  * a tolerance far below fp32's resolution gives the exact kernel's output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import rtol
from fpa_jax import configs as C
from fpa_jax import ops
from fpa_jax.ops import bias, sparse
from fpa_jax.ops import reference_np as ref
from test_ops_skip import dip_gates, f32, unit_rows, weights_np

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


def test_gradient_raises_and_bad_settings():
  q, k, v, field, level = map(f32, _inputs(7))
  with pytest.raises(ValueError, match="forward only"):
    jax.grad(lambda q: ops.fpa_attention(q, k, v, field, level, skip_tolerance=1e-3, skip="keys").sum())(q)
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


def test_model_prefill_with_keys_and_training_refuses_it(tmp_path):
  from fpa_jax import train
  from fpa_jax.models import build_model

  cfg = C.get_config("tiny", seq_len=40, block_size=8, attn_impl="chunked")
  exact = build_model(cfg, seed=0)
  fast = build_model(C.replace(cfg, skip_tolerance=1e-6, skip="keys"), seed=0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
  np.testing.assert_allclose(np.asarray(fast(tokens)), np.asarray(exact(tokens)), atol=1e-4, rtol=0)
  with pytest.raises(ValueError, match="forward only"):
    train.train(C.replace(cfg, skip_tolerance=1e-3, skip="keys"), workdir=str(tmp_path))
