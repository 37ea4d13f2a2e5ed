"""impl="pallas" under a multi-device mesh: the layer runs the kernel per device (`sharding.shard_local`).

XLA cannot partition a pallas_call, so without the shard_map every device would gather the whole
q / k / v; with it the layer's output and gradients equal the one-device ones and the compiled HLO
has no all-gather. CPU, 8 simulated devices (conftest), kernels in the Pallas interpreter: every
case compiles the forward and both backward kernels, so the shapes are tiny and the cases few.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from _tol import assert_bitwise, assert_close, assert_trees_close
from fpa_jax import configs as C
from fpa_jax import ops
from fpa_jax import sharding as S
from fpa_jax.data import SyntheticPipeline
from fpa_jax.layers import FirstPassageAttention
from fpa_jax.ops.pallas import BlockSizes
from fpa_jax.train import TrainStep, create_state

T, D = 16, 16
_GATHER = re.compile(r"= (\([^)]*\)|\S+) all-gather(?:-start)?\(")


def _gathers(hlo: str) -> list[str]:
  """Result shapes of every all-gather in compiled HLO text."""
  return _GATHER.findall(hlo)


def _loss(layer, x, seg):
  y = layer(x, seg)
  return jnp.sum(y * jnp.cos(y)), y


_grad = jax.jit(lambda layer, x, seg: nnx.value_and_grad(_loss, has_aux=True)(layer, x, seg))


def _inputs(b):
  rng = np.random.default_rng(b)
  x = jnp.asarray(rng.normal(size=(b, T, D)), jnp.float32)
  seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, T)), 1), jnp.int32)  # several segments per row
  return x, seg


@pytest.fixture(scope="module")
def layer():
  cfg = C.get_config("tiny", attention="fpa", attn_impl="pallas", d_model=D, n_heads=2, seq_len=T)
  return FirstPassageAttention(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "mesh_spec, b",
  [
    ("data=4,model=2", 8),  # batch and heads both split
    pytest.param("data=8", 8, marks=pytest.mark.slow),
    pytest.param(
      "data=2,model=4", 6, marks=pytest.mark.slow
    ),  # 2 heads on model=4: heads replicated (as `constrain` leaves them)
  ],
)
def test_layer_under_mesh_matches_plain_and_gathers_nothing(layer, mesh_spec, b):
  x, seg = _inputs(b)
  (_, want_y), want_g = _grad(layer, x, seg)
  with jax.set_mesh(S.make_mesh(mesh_spec)):
    (_, y), g = _grad(layer, x, seg)
    hlo = _grad.lower(layer, x, seg).compile().as_text()
  assert y.sharding.spec[0] == "data"
  # Another program (sharded): y through reductions over D and T, weight grads over the b * T tokens.
  assert_close(y, want_y, n=max(D, T))
  # The absolute bias shifts field and level alike: its gradient is rounding noise on both sides.
  assert_trees_close(nnx.state(g), nnx.state(want_g), n=b * T, zero_leaves=("absolute/b",))
  assert not _gathers(hlo), f"all-gathers in the sharded layer's step: {_gathers(hlo)}"


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh_spec, q_gathered",
  [
    # model divides H=4 and KVH=2: each device holds whole groups, nothing is gathered.
    ("data=4,model=2", False),
    # model divides H but not KVH: the kernel runs with heads replicated, so q (split over heads
    # outside, by `constrain`) is gathered over `model`; k / v were never split. Correct, not lean.
    ("data=2,model=4", True),
  ],
)
def test_grouped_heads_under_mesh_match_chunked(mesh_spec, q_gathered):
  """GQA (4 query heads reading 2 kv heads) through the sharded pallas layer: equal to the chunked
  layer with the same weights (unsharded)."""
  kw = dict(attention="fpa", d_model=D, n_heads=4, n_kv_heads=2, seq_len=T)
  pallas = FirstPassageAttention(C.get_config("tiny", attn_impl="pallas", **kw), rngs=nnx.Rngs(1))
  chunked = FirstPassageAttention(C.get_config("tiny", attn_impl="chunked", **kw), rngs=nnx.Rngs(1))
  x, seg = _inputs(4)
  (_, want_y), want_g = _grad(chunked, x, seg)
  mesh = S.make_mesh(mesh_spec)
  with jax.set_mesh(mesh):
    (_, y), g = _grad(pallas, x, seg)
    hlo = _grad.lower(pallas, x, seg).compile().as_text()
  assert_close(y, want_y, n=max(D, T))
  assert_trees_close(nnx.state(g), nnx.state(want_g), n=4 * T, zero_leaves=("absolute/b",))
  q_local = f"f32[{4 // mesh.shape['data']},{T},4,{pallas.cfg.head_dim}]"
  assert all(s.startswith(q_local) for s in _gathers(hlo)) and bool(_gathers(hlo)) == q_gathered, _gathers(hlo)


def test_unsharded_pallas_op_gathers_qkv():
  """The control for the check above: the bare op under the mesh (no shard_map) gathers the whole
  batch of q / k / v ([B, H, T, K] kernel layout) to every device."""
  b, h, k = 8, 2, 8
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(b, T, h, k)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(b, T, h)), jnp.float32)

  def f(q, g):
    q, g = S.constrain(q, S.BTHK), S.constrain(g, S.BTH)
    return ops.fpa_attention(q, q, q, g, g, impl="pallas")

  with jax.set_mesh(S.make_mesh("data=4,model=2")):
    hlo = jax.jit(f).lower(q, g).compile().as_text()
  assert any(s.startswith(f"f32[{b},{h},{T},{k}]") for s in _gathers(hlo)), _gathers(hlo)


def test_local_specs_split_consistently_or_replicate():
  mesh = S.make_mesh("data=4,model=2")
  bthk, bth, bt = (8, T, 2, 4), (8, T, 2), (8, T)
  ins, out = S.local_specs([bthk, bth, bt], [S.BTHK, S.BTH, S.BT], S.BTHK, mesh)
  assert ins == (P("data", None, "model", None), P("data", None, "model"), P("data", None)) and out == ins[0]
  # batch 6 on data=4: replicated in every operand and the output, heads still split
  ins, out = S.local_specs([(6, T, 2, 4), (6, T, 2)], [S.BTHK, S.BTH], S.BTHK, mesh)
  assert ins == (P(None, None, "model", None), P(None, None, "model")) and out == ins[0]
  with pytest.raises(ValueError, match="logical axes"):
    S.local_specs([bth], [S.BTHK], S.BTHK, mesh)


def _step(cfg, mesh, batch):
  graphdef, state, shardings, _ = create_state(cfg, mesh)
  new, metrics = TrainStep(cfg, graphdef, shardings, mesh, None)(state, S.shard_batch(batch, mesh))
  params = {"/".join(map(str, k)): np.asarray(jax.device_get(v.get_value())) for k, v in nnx.to_flat_state(new[0])}
  return float(metrics["loss"]), params


@pytest.mark.slow  # ~30 s of interpret-mode compiles; the layer tests above cover the sharding
def test_train_step_pallas_matches_chunked_on_8_devices():
  """One step of a tiny model (FoX gate, scanned blocks) on data=4,model=2: pallas == chunked."""
  mesh = S.make_mesh("data=4,model=2")
  base = {"task": "synthetic", "attention": "fox", "n_layers": 2, "scan_layers": True, "seq_len": T, "batch_size": 8}
  cfg = C.get_config("tiny", attn_impl="chunked", **base)
  batch = next(SyntheticPipeline(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size))
  want_loss, want = _step(cfg, mesh, batch)
  loss, got = _step(C.get_config("tiny", attn_impl="pallas", **base), mesh, batch)
  assert np.isfinite(loss)
  assert_close(loss, want_loss, n=cfg.batch_size * T)
  assert_trees_close(got, want, n=cfg.batch_size * T)


def test_auto_on_cpu_takes_block_sizes():
  """A pallas BlockSizes with impl="auto" on CPU (which runs "chunked") tiles by its forward block;
  with impl="chunked" itself it is a clear error (before tracing)."""
  assert ops.validate.resolve_impl("auto") == "chunked"
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 12, 1, 4)), jnp.float32) for _ in range(3))
  c = jnp.asarray(rng.normal(size=(1, 12, 1)), jnp.float32)
  for op, gates in ((ops.fpa_attention, (c, -c)), (ops.fox_attention, (jax.nn.log_sigmoid(c),))):
    run = jax.jit(lambda *a, impl, blk, op=op: op(*a, impl=impl, block_size=blk), static_argnames=("impl", "blk"))
    got = run(q, k, v, *gates, impl="auto", blk=BlockSizes(4, 8))
    assert_bitwise(got, run(q, k, v, *gates, impl="chunked", blk=4))  # auto on CPU is this same program
    with pytest.raises(ValueError, match="int block_size"):
      op(q, k, v, *gates, impl="chunked", block_size=BlockSizes(4))
