"""Device mesh and the single logical-axis -> mesh-axis table.

Parameters are annotated with *logical* axis names (the weight constants below) via
`nnx.with_partitioning(init, (EMBED, HEADS, ...))` in `layers.py`; activations are pinned with
`constrain(x, (ACT_BATCH, ACT_SEQ, ...))` at block boundaries, on q/k/v before the attention kernel
and on the logits. Weight and activation names are separate because they shard differently: a
weight's d_model dim is FSDP-sharded over `data`, an activation's batch dim is (and its d_model dim
is not). Nothing else in the code base names a mesh axis except `RULES` (and the batch spec).
Change the parallelism strategy here only.

`constrain` is a no-op unless a mesh is in context (`jax.set_mesh(mesh)`, which the trainer's
step enters), so plain single-device calls such as `model(tokens)` are unchanged.

Mesh axes:
  data   batch parallelism + FSDP (parameters' EMBED dim sharded over `data`, gathered per use)
  model  tensor parallelism over attention heads, the MLP hidden dim and the vocabulary

Multi-process / multi-host: `maybe_initialize_distributed()` (called by `fpa_jax.train.main`)
calls `jax.distributed.initialize(...)` when the environment describes a multi-process job:
  JAX_COORDINATOR_ADDRESS  host:port of process 0's coordinator service (e.g. 10.0.0.1:1234)
  JAX_NUM_PROCESSES        number of processes in the job
  JAX_PROCESS_ID           this process's index, 0 .. JAX_NUM_PROCESSES-1
Set all three (or none: setting only some is an error). Without them, a multi-task SLURM allocation
(SLURM_NTASKS > 1) or FPA_DISTRIBUTED=1 (Cloud TPU pods) lets JAX auto-detect the cluster. On CPU,
cross-process collectives use gloo (`jax_cpu_collectives_implementation`). The mesh then spans
`jax.devices()` (all hosts); each host feeds its slice of the batch via
`jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

# ---- logical axis names of parameters (weights) ----
EMBED = "embed"  # d_model
HEADS = "heads"  # attention heads
HEAD_DIM = "head_dim"  # per-head feature dim
MLP = "mlp"  # SwiGLU hidden dim
VOCAB = "vocab"  # vocabulary
LAYERS = "layers"  # leading axis of the stacked blocks (Config.scan_layers)

# ---- logical axis names of activations (`constrain`, input batches) ----
ACT_BATCH = "act_batch"  # batch
ACT_SEQ = "act_seq"  # sequence
ACT_EMBED = "act_embed"  # d_model of the residual stream
ACT_HEADS = "act_heads"  # attention heads (q/k/v, field, level)
ACT_HEAD_DIM = "act_head_dim"  # per-head feature dim
ACT_MLP = "act_mlp"  # SwiGLU hidden dim
ACT_VOCAB = "act_vocab"  # logits' vocabulary dim
BATCH, SEQ = ACT_BATCH, ACT_SEQ  # older names of the two activation-only axes

MESH_AXES = ("data", "model")

# ---- THE table: logical axis -> mesh axis (None = replicated) ----
RULES: Mapping[str, str | None] = {
  # weights
  EMBED: "data",  # FSDP: weights' d_model dim sharded across the data axis
  HEADS: "model",
  HEAD_DIM: None,
  MLP: "model",
  VOCAB: "model",
  LAYERS: None,  # each device holds every layer of its shard (the scan slices it per step)
  # activations
  ACT_BATCH: "data",  # data parallelism: each device holds its rows of every activation
  ACT_SEQ: None,
  ACT_EMBED: None,  # the residual stream is whole per device (weights are gathered instead)
  ACT_HEADS: "model",  # tensor parallelism
  ACT_HEAD_DIM: None,
  ACT_MLP: "model",
  ACT_VOCAB: "model",
}

# Common activation layouts.
BTD = (ACT_BATCH, ACT_SEQ, ACT_EMBED)  # residual stream [B, T, D]
BTHK = (ACT_BATCH, ACT_SEQ, ACT_HEADS, ACT_HEAD_DIM)  # q, k, v, attention output [B, T, H, K]
BTH = (ACT_BATCH, ACT_SEQ, ACT_HEADS)  # field, level, log forget gate [B, T, H]
BTF = (ACT_BATCH, ACT_SEQ, ACT_MLP)  # SwiGLU hidden [B, T, F]
BTV = (ACT_BATCH, ACT_SEQ, ACT_VOCAB)  # logits [B, T, V]
BT = (ACT_BATCH, ACT_SEQ)  # segment ids, tokens [B, T]


_DIST_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def distributed_args(env: Mapping[str, str] | None = None) -> dict | None:
  """`jax.distributed.initialize` kwargs from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID; None if none is set. Raises a ValueError if only some are set or one is malformed."""
  env = os.environ if env is None else env
  given = {k: env[k] for k in _DIST_VARS if env.get(k, "") != ""}
  if not given or given == {"JAX_NUM_PROCESSES": "1"}:
    return None
  missing = [k for k in _DIST_VARS if k not in given]
  if missing:
    raise ValueError(
      f"multi-process launch: {sorted(given)} set but {missing} not; set all of {_DIST_VARS} "
      "(e.g. JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0)"
    )
  try:
    n, pid = int(given["JAX_NUM_PROCESSES"]), int(given["JAX_PROCESS_ID"])
  except ValueError:
    raise ValueError(f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers, got {given}") from None
  if n < 1 or not 0 <= pid < n:
    raise ValueError(f"need JAX_NUM_PROCESSES >= 1 and 0 <= JAX_PROCESS_ID < JAX_NUM_PROCESSES, got {given}")
  return {"coordinator_address": given["JAX_COORDINATOR_ADDRESS"], "num_processes": n, "process_id": pid}


def maybe_initialize_distributed() -> bool:
  """Call `jax.distributed.initialize` iff the environment says this is a multi-process job (see the
  module docstring); must run before anything touches a JAX backend. Returns whether it did."""
  env = os.environ
  kwargs = distributed_args(env)
  auto = int(env.get("SLURM_NTASKS", "1")) > 1 or env.get("FPA_DISTRIBUTED", "0") == "1"
  if kwargs is None and not auto:
    return False
  if jax.distributed.is_initialized():
    return True
  platforms = env.get("JAX_PLATFORMS", "") or (jax.config.jax_platforms or "")
  if not platforms or "cpu" in platforms.split(","):
    # CPU devices talk across processes through gloo (must be set before the backend starts).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**(kwargs or {}))
  return True


def parse_mesh(spec: str | None, n_devices: int | None = None) -> dict[str, int]:
  """'data=4,model=2' -> {'data': 4, 'model': 2}. None/'' -> all devices on `data`.

  Raises a ValueError saying what to change if the product does not match the device count.
  """
  n = jax.device_count() if n_devices is None else n_devices
  if not spec:
    return {"data": n, "model": 1}
  sizes: dict[str, int] = {}
  for part in spec.split(","):
    name, sep, val = part.strip().partition("=")
    if not sep or name not in MESH_AXES or not val.strip().isdigit() or int(val) < 1:
      raise ValueError(
        f"bad --mesh entry {part!r} in {spec!r}: expected e.g. 'data=4,model=2' "
        f"with axes from {MESH_AXES} and positive sizes"
      )
    if name in sizes:
      raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
    sizes[name] = int(val)
  sizes = {"data": sizes.get("data", 1), "model": sizes.get("model", 1)}
  if sizes["data"] * sizes["model"] != n:
    raise ValueError(
      f"--mesh {spec!r} has {sizes['data']}x{sizes['model']}="
      f"{sizes['data'] * sizes['model']} devices but {n} are available; "
      f"use sizes whose product is {n} (e.g. --mesh data={n // sizes['model'] if n % sizes['model'] == 0 else n},model="
      f"{sizes['model'] if n % sizes['model'] == 0 else 1})"
    )
  return sizes


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A ('data', 'model') mesh from a spec string such as 'data=4,model=2' (None: pure data parallel)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh(spec, len(devices))
  # Auto axes: GSPMD propagates shardings through the model from the in/out specs we give.
  return jax.make_mesh(
    (sizes["data"], sizes["model"]), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices
  )


def make_abstract_mesh(
  spec: str | None, n_devices: int, abstract_device: jax.sharding.AbstractDevice | None = None
) -> jax.sharding.AbstractMesh:
  """The mesh `make_mesh(spec)` builds on `n_devices` devices, without the devices: a step on it
  (`fpa_jax.train.TrainStep`) can be exported but not run, e.g. a TPU pod's from a CPU host, where
  `abstract_device` is a TPU `jax.sharding.AbstractDevice` (Mosaic reads its kind: docs/ops.md,
  "Lowering without the hardware")."""
  sizes = parse_mesh(spec, n_devices)
  return jax.sharding.AbstractMesh(
    (sizes["data"], sizes["model"]),
    MESH_AXES,
    axis_types=(AxisType.Auto, AxisType.Auto),
    abstract_device=abstract_device,
  )


def logical_to_spec(
  axes: Sequence[str | None] | None,
  shape: Sequence[int] | None = None,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> P:
  """Map logical axis names to a PartitionSpec via RULES.

  With `shape` and `mesh`, a dim whose size the mesh axis does not divide is replicated instead
  (e.g. 2 heads on model=4), and a mesh axis is used at most once per array.
  """
  if not axes:
    return P()
  used: set[str] = set()
  out = []
  for i, name in enumerate(axes):
    if name is not None and name not in RULES:
      raise ValueError(f"unknown logical axis {name!r}; add it to fpa_jax.sharding.RULES")
    mesh_axis = RULES.get(name) if name is not None else None
    if mesh_axis is not None and mesh is not None:
      if mesh_axis not in mesh.shape or mesh_axis in getattr(mesh, "manual_axes", ()):
        mesh_axis = None  # a mesh without that axis (e.g. no `model`), or inside shard_map over it
      elif shape is not None and shape[i] % mesh.shape[mesh_axis] != 0:
        mesh_axis = None
    if mesh_axis in used:
      mesh_axis = None
    if mesh_axis is not None:
      used.add(mesh_axis)
    out.append(mesh_axis)
  return P(*out)


def state_shardings(abstract_state, mesh: jax.sharding.Mesh):
  """NamedSharding tree for an (abstract) nnx.State, from each Variable's `out_sharding` names."""

  def one(v):
    if isinstance(v, nnx.Variable):
      axes = v.get_metadata().get("out_sharding")
      shape = getattr(v.get_value(), "shape", ())
      return v.replace(NamedSharding(mesh, logical_to_spec(axes, shape, mesh)))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """[batch, seq] arrays: batch over the data axis."""
  return NamedSharding(mesh, P(RULES[BATCH]))


