"""A damaged checkpoint (its data files truncated, as after a disk fault): resume falls back to the
newest step that restores, says which it skipped and why, and moves the damaged ones aside; if none
restores, one clear error (`fpa_jax.checkpoint.Checkpointer.restore_newest`). CPU, no train step
compiled except the one tiny run of the module fixture."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.checkpoint import Checkpointer, CheckpointRestoreError
from fpa_jax.train import main, train

from _helpers_train import FixedBatch

KW = dict(task="synthetic", n_layers=1, seq_len=16, batch_size=8, ckpt_every=2)
# A failed orbax read leaves a tensorstore callback that finds its asyncio loop closed ("Event loop is
# closed", printed, never raised): noise of the failure path, not of these tests.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def truncate_data_files(step_dir) -> int:
  """Halves every data file of the state item of a step (orbax's OCDBT chunks under .../d/), the
  way a disk fault or an interrupted copy leaves them; returns how many files it cut."""
  n = 0
  for root, _, files in os.walk(os.path.join(step_dir, "state")):
    for f in files:
      path = os.path.join(root, f)
      if os.sep + "d" + os.sep in path:
        os.truncate(path, os.path.getsize(path) // 2)
        n += 1
  assert n, f"no data files under {step_dir}"
  return n


# ---- the Checkpointer on its own (a small pytree, no model) ----


def _tree(step):
  return {"w": jnp.arange(300.0) * step, "b": jnp.full((3,), float(step))}


def _target():
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), _tree(0))


def _saved(tmp_path, steps):
  ck = Checkpointer(tmp_path / "checkpoints", async_save=False)
  for s in steps:
    ck.save(s, _tree(s), {"n": s}, {"d_model": 8})
  return ck


def test_falls_back_past_a_truncated_step_and_moves_it_aside(tmp_path):
  ck = _saved(tmp_path, (1, 2, 3))
  truncate_data_files(tmp_path / "checkpoints" / "3")
  logs = []
  step, state, data, config = ck.restore_newest(_target(), log=logs.append)
  assert (step, data, config) == (2, {"n": 2}, {"d_model": 8})
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_tree(2)["w"]))
  skipped = [line for line in logs if "skipping step 3" in line]
  assert len(skipped) == 1 and "does not restore" in skipped[0] and "not valid for value of size" in skipped[0]
  assert len(skipped[0]) < 600, "one line per skipped step, not orbax's whole error"
  assert any("moved" in line and "checkpoints.corrupt" in line for line in logs)
  # Moved aside (kept for inspection), so the run can checkpoint step 3 again: orbax refuses to
  # save a step that exists.
  assert sorted(os.listdir(tmp_path / "checkpoints.corrupt")) == ["3"] and ck.all_steps() == [1, 2]
  ck.save(3, _tree(3), {"n": 3}, {"d_model": 8})
  ck.wait()
  assert ck.restore_newest(_target(), log=logs.append)[0] == 3
  ck.close()


def test_none_restores_is_one_clear_error_and_moves_nothing(tmp_path):
  ck = _saved(tmp_path, (1, 2))
  for s in (1, 2):
    truncate_data_files(tmp_path / "checkpoints" / str(s))
  with pytest.raises(CheckpointRestoreError, match="no checkpoint in .*checkpoints restores") as e:
    ck.restore_newest(_target(), log=lambda s: None)
  msg = str(e.value)
  assert "step 2: ValueError" in msg and "step 1: ValueError" in msg and "rm -r" in msg and "--workdir" in msg
  assert isinstance(e.value, ValueError) and len(msg) < 2000
  assert ck.all_steps() == [1, 2] and not os.path.exists(tmp_path / "checkpoints.corrupt")
  ck.close()


def test_config_check_errors_are_not_corruption(tmp_path):
  """Another model's checkpoint: the check's own error, nothing skipped or moved; an empty directory
  -> None (a fresh run)."""
  ck = _saved(tmp_path, (1,))

  def refuse(saved):
    raise ValueError(f"different model {saved}")

  with pytest.raises(ValueError, match="different model"):
    ck.restore_newest(_target(), check_config=refuse, log=lambda s: None)
  assert ck.all_steps() == [1]
  ck.close()
  empty = Checkpointer(tmp_path / "empty", async_save=False)
  assert empty.restore_newest(_target(), log=lambda s: None) is None and empty.newest_config() is None
  empty.close()


# ---- a tiny training run resumed past a truncated latest step ----


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """4 steps of the tiny model, checkpoints at steps 2 and 4 (the module's only compiled train step)."""
  wd = tmp_path_factory.mktemp("tiny_run")
  cfg = C.get_config("tiny", steps=4, **KW)
  train(cfg, workdir=str(wd), data=FixedBatch(seq_len=16, batch_size=8), progress=False, log=lambda s: None)
  return wd, cfg


def _copy(tiny_run, tmp_path):
  wd, cfg = tiny_run
  shutil.copytree(wd, tmp_path / "wd")
  return tmp_path / "wd", cfg


def test_resume_falls_back_to_the_step_before_a_truncated_latest(tiny_run, tmp_path):
  wd, cfg = _copy(tiny_run, tmp_path)
  truncate_data_files(wd / "checkpoints" / "4")
  logs = []
  # steps=2: the resumed run restores step 2 and has nothing left to train (no second compile).
  out = train(
    C.replace(cfg, steps=2),
    workdir=str(wd),
    data=FixedBatch(seq_len=16, batch_size=8),
    progress=False,
    mesh=S.make_mesh(None, devices=jax.devices()[:1]),
    log=logs.append,
  )
  assert out["start_step"] == 2
  assert any("skipping step 4" in line and "does not restore" in line for line in logs)
  assert any("resumed from step 2" in line for line in logs)
  assert os.listdir(wd / "checkpoints.corrupt") == ["4"] and sorted(os.listdir(wd / "checkpoints")) == ["2"]


def test_cli_with_no_restorable_checkpoint_fails_with_one_message(tiny_run, tmp_path, capsys):
  wd, _ = _copy(tiny_run, tmp_path)
  for s in (2, 4):
    truncate_data_files(wd / "checkpoints" / str(s))
  argv = ["--config", "tiny", "--task", "synthetic", "--steps", "4", "--workdir", str(wd), "--no-progress"]
  argv += [f"--set={k}={v}" for k, v in KW.items() if k != "task"]
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert "error: no checkpoint in " in err and "rm -r" in err and "Traceback" not in err
  assert sorted(os.listdir(wd / "checkpoints")) == ["2", "4"]


@pytest.mark.slow  # a second compile of the train step
def test_resumed_run_checkpoints_past_the_damaged_step(tiny_run, tmp_path):
  wd, cfg = _copy(tiny_run, tmp_path)
  truncate_data_files(wd / "checkpoints" / "4")
  out = train(cfg, workdir=str(wd), data=FixedBatch(seq_len=16, batch_size=8), progress=False, log=lambda s: None)
  assert (out["start_step"], out["step"], out["last_checkpoint"]) == (2, 4, 4)
  ck = Checkpointer(wd / "checkpoints")
  assert ck.all_steps() == [2, 4]
  ck.close()
