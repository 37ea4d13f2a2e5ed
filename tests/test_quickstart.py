"""The README's first command (`bash run.sh quickstart` = `python -m experiments.quickstart`)."""

from __future__ import annotations

import json

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
