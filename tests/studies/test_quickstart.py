"""The README's first command (`bash run.sh quickstart` = `python -m experiments.quickstart`)."""

from __future__ import annotations

import json

import pytest

from experiments import quickstart


def test_bracket_demo_live_keys_form_a_stack():
  lines = quickstart.live_keys_demo("x(a(bc)d(e)f)y")
  # after the inner scopes close only their enclosing keys remain; after the outer one, only x
  assert lines[6].endswith("live keys x(a...)")
  assert lines[10].endswith("live keys x(a...)d..)")
  assert lines[13].endswith("live keys x...........)y")


def test_bindings_lm_data_resumes_exactly():
  from fpa_jax.data.bindings import BindingsLM

  a = BindingsLM(seq_len=64, batch_size=2)
  next(a)
  state = a.get_state()
  want = next(a)
  b = BindingsLM(seq_len=64, batch_size=2)
  b.set_state(state)
  got = next(b)
  assert all((want[k] == got[k]).all() for k in want)
  assert want["inputs"].shape == (2, 64) and want["loss_mask"].max() == 4.0  # answers weighted


@pytest.mark.slow
def test_quickstart_smoke(tmp_path):
  out = tmp_path / "results"
  assert quickstart.main(["--small", "--out", str(out), "--workdir", str(tmp_path / "runs")]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["live_sets"]) >= {"fpa", "stack", "fox", "softmax"}
  policies = [r["policy"] for r in summary["decode"]]
  assert policies[0] == "full" and {"fpa_budget 12.5%", "window 12.5%", "h2o 12.5%"} <= set(policies)
  full = summary["decode"][0]
  assert full["cache_fraction"] == 1.0 and full["lost_mass_max"] == 0.0
  assert (out / "live_sets.md").exists() and (out / "decode.md").exists()
  assert (tmp_path / "runs" / f"{quickstart.LM_METHOD}_bindings_lm" / "metrics.jsonl").exists()
  from experiments.bindings_lm import FPA_ROWS

  assert quickstart.FPA_ROWS == FPA_ROWS and quickstart.LM_METHOD in FPA_ROWS
  assert all(0.0 <= r["far_accuracy"] <= 1.0 for r in summary["decode"])
  assert summary["lm"]["steps"] == 4 and summary["lm"]["check_loss"] > 0


def test_shipped_model_is_the_recipe_it_names():
  """The exported step-3 model: its config is the bindings study's recipe at the recorded steps, and
  it reproduces the loss recorded when `--train` exported it (the weights are the trained ones)."""
  from experiments import bindings_lm
  from fpa_jax.data.bindings import BindingsLM
  from fpa_jax.inference import load_exported

  model, cfg, meta = load_exported(quickstart.ASSET)
  assert (
    meta["command"].startswith("python -m experiments.quickstart --train") and meta["method"] == quickstart.LM_METHOD
  )
  study = bindings_lm.parse_args(["--steps", str(meta["steps"]), "--train-len", str(quickstart.LM_LEN)])
  want = bindings_lm.study_config(meta["method"], study, 0, BindingsLM(seq_len=64, batch_size=1).vocab_size)
  assert cfg.model == want.model and cfg.steps == meta["steps"]
  assert abs(quickstart.check_loss(model) - meta["check_loss"]) < 1e-4 * max(1.0, meta["check_loss"])
