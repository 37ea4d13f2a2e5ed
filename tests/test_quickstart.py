"""The README's first command (`bash run.sh quickstart` = `python -m fpa_jax.quickstart`)."""

from __future__ import annotations

import json

from fpa_jax import quickstart


def test_bracket_demo_live_keys_form_a_stack():
  lines = quickstart.live_keys_demo("x(a(bc)d(e)f)y")
  # after the inner scopes close only their enclosing keys remain; after the outer one, only x
  assert lines[6].endswith("live keys x(a...)")
  assert lines[10].endswith("live keys x(a...)d..)")
  assert lines[13].endswith("live keys x...........)y")


def test_quickstart_smoke(tmp_path):
  wd = tmp_path / "qs"
  assert quickstart.main(["--steps", "2", "--attention", "fpa", "--workdir", str(wd),
                          "--data-dir", str(tmp_path / "data")]) == 0
  summary = json.loads((wd / "summary.json").read_text())
  assert summary["fpa"]["step"] == 2 and summary["fpa"]["eval_loss"] is not None
  assert (wd / "fpa" / "metrics.jsonl").exists()
