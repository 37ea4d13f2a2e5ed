"""One flag style across the package's command lines, and the smallest smoke run."""

from __future__ import annotations

import argparse

import pytest

from fpa_jax import cli


def _parser():
  ap = argparse.ArgumentParser()
  ap.add_argument("--data-dir")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--workdir")
  return ap


def test_flags_are_dashed_and_underscored_ones_are_unknown():
  a = cli.parse(_parser(), ["--data-dir=x", "--no-progress", "--workdir", "w"])
  assert (a.data_dir, a.no_progress, a.workdir) == ("x", True, "w")
  for argv in (["--data_dir=x"], ["--no_progress"], ["--data-dirs", "x"]):  # one spelling: argparse refuses
    with pytest.raises(SystemExit):
      cli.parse(_parser(), argv)


@pytest.mark.parametrize("module", ["fpa_jax.train", "fpa_jax.inference.__main__", "fpa_jax.eval"])
def test_every_cli_spells_its_flags_with_dashes(module, monkeypatch):
  import importlib

  mod = importlib.import_module(module)
  seen = []
  monkeypatch.setattr(cli, "parse", lambda ap, argv=None: seen.append(ap) or (_ for _ in ()).throw(SystemExit(0)))
  with pytest.raises(SystemExit):
    mod.parse_args(["--workdir", "w"])
  flags = [s for act in seen[0]._actions for s in act.option_strings if s.startswith("--")]
  assert flags and not [f for f in flags if "_" in f], flags


def test_train_one_step_smoke_run_clamps_the_warmup(tmp_path, capsys):
  from fpa_jax.train import main

  argv = ["--config", "tiny", "--task", "synthetic", "--steps", "1", "--workdir", str(tmp_path), "--no-progress"]
  assert main(argv) == 0
  err = capsys.readouterr().err
  assert err.count("warmup_steps 2 -> 1") == 1
