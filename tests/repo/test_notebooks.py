"""notebooks/*.ipynb run top to bottom (small sizes, CPU) and are stored without outputs.

Small mode: each notebook's `parameters` cell reads FPA_NOTEBOOK_SMALL=1 from the environment,
which the kernel inherits from this process. The kernel is this interpreter (sys.executable),
through a kernelspec written to a private JUPYTER_PATH, so no other installed python3 kernel is used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
KERNEL = "fpa-jax-test"
CELL_TIMEOUT_S = 600


def test_notebooks_exist():
  assert NOTEBOOKS, f"no notebooks in {NB_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_stripped(path):
  nb = json.loads(path.read_text())
  dirty = [
    i
    for i, c in enumerate(nb["cells"])
    if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)
  ]
  assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; strip them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_parameters_cell(path):
  nb = nbformat.read(path, as_version=4)
  tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1 and "FPA_NOTEBOOK_SMALL" in tagged[0].source


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
  spec = tmp_path / "jupyter" / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(
    json.dumps(
      {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fpa_jax test kernel",
        "language": "python",
      }
    )
  )
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no user profile or startup files
  monkeypatch.setenv("FPA_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in Jupyter


# Every notebook runs with `-m slow` only (02, the scan vs quadratic timings, takes ~80 s); the paths
# they show have fast tests of their own.
@pytest.mark.slow
@pytest.mark.parametrize(
  "path",
  NOTEBOOKS,
  ids=lambda p: p.name,
)
def test_notebook_runs(path, kernel_env):
  nb = nbformat.read(path, as_version=4)
  # Raises CellExecutionError (with the cell's traceback) on the first failing cell.
  NotebookClient(
    nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NB_DIR)}}
  ).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors
