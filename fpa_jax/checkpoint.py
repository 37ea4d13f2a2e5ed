"""Orbax checkpointing of the whole training state: model + optimizer (+ step), data iterator, config.

Layout: `<workdir>/checkpoints/<step>/{state,data,config}`. Atomicity: orbax writes each step into
`<step>.orbax-checkpoint-tmp*` and renames it to `<step>` only once every item is written
(finalize), so a crash mid-save leaves at most a tmp directory, which `latest_step()` ignores (and
orbax deletes on the next start). Restores are sharded directly onto the mesh from an abstract
target (ShapeDtypeStruct + NamedSharding), never materialised unsharded.

Data iterator state is per process (each host reads its own shard): `save` gathers every process's
JSON state to all processes and stores `{"per_process": {"0": ..., "1": ...}}` (orbax's JSON item
is written by process 0 only); `restore` hands each process its own entry. A checkpoint written
before this layout (one bare state) restores as that state on every process.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` checkpoints of {state, data, config} under `directory`."""

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      create=True,
      enable_async_checkpointing=async_save,
      cleanup_tmp_directories=True,  # drop leftovers of a crashed save on start
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
    """Starts an (async) save; device->host copies finish before this returns, so the caller may
    donate `state` to the next step right away."""
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(gather_process_states(data_state)),
        config=ocp.args.JsonSave(config),
      ),
    )

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
    """-> (state sharded like `abstract_state`, this process's data iterator state, saved config
    dict); see `own_process_state` for a checkpoint of a different process count."""
    out = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore(),
      ),
    )
    return out["state"], own_process_state(out["data"], strict=False), out["config"]

  def saved_config(self, step: int) -> dict:
    """The config dict saved with `step` alone (no state read): to check it before a restore."""
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStruct leaves carrying the target NamedSharding (restore target)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def gather_process_states(state: Any) -> dict:
  """Every process's JSON-serialisable `state` -> {"per_process": {"<i>": state_i}} on all processes.

  A collective (all processes must call it): the JSON bytes go through `process_allgather` as
  uint8 arrays padded to the longest one."""
  n = jax.process_count()
  if n == 1:
    return {"per_process": {"0": state}}
  from jax.experimental import multihost_utils as mhu

  raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
  lens = np.asarray(mhu.process_allgather(np.int64(raw.size))).reshape(n)
  buf = np.zeros(int(lens.max()), np.uint8)
  buf[: raw.size] = raw
  allb = np.asarray(mhu.process_allgather(buf)).reshape(n, -1)
  return {"per_process": {str(i): json.loads(allb[i, : lens[i]].tobytes().decode()) for i in range(n)}}


def own_process_state(saved: Any, strict: bool = True) -> Any:
  """This process's entry of a `gather_process_states` dict (old single-state checkpoints: as is).

  If the checkpoint was written by a different number of processes: a ValueError (`strict`), else
  `saved` unchanged (so model-only loads, e.g. inference on one host, still work)."""
  if not (isinstance(saved, dict) and set(saved) == {"per_process"}):
    return saved  # written before per-process states (or already this process's entry)
  per = saved["per_process"]
  if len(per) != jax.process_count():
    if not strict:
      return saved
    raise ValueError(
      f"checkpoint holds data iterator states of {len(per)} processes but this job has "
      f"{jax.process_count()}; resume with the original number of processes"
    )
  return per[str(jax.process_index())]
