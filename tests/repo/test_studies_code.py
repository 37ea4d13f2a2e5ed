"""What the studies and notebooks may use: the package's public names only, and of another study only
its public names (a private name is free to change under them; `experiments._common` is the studies'
shared module), and their command lines' flags spelled with dashes."""

from __future__ import annotations

import ast
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sources() -> list[tuple[str, str]]:
  """(name, Python source) of every script in experiments/ and every notebook's code cells (their
  shell and magic lines left out)."""
  out = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "experiments").glob("*.py"))]
  for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
      if cell["cell_type"] == "code":
        src = "".join(cell["source"])
        src = "\n".join("" if ln.lstrip().startswith(("!", "%")) else ln for ln in src.splitlines())
        out.append((f"{nb.relative_to(ROOT)} cell {i}", src))
  return out


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


SHARED = {"experiments._common"}  # private by its name, public to every study


def _ours(module: str) -> bool:
  return module.split(".")[0] in ("fpa_jax", "experiments")


def _private_module(module: str) -> bool:
  parts = module.split(".")
  return any(_private(p) and ".".join(parts[: i + 1]) not in SHARED for i, p in enumerate(parts))


def private_uses(src: str) -> list[str]:
  """The private names of fpa_jax or of a study that `src` imports or reads off a module of them that
  it imported (`from fpa_jax.train import _x`, `T._x` after `from fpa_jax import train as T`,
  `from experiments.bench_attention import _x`)."""
  found, modules = [], set()
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
      found += [f"{node.module} (module)"] if _private_module(node.module) else []
      for a in node.names:
        if _private(a.name) and f"{node.module}.{a.name}" not in SHARED:
          found.append(f"{node.module}.{a.name}")
        modules.add(a.asname or a.name)  # a submodule, or a name read off below
    elif isinstance(node, ast.Import):
      for a in node.names:
        if _ours(a.name):
          found += [f"{a.name} (module)"] if _private_module(a.name) else []
          modules.add(a.asname or a.name.split(".")[0])
  for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
      if node.value.id in modules:
        found.append(f"{node.value.id}.{node.attr}")
  return found


def test_studies_and_notebooks_use_only_public_names():
  bad = {name: uses for name, src in _sources() if (uses := private_uses(src))}
  assert not bad, bad


def test_private_use_is_found():
  assert private_uses("from fpa_jax.train import _init_fn, make_optimizer") == ["fpa_jax.train._init_fn"]
  assert private_uses("from fpa_jax import train as T\nT._init_fn(1)") == ["T._init_fn"]
  assert private_uses("import fpa_jax.ops._x as m") == ["fpa_jax.ops._x (module)"]
  assert private_uses("from experiments import _common as U\nfrom fpa_jax.ops import bias as _bias\nU.y") == []
  assert private_uses("from experiments._common import ROOT") == []
  assert private_uses("from experiments import _common as U\nU._y") == ["U._y"]
  assert private_uses("def f():\n  from experiments.bench_attention import _m") == ["experiments.bench_attention._m"]
  assert private_uses("from experiments import passkey as P\nP._passkey(1)") == ["P._passkey"]


def test_study_flags_are_dashed():
  flags = {
    (name, f) for name, src in _sources() for f in re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", src) if "_" in f
  }
  assert not flags, sorted(flags)
