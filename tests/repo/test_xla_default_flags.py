"""The default-flag tier: the suite compiles at fast flags (`tests/conftest.py`, TEST_XLA_FLAGS), which
users never run; the bit-for-bit and cross-implementation checks marked `xla_default` run again here, in
one fresh pytest process at XLA's default flags, sharing its compiled programs through each file's
module fixtures."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# where the marked checks live (a new file with a marked test is added here; the tier fails on none found)
TIER_FILES = ("tests/inference/test_decode.py", "tests/inference/test_policies.py")


@pytest.mark.xla_default
def test_tier_runs_at_the_flags_it_says():
  flags = os.environ["XLA_FLAGS"]
  if os.environ.get("FPA_XLA_DEFAULT_FLAGS") == "1":
    assert flags == "--xla_force_host_platform_device_count=8"
  else:
    assert "--xla_backend_optimization_level=0" in flags


def test_exact_checks_hold_at_xla_default_flags():
  if os.environ.get("FPA_XLA_DEFAULT_FLAGS") == "1":
    pytest.skip("already the tier")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"FPA_XLA_DEFAULT_FLAGS": "1"}
  cmd = [
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:xdist",
    "-m",
    "xla_default and not slow",
  ]
  cmd += [*TIER_FILES, f"{Path(__file__).relative_to(REPO)}::test_tier_runs_at_the_flags_it_says"]
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  tail = out.stdout[-3000:] + out.stderr[-2000:]
  assert out.returncode == 0, tail
  passed = re.search(r"(\d+) passed", out.stdout)
  assert passed and int(passed.group(1)) >= 10, tail  # the marked cases (not slow) and the flags check
  assert not re.search(r"\d+ (failed|error)", out.stdout), tail
