"""`experiments.device_check` on CPU: its quick run lowers every kernel it would run for TPU and
GPU and records the run phase as skipped (no accelerator); the budget skips timed cells with the
reason; (slow) its run phase goes through end to end with the kernels in the Pallas interpreter."""

from __future__ import annotations

import json

import jax
import pytest

from experiments import device_check as DC


@pytest.mark.slow  # a study's tiny run; every kernel's lowering: tests/ops/pallas/test_lowering.py
def test_quick_run_lowers_everything_and_skips_the_run_phase(tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("the quick run's off-device path")
  res = DC.main(["--quick", "--out-dir", str(tmp_path)])
  low = res["lower"]
  assert low["platforms"] == ["tpu", "cuda"] and low["all_lowered"], low
  got = {(e["platform"], e["kernel"], e["kind"], e["pass"], e["shape"]) for e in low["entries"] if e["lowered"]}
  shapes = ["check"] + [f"T={t}" for t in DC.SIZES["quick"]["seq_lens"]]
  want = {("tpu", kern, kind, p, "check") for kern in ("whole", "stream") for kind in DC.KINDS for p in ("fwd", "grad")}
  want |= {("tpu", "stream", kind, p, s) for kind in DC.KINDS for p in ("fwd", "grad") for s in shapes}
  want |= {("cuda", "whole", kind, p, s) for kind in DC.KINDS for p in ("fwd", "grad") for s in shapes}
  assert got == want and len(low["entries"]) == len(want)
  assert res["run"]["skipped"].startswith(DC.NO_ACCELERATOR) and res["ok"]
  on_disk = json.loads((tmp_path / "device_check.json").read_text())
  assert on_disk["run"] == res["run"] and on_disk["meta"]["command"].startswith("python -m experiments.device_check")
  md = (tmp_path / "device_check.md").read_text()
  assert f"`python -m experiments.device_check --quick --out-dir {tmp_path}`" in md
  assert "| tpu | check | fpa_stream | yes | yes |" in md and "Run phase skipped: no accelerator" in md


def test_budget_records_cells_not_reached():
  rows = []
  DC.run_timing("tpu", DC.SIZES["quick"], 4, 1, rows, lambda est=None: "not reached: spent", lambda: None)
  assert len(rows) == 2 * len(DC.timed_methods("tpu")) and all(r["skipped"] == "not reached: spent" for r in rows)
  res = {"settings": {"backend": "tpu", "device_kind": "TPU v5 lite", "check_shape_B_T_H_KVH_D": [1, 256, 4, 2, 64]}}
  res["settings"] |= {"timed_B_H_KVH_D": [1, 4, 4, 64], "repeats": 1}
  res["run"] = {"checks": {"fpa_stream": {"against": "chunked", "skipped": "not reached: spent"}}, "timing": rows}
  md = DC.markdown(res)
  assert (
    "| fpa_stream | chunked | skipped |" in md and "| 256 | dpa_xla | fwd | — | — | — | — | not reached: spent |" in md
  )


@pytest.mark.slow  # ~50 s: the checks and the timing compile every kernel, here in the interpreter
def test_run_phase_in_the_interpreter():
  """The run phase's code on CPU: TPU's checks and timed methods, the kernels interpreted (backend
  "auto"), at the quick sizes: every check passes and every timed cell has a time and a ratio."""
  saved = {}
  out = DC.run_phase("tpu", DC.SIZES["quick"], 4, 1, lambda est=None: None, saved.update)
  assert list(out["checks"]) == [c[0] for c in DC.check_cells("tpu")] and out["all_checks_ok"], out["checks"]
  assert all(c["arrays"]["out"]["allowed"] > 0 for c in out["checks"].values())
  assert {r["method"] for r in out["timing"]} == set(DC.timed_methods("tpu"))
  assert all(r["median_ms"] > 0 and r["vs_dpa"] > 0 for r in out["timing"]), out["timing"]
  assert saved["all_checks_ok"]
