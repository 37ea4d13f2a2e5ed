"""Grouped-query models (`n_kv_heads` < `n_heads`): shapes, config checks, cached decoding equal to
the parallel forward, and n_kv_heads = n_heads (or 0) leaving a model unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _fwd import forward
from _tol import assert_bitwise, assert_close
from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.inference import cached_logits, generate
from fpa_jax.models import build_model

RANDOM_GATE = dict(step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)


def _model(att, n_heads=4, n_kv_heads=2, seed=0, **kw):
  cfg = C.get_config("tiny", attention=att, n_heads=n_heads, n_kv_heads=n_kv_heads, **{**RANDOM_GATE, **kw})
  return build_model(cfg, seed=seed)


def _tokens(b, t, vocab, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def test_config_kv_heads():
  assert C.get_config("tiny", n_heads=4).kv_heads == 4  # 0 -> n_heads
  assert C.get_config("tiny", n_heads=4, n_kv_heads=1).kv_heads == 1
  with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=4"):
    C.get_config("tiny", n_heads=4, n_kv_heads=3)
  with pytest.raises(ValueError, match="n_kv_heads"):
    C.get_config("tiny", n_heads=4, n_kv_heads=-1)
  # Grouped heads run on every impl (pallas: tests/ops/pallas/test_pallas_sharded.py); auto keeps them on
  # chunked until the grouped Pallas path is checked on an accelerator.
  assert C.get_config("tiny", n_heads=4, n_kv_heads=2, attn_impl="pallas").kv_heads == 2


def test_projection_and_gate_shapes():
  m = _model("fpa")
  a = m.layer_blocks()[0].attn
  d, k = m.cfg.d_model, m.cfg.head_dim
  assert a.wq[...].shape == (d, 4, k) and a.wk[...].shape == (d, 2, k) and a.wv[...].shape == (d, 2, k)
  assert a.gate.step.w[...].shape == (d, 2) and a.gate.offset.b[...].shape == (2,)
  # every parameter still has logical axes the sharding table maps (kv heads share HEADS)
  for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
    axes = v.get_metadata().get("out_sharding")
    assert axes is not None and len(axes) == v.get_value().ndim, path
    S.logical_to_spec(axes, v.get_value().shape, jax.sharding.AbstractMesh((2, 4), S.MESH_AXES))


@pytest.mark.parametrize(
  "att,kvh",
  # [softmax-2] in the default run (with test_policies_run_per_kv_head); the rest with -m slow
  [(a, 2) if a == "softmax" else pytest.param(a, 2, marks=pytest.mark.slow) for a in C.ATTENTIONS]
  + [pytest.param("fpa", 1, marks=pytest.mark.slow)],
)
def test_full_cache_equals_parallel(att, kvh):
  m = _model(att, n_kv_heads=kvh)
  tok = _tokens(2, 21, m.cfg.vocab_size)
  logits, stats = cached_logits(m, tok)
  n = m.cfg.d_model * m.cfg.n_layers  # logits: reductions over d_model in every layer
  assert_close(logits, forward(m, tok), n=n)
  assert stats["lost_mass_max"] == 0.0
  seg = jnp.array([[1] * 7 + [2] * 9 + [5] * 5, [3] * 21])
  logits, _ = cached_logits(m, tok, segment_ids=seg)
  assert_close(logits, forward(m, tok, seg), n=n)


def test_policies_run_per_kv_head():
  """Thresholds, h2o scores and lost mass are per kv head; a budget >= T equals the full cache."""
  m = _model("fpa", step_init_std=0.3)
  tok = _tokens(2, 16, m.cfg.vocab_size)
  full, _ = cached_logits(m, tok)
  for policy, kw in [
    ("fpa_budget", dict(budget=16)),
    ("h2o", dict(budget=16)),
    ("fpa", dict(tolerance=1e-3)),
    ("fpa_threshold", dict(threshold=0.5)),
  ]:
    got, stats = cached_logits(m, tok, policy=policy, **kw)
    assert got.shape == full.shape and np.isfinite(np.asarray(got)).all(), policy
    if "budget" in kw:
      assert_close(got, full, n=m.cfg.d_model * m.cfg.n_layers)  # another policy's program, the same keys
  _, stats = cached_logits(m, tok, policy="window", budget=5)
  assert stats["lost_mass_max"] > 0.0


@pytest.mark.slow  # inference/test_decode.py's
def test_generate_parallel_prefill_equals_decode_prefill():
  m = _model("fpa")
  prompts = [np.asarray(_tokens(1, n, m.cfg.vocab_size, seed=n))[0] for n in (5, 11)]
  out, _ = generate(m, prompts, 5)
  out2, _ = generate(m, prompts, 5, prefill="decode")
  np.testing.assert_array_equal(out2, out)
  # greedy: each new token is the parallel forward's argmax after the prompt and earlier tokens
  for p, row in zip(prompts, out):
    seq = jnp.asarray(np.concatenate([p, row])[None])
    np.testing.assert_array_equal(np.argmax(np.asarray(forward(m, seq))[0, len(p) - 1 : -1], -1), row)


@pytest.mark.slow
@pytest.mark.parametrize("att", ["fpa", "softmax"])
def test_kv_heads_equal_heads_is_unchanged(att):
  a, b = _model(att, n_heads=2, n_kv_heads=0), _model(att, n_heads=2, n_kv_heads=2)
  sa, sb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
  assert jax.tree.structure(sa) == jax.tree.structure(sb)
  for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
    assert_bitwise(x, y)
  tok = _tokens(2, 12, a.cfg.vocab_size)
  assert_bitwise(a(tok), b(tok))  # kv_heads = heads either way: the same program
