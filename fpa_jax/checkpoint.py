"""Orbax checkpointing of the whole training state: model + optimizer (+ step), data iterator, config.

Layout: `<workdir>/checkpoints/<step>/{state,data,config}`. Atomicity: orbax writes each step into
`<step>.orbax-checkpoint-tmp*` and renames it to `<step>` only once every item is written
(finalize), so a crash mid-save leaves at most a tmp directory, which `latest_step()` ignores (and
orbax deletes on the next start). A finalized checkpoint can still be damaged later (a disk fault,
an interrupted copy): `restore_newest` (what a resumed run uses) falls back to the newest step that
restores, logs each one it skipped and why, and moves those to `<directory>.corrupt/`; if none
restores it raises one `CheckpointRestoreError` naming the directory and the fix (tests:
`tests/train/test_checkpoint.py`). Restores are sharded directly onto the mesh from an abstract
target (ShapeDtypeStruct + NamedSharding), never materialised unsharded.

Data iterator state is per process (each host reads its own shard): `save` gathers every process's
JSON state to all processes and stores `{"per_process": {"0": ..., "1": ...}}` (orbax's JSON item
is written by process 0 only); `restore` hands each process its own entry. A checkpoint written
before this layout (one bare state) restores as that state on every process.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointRestoreError(ValueError):
  """No checkpoint in the directory restores (`Checkpointer.restore_newest`); the message says how to go on."""


def _short(e: BaseException, head: int = 100, tail: int = 200) -> str:
  """One line of an exception: orbax / tensorstore errors carry kilobytes of JSON specs, and their
  cause (e.g. "Requested byte range [0, 4557) is not valid for value of size 2278") comes last."""
  lines = str(e).split(" [tensorstore_spec")[0].strip().splitlines()
  text = lines[0] if lines else ""
  return f"{type(e).__name__}: " + (text if len(text) <= head + tail else f"{text[:head]} ... {text[-tail:]}")


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

  def newest_config(self) -> tuple[int, dict] | None:
    """(step, saved config) of the newest checkpoint whose config item reads; None if there is none."""
    for step in sorted(self.all_steps(), reverse=True):
      try:
        return step, self.saved_config(step)
      except Exception:  # noqa: BLE001 - an unreadable one is reported by restore_newest
        continue
    return None

  def restore_newest(
    self, abstract_state: Any, *, check_config: Callable[[dict], None] | None = None, log: Callable[[str], None]
  ) -> tuple[int, Any, dict, dict] | None:
    """-> (step, state, data state, config) of the newest checkpoint that restores (see `restore`),
    or None if the directory holds no checkpoint.

    A checkpoint that fails to restore (its files truncated by a disk fault, an interrupted copy)
    is skipped, and `log` says which step and why. Once an older one restores, the skipped steps
    are moved out of the way, to `<directory>.corrupt/<step>` (kept for inspection): orbax refuses
    to save a step that exists and `keep` would count them, so the run could not checkpoint past
    them. If none restores, nothing is moved and `CheckpointRestoreError` names the directory, each
    step's error and the fix. `check_config(saved config dict)` runs before each restore; its
    errors (e.g. another model's checkpoint) propagate unchanged, they are no corruption."""
    failed: list[tuple[int, str]] = []
    for step in sorted(self.all_steps(), reverse=True):
      try:
        config = self.saved_config(step)
      except Exception as e:  # noqa: BLE001 - any read error: try the next older checkpoint
        failed.append((step, _short(e)))
        log(f"[checkpoint] skipping step {step} in {self.directory}: its config does not read ({failed[-1][1]})")
        continue
      if check_config is not None:
        check_config(config)
      try:
        state, data, config = self.restore(step, abstract_state)
      except Exception as e:  # noqa: BLE001
        failed.append((step, _short(e)))
        log(f"[checkpoint] skipping step {step} in {self.directory}: it does not restore ({failed[-1][1]})")
        continue
      if failed:
        where = self._quarantine([s for s, _ in failed])
        log(f"[checkpoint] restored step {step}; moved the unreadable step(s) {[s for s, _ in failed]} to {where}")
      return step, state, data, config
    if failed:
      listing = "; ".join(f"step {s}: {why}" for s, why in failed)
      dirs = " ".join(os.path.join(self.directory, str(s)) for s, _ in failed)
      raise CheckpointRestoreError(
        f"no checkpoint in {self.directory} restores ({listing}). If their files are damaged (a disk "
        f"fault, an interrupted copy), none of these steps can be resumed: move or delete them (rm -r {dirs}) "
        "to start this workdir over, or train in a fresh --workdir. If they are intact, the errors above "
        "say what failed instead (e.g. memory, a file system that is not mounted)."
      )
    return None

  def _quarantine(self, steps: list[int]) -> str:
    """Moves the step directories `steps` to `<directory>.corrupt/` (process 0; all processes then
    reload the step list); returns that directory."""
    dest = self.directory.rstrip(os.sep) + ".corrupt"
    if jax.process_index() == 0:
      os.makedirs(dest, exist_ok=True)
      for step in steps:
        target = os.path.join(dest, str(step))
        n = 1
        while os.path.exists(target):  # a step quarantined before: keep both
          target, n = os.path.join(dest, f"{step}.{n}"), n + 1
        os.replace(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils as mhu

      mhu.sync_global_devices("fpa_jax.checkpoint.quarantine")
    self.manager.reload()
    return dest

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
