"""One style everywhere: `ruff format` (2-space indents, pyproject.toml) and `ruff check` are clean.

Fix a failure with `.venv/bin/ruff format . && .venv/bin/ruff check --fix .`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
  exe = Path(sys.executable).with_name("ruff")
  if exe.exists():
    return [str(exe)]
  if shutil.which("ruff"):
    return ["ruff"]
  pytest.fail("ruff is not installed: it is pinned in requirements.txt (bash run.sh test installs it)")


@pytest.mark.parametrize("args", [["format", "--check", "--diff"], ["check"]], ids=["format", "lint"])
def test_ruff_clean(args):
  out = subprocess.run(_ruff() + args + ["."], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, f"ruff {' '.join(args)} found problems:\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
