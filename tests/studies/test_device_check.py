"""`experiments.device_check`: it refuses on CPU without --smoke, and its smoke run (tiny sizes, the
Pallas interpreter) checks and times every kernel it would run on an accelerator."""

from __future__ import annotations

import json

import pytest

from experiments import device_check as DC


def test_refuses_on_cpu_without_smoke():
  with pytest.raises(SystemExit, match="not a GPU or TPU.*pass --smoke"):
    DC.refuse_cpu("cpu", smoke=False)
  DC.refuse_cpu("cpu", smoke=True)
  DC.refuse_cpu("gpu", smoke=False)
  with pytest.raises(SystemExit, match="not a GPU or TPU"):
    DC.main(["--out", "unused"])  # the suite runs on CPU


@pytest.mark.slow  # the kernels it compiles: tests/ops/pallas (interpreter), tests/ops/test_skip.py (chunked)
def test_smoke_run_checks_times_and_resumes(tmp_path):
  out = tmp_path / "dc"
  res = DC.main(["--smoke", "--out", str(out)])
  checks = res["checks"]
  assert sorted(checks) == sorted(f"{k}_{v}_float32" for k in DC.KINDS for v in DC.VARIANTS)
  assert res["all_checks_ok"], checks
  for name, c in checks.items():
    assert set(c["arrays"]) >= {"out", "dq", "dk", "dv"} and all(a["allowed"] > 0 for a in c["arrays"].values())
    if "block_sparse" in name:
      assert c["tiles_dropped"] > 0, name  # the skip bound drops tiles: the sparse walk is exercised
  rows = res["timing"]["64"]["rows"]
  assert {r["method"] for r in rows} == set(DC.timed_methods("cpu"))
  assert all(r["fwdbwd_s"] > 0 for r in rows)
  md = (tmp_path / "dc.md").read_text()
  assert "python -m experiments.device_check --smoke" in md and "fpa_block_sparse_float32 | ok" in md
  # a rerun with the same settings keeps every cell (nothing recompiled)
  before = json.loads((tmp_path / "dc.json").read_text())
  again = DC.main(["--smoke", "--out", str(out)])
  assert again["checks"] == before["checks"] and again["timing"] == before["timing"]
