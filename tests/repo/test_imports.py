"""fpa_jax.data is layered: each module imports only from the layers below it, so there are no cycles
and the low layers stay light (no tensorflow_datasets, no grain)."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

DATA = pathlib.Path(__file__).resolve().parents[2] / "fpa_jax" / "data"
PACKAGE = "fpa_jax.data"
# Outside the package, data may read the config names (configs -> data, ../shared/DESIGN.md): one
# definition of the task list. Nothing else of fpa_jax (models, train) is allowed.
OUTSIDE_OK = ("fpa_jax.configs",)
# Bottom to top, as in fpa_jax/data/__init__.py; a new module must be given a layer here.
LAYERS = [
  ("tokenizers",),
  ("scopes", "dips", "passkey", "synthetic", "bindings"),
  ("text", "windows"),
  ("builders",),
  ("sources",),
  ("pipeline",),
  ("prepare",),
]
LAYER = {m: i for i, ms in enumerate(LAYERS) for m in ms}


def _imports(tree: ast.Module):
  """(imported module, line, at top level?) for every import; `from fpa_jax.data import x` imports
  `fpa_jax.data.x` (a submodule, or one of the package's lazily loaded names)."""
  top = set(map(id, tree.body))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module
      if node.level:  # relative: in fpa_jax/data, `from . import x` is `from fpa_jax.data import x`
        base = ".".join(PACKAGE.split(".")[: 3 - node.level] + ([node.module] if node.module else []))
      names = [f"{base}.{a.name}" for a in node.names] if base == PACKAGE else [base]
    else:
      continue
    for name in names:
      yield name, node.lineno, id(node) in top


def _module_imports(path):
  """The fpa_jax imports of `path`: [(fpa_jax.data module, or the full name outside it, line, top?)];
  "" stands for the package itself."""
  out = []
  for name, line, top in _imports(ast.parse(path.read_text())):
    if name == PACKAGE or name.startswith(PACKAGE + "."):
      out.append((name[len(PACKAGE) + 1 :].split(".")[0], line, top))
    elif name == "fpa_jax" or name.startswith("fpa_jax."):
      out.append((name, line, top))
  return out


def test_every_module_has_a_layer():
  modules = {p.stem for p in DATA.glob("*.py")} - {"__init__"}
  assert modules == set(LAYER), f"give each fpa_jax/data module a layer in LAYERS: {modules ^ set(LAYER)}"


@pytest.mark.parametrize("module", sorted(LAYER))
def test_module_imports_only_lower_layers(module):
  for name, line, top in _module_imports(DATA / f"{module}.py"):
    where = f"fpa_jax/data/{module}.py:{line}"
    assert top, f"{where}: function-level import of {name or PACKAGE} hides a dependency; import it at the top"
    if name in OUTSIDE_OK:
      continue
    assert not name.startswith("fpa_jax"), f"{where}: the data package must not import {name}"
    assert name in LAYER, f"{where}: import {name or PACKAGE!r} from its defining module (package names load lazily)"
    assert LAYER[name] < LAYER[module], (
      f"{where}: {module} (layer {LAYER[module]}) imports {name} (layer {LAYER[name]}): only lower layers"
    )


def test_package_init_imports_no_module_eagerly():
  """Its public names load on first use, so importing one low layer does not run the high ones."""
  init = DATA / "__init__.py"
  assert not _module_imports(init)
  data = importlib.import_module(PACKAGE)
  for name, module in data._EXPORTS.items():  # and each public name is where it says
    assert getattr(data, name) is getattr(importlib.import_module(f"{PACKAGE}.{module}"), name)


def test_layering_check_catches_a_cycle(tmp_path, monkeypatch):
  """The check itself: a tokenizers module importing a higher layer fails it."""
  (tmp_path / "tokenizers.py").write_text("import os\nfrom fpa_jax.data import text\n")
  monkeypatch.setattr(sys.modules[__name__], "DATA", tmp_path)
  with pytest.raises(AssertionError, match="only lower layers"):
    test_module_imports_only_lower_layers("tokenizers")
  (tmp_path / "tokenizers.py").write_text("def f():\n  from fpa_jax.data.builders import BUILDERS\n")
  with pytest.raises(AssertionError, match="function-level"):
    test_module_imports_only_lower_layers("tokenizers")


def test_tokenizers_import_without_tfds_or_grain():
  code = (
    "import fpa_jax.data.tokenizers, sys; "
    "assert 'tensorflow_datasets' not in sys.modules and 'grain' not in sys.modules"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=DATA.parents[1])


def test_low_layers_and_trainer_import_without_tfds_or_grain():
  """Everything below the TFDS builders, and the trainer module itself (the data package loads on use)."""
  low = [f"{PACKAGE}.{m}" for m, layer in LAYER.items() if layer < LAYER["builders"]]
  code = (
    f"import sys, fpa_jax.train, {', '.join(low)}; "
    "bad = {'tensorflow_datasets', 'grain'} & set(sys.modules); assert not bad, bad"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=DATA.parents[1])
