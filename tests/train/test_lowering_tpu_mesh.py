"""The `base110m` training step lowers for TPU on a 4 x 4 abstract mesh, on CPU (docs/training.md,
"Training on a TPU pod").

The step `fpa_jax.train.TrainStep` builds for a data=4, model=4 `jax.sharding.AbstractMesh` of TPU
devices (`sharding.make_abstract_mesh`: 16 devices this host does not have, more than the 8
tests/conftest.py simulates), with the preset's own shapes (12 layers, global batch 256 of 2048
tokens, bf16 compute) and the attention a TPU run uses, attn_impl="pallas" with pallas_backend="tpu",
is exported with `jax.export` for "tpu": the model and optimizer state are `nnx.eval_shape`'s
(nothing of 110M is allocated) and the batch is `jax.ShapeDtypeStruct`s. That runs GSPMD's sharding
annotations, the shard_map the layer runs the kernels in and Mosaic's lowering of every kernel; not
XLA's TPU compiler nor any run. About 4 s on CPU: the shapes cost nothing, no kernel is compiled.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax import train as TR
from fpa_jax.ops import pallas
from fpa_jax.ops.pallas.lowering import DEFAULT_TPU_DEVICE_KIND

MESH = "data=4,model=4"
KERNELS = sorted(f"fpa_attention_{p}" for p in ("fwd", "dkv", "dq"))


@pytest.fixture(scope="module")
def exported():
  """(config, abstract mesh, {input path: its PartitionSpec in the export}, the export, the
  trainer's state shardings)."""
  cfg = C.get_config("base110m", attn_impl="pallas", pallas_backend="tpu")
  device = jax.sharding.AbstractDevice(device_kind=DEFAULT_TPU_DEVICE_KIND, num_cores=1, platform="tpu")
  mesh = S.make_abstract_mesh(MESH, 16, device)
  cfg.validate_mesh(dict(mesh.shape))
  tx = TR.make_optimizer(cfg)
  graphdef, abstract = TR.abstract_state(cfg, tx)
  shardings = S.state_shardings(abstract, mesh)
  step = TR.TrainStep(cfg, graphdef, shardings, mesh, tx)
  sd = jax.ShapeDtypeStruct
  state = jax.tree.map(lambda a, sh: sd(a.shape, a.dtype, sharding=sh), abstract, shardings)
  rows = (cfg.batch_size, cfg.seq_len)
  batch = {
    k: sd(rows, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=S.batch_sharding(mesh))
    for k in ("inputs", "targets", "segment_ids", "loss_mask")
  }
  exp = step.jitted.export(state, batch, platforms=["tpu"])
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((state, batch))[0]]
  specs = dict(zip(paths, (s.spec for s in exp.in_shardings_jax(mesh)), strict=True))
  return cfg, mesh, specs, exp, shardings


def test_the_step_exports_for_tpu_on_16_devices(exported):
  _, mesh, _, exp, _ = exported
  assert exp.platforms == ("tpu",)
  assert exp.nr_devices == 16 == mesh.size


def test_the_attention_runs_mosaic_kernels_per_shard(exported):
  """The Mosaic kernels (forward, dK / dV, dQ; each lowered once, called by every layer) run inside
  a shard_map per layer and pass, on a device's share: 256 / 4 rows, 12 / 4 heads, 2048 tokens."""
  cfg, _, _, exp, _ = exported
  calls = pallas.lowered_kernels(exp)
  assert sorted(n for _, n in calls) == KERNELS and {t for t, _ in calls} == {"tpu_custom_call"}, calls
  text = exp.mlir_module()
  assert text.count("sdy.manual_computation(") == 2 * cfg.n_layers  # forward and backward of each layer
  fwd = next(ln for ln in text.splitlines() if "@tpu_custom_call(" in ln and 'kernel_name = "fpa_attention_fwd"' in ln)
  q = re.findall(r"tensor<[^>]*>", fwd[fwd.rindex("} : (") :])[0]
  assert q == f"tensor<{cfg.batch_size // 4}x{cfg.n_heads // 4}x{cfg.seq_len}x{cfg.head_dim}xbf16>", q


def test_the_inputs_carry_the_rules_shardings(exported):
  """The export's parameters and their Adam moments (inputs [0]: the (model, optimizer) state) are
  sharded as `sharding.RULES` puts them (heads, the MLP and the vocabulary over model, d_model over
  data: FSDP), the batch (inputs [1]) over data."""
  _, _, specs, _, shardings = exported
  by_name = lambda name: {s for p, s in specs.items() if p.startswith("[0]") and f"['{name}'].value" in p}
  assert by_name("wq") == by_name("wk") == by_name("wv") == {P("data", "model", None)}
  assert by_name("wo") == {P("model", None, "data")}
  assert by_name("w_up") == by_name("w_gate") == {P("data", "model")} and by_name("w_down") == {P("model", "data")}
  assert by_name("embed") == {P("model", "data")}  # [vocab, d_model], tied to the output
  assert {s for p, s in specs.items() if p.startswith("[1]")} == {P("data")}  # inputs, targets, ...
  # exactly the state shardings the trainer computes, for every parameter and optimizer moment
  assert [s for p, s in specs.items() if p.startswith("[0]")] == [sh.spec for sh in jax.tree.leaves(shardings)]
