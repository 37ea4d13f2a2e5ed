"""Orbax checkpointing of the whole training state: model + optimizer (+ step), data iterator, config.

Layout: `<workdir>/checkpoints/<step>/{state,data,config}`. Atomicity: orbax writes each step into
`<step>.orbax-checkpoint-tmp*` and renames it to `<step>` only once every item is written
(finalize), so a crash mid-save leaves at most a tmp directory, which `latest_step()` ignores (and
orbax deletes on the next start). Restores are sharded directly onto the mesh from an abstract
target (ShapeDtypeStruct + NamedSharding), never materialised unsharded.
"""

from __future__ import annotations

import os
from typing import Any

import jax
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
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict, config: dict) -> None:
    """Starts an (async) save; device->host copies finish before this returns, so the caller may
    donate `state` to the next step right away."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config),
    ))

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
    """-> (state sharded like `abstract_state`, data iterator state, saved config dict)."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore(),
    ))
    return out["state"], out["data"], out["config"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_with_shardings(abstract_state: Any, shardings: Any) -> Any:
  """ShapeDtypeStruct leaves carrying the target NamedSharding (restore target)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
