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


def test_underscored_flags_are_respelled_with_one_warning_each():
  with pytest.warns(FutureWarning, match="is spelled") as rec:
    a = cli.parse(_parser(), ["--data_dir=x", "--no_progress", "--workdir", "w"])
  assert (a.data_dir, a.no_progress, a.workdir) == ("x", True, "w")
  assert [str(w.message).split()[0] for w in rec] == ["--data_dir", "--no_progress"]  # one per flag
  with pytest.raises(SystemExit):  # an unknown flag is argparse's to refuse, in either spelling
    cli.parse(_parser(), ["--data_dirs", "x"])


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
