"""Activation sharding: the 8-device train step keeps every [batch, seq, ...] activation batch-sharded,
and `sharding.constrain` is a no-op without a mesh (CPU, 8 simulated devices from conftest)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _helpers_train import float_shapes
from _tol import assert_close
from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.models import build_model

from experiments.bench_train import compile_train_step


@pytest.mark.slow
def test_train_step_activations_are_batch_sharded_on_data8():
  """Per-device HLO of the data=8 step: no float tensor spans the global batch.

  A tied embedding bigger than the activations (as in base110m) is what makes XLA, left alone, keep
  whole-batch logits / q, k, v / MLP activations on every device and gather those instead of the
  FSDP-sharded weights. The only whole-batch float tensors allowed are the embedding lookup and its
  gradient on the device's d_model slice (at most 1/8 of a [B, T, D] activation)."""
  b, t, d, v = 24, 32, 64, 4096  # 24 and 24 * 32 = 768 appear in no other dim
  cfg = C.get_config(
    "tiny",
    task="synthetic",
    attention="fpa",
    batch_size=b,
    seq_len=t,
    n_layers=1,
    vocab_size=v,
    d_model=d,
    tie_embeddings=True,
    dtype="bfloat16",
  )
  mesh = S.make_mesh("data=8")
  shapes = float_shapes(compile_train_step(cfg, mesh).as_text())
  whole_batch = [s for s in shapes if (b in s or b * t in s) and np.prod(s) > b * t * d // 8]
  assert not whole_batch, f"activations not sharded over data=8 (per-device shapes): {sorted(whole_batch)}"
  assert (b // 8, t, v) in shapes  # the logits really are there, with the per-device batch


def test_constrain_is_a_noop_without_a_mesh_and_pins_with_one():
  x = jnp.ones((8, 4, 6))
  f = jax.jit(lambda x: S.constrain(x * 2, S.BTV))
  assert f(x).sharding.is_fully_replicated and len(f(x).devices()) == 1  # no mesh: plain one-device call
  mesh = S.make_mesh("data=4,model=2")
  with jax.set_mesh(mesh):
    assert f(x).sharding.spec == P("data", None, "model")
    # a dim the mesh axis does not divide stays replicated (batch 1 while decoding)
    assert jax.jit(lambda x: S.constrain(x, S.BTV))(jnp.ones((1, 4, 6))).sharding.spec == P(None, None, "model")


def test_activation_and_weight_names_are_separate():
  assert S.RULES[S.EMBED] == "data" and S.RULES[S.ACT_EMBED] is None  # FSDP weights vs whole residual
  assert S.RULES[S.ACT_BATCH] == "data" and S.ACT_BATCH not in {S.EMBED, S.HEADS, S.HEAD_DIM, S.MLP, S.VOCAB}
  assert S.logical_to_spec(S.BTHK, (8, 4, 2, 3), S.make_mesh("data=4,model=2")) == P("data", None, "model", None)


def test_model_call_under_a_mesh_matches_plain_call():
  """The constraints change only the layout: logits under `jax.set_mesh` equal the one-device ones."""
  cfg = C.get_config("tiny", attention="fpa", n_layers=1)
  model = build_model(cfg, seed=0)
  tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)), jnp.int32)
  want = jax.jit(lambda m, t: m(t))(model, tok)
  with jax.set_mesh(S.make_mesh("data=8")):
    got = jax.jit(lambda m, t: m(t))(model, tok)
  assert got.sharding.spec[0] == "data"
  assert_close(got, want, n=cfg.d_model * cfg.n_layers)  # another program: sums over d_model per layer