def shard_batch(batch: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
  """Host-local numpy batch -> global jax.Arrays sharded over `data` (multi-host safe)."""
  sh = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sh, np.asarray(v)) for k, v in batch.items()}


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pin activation `x` to the sharding its logical `axes` map to (RULES) on the mesh in context.

  No mesh in context (`jax.set_mesh`): returns x unchanged, so single-device calls, tests and
  inference need no mesh. A dim the mesh axis does not divide (e.g. batch 1 on data=8 while
  decoding) stays replicated. Under the trainer's mesh this stops XLA from gathering whole-batch
  activations where it should gather FSDP-sharded weights.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.are_all_axes_manual:
    return x
  if len(axes) != x.ndim:
    raise ValueError(f"constrain: {len(axes)} logical axes {tuple(axes)} for an array of shape {x.shape}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh)))


def local_specs(
  shapes: Sequence[Sequence[int]],
  in_axes: Sequence[Sequence[str | None]],
  out_axes: Sequence[str | None],
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
) -> tuple[tuple[P, ...], P]:
  """(in_specs, out_spec) that split arrays of `shapes` (logical `in_axes` each) over `mesh`.

  One decision per logical name across all the arrays: a name is sharded (RULES) only if its mesh
  axis is in the mesh, not already manual, and divides that dim in every array; otherwise it is
  replicated in all of them, as `constrain` leaves it (so no extra gather, only redundant compute
  along that axis; e.g. an eval batch of 3 on data=4 still runs). The output is split like the
  inputs; an output name no input has is replicated. Raises on a rank mismatch or unknown name.
  """
  free = set(mesh.axis_names) - set(getattr(mesh, "manual_axes", ()))
  rule: dict[str, str | None] = {}
  for shape, names in zip(shapes, in_axes, strict=True):
    if len(names) != len(shape):
      raise ValueError(f"local_specs: {len(names)} logical axes {tuple(names)} for an array of shape {tuple(shape)}")
    for name, size in zip(names, shape):
      if name is None:
        continue
      if name not in RULES:
        raise ValueError(f"unknown logical axis {name!r}; add it to fpa_jax.sharding.RULES")
      m = RULES[name]
      ok = m in free and size % mesh.shape[m] == 0
      rule[name] = m if ok and rule.get(name, m) is not None else None
  spec = lambda names: logical_to_spec([n if rule.get(n) else None for n in names])
  return tuple(spec(names) for names in in_axes), spec(out_axes)


def shard_local(
  fn, args: Sequence[jax.Array], in_axes: Sequence[Sequence[str | None]], out_axes: Sequence[str | None]
) -> jax.Array:
  """fn(*args) run by each device on its own shard (`jax.shard_map`) of the mesh in context.

  For ops XLA cannot partition (a `pallas_call` is a custom call: GSPMD would gather its operands
  to every device) whose math is independent along the sharded dims (e.g. per batch row and head),
  so `fn` needs no collectives. in_axes: the logical axes of each arg; out_axes: those of fn's one
  output (`local_specs`). No mesh, a one-device mesh, or every axis already manual: plain fn(*args).
  """
  mesh = jax.sharding.get_abstract_mesh()
  free = tuple(a for a in mesh.axis_names if a not in getattr(mesh, "manual_axes", ()))
  if mesh.empty or int(np.prod([mesh.shape[a] for a in free])) == 1:
    return fn(*args)
  in_specs, out_spec = local_specs([x.shape for x in args], in_axes, out_axes, mesh)
  # check_vma=False: a pallas_call's out_shape carries no varying-axes type; the specs above are
  # the promise instead (an axis no spec names is replicated in and out).
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, axis_names=set(free), check_vma=False)(
    *args
  )
