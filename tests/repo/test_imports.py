"""The package's import graph: no circle anywhere in fpa_jax (an import graph of every module, built
from the sources with `ast`), and fpa_jax.data layered, each module importing only from the layers
below it, so the low layers stay light (no tensorflow_datasets, no grain)."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[2] / "fpa_jax"
DATA = PACKAGE_DIR / "data"
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
  ("sources", "niah"),
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


# The whole package: a circle is a set of modules that import one another, directly or around a loop.


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(path.relative_to(root.parent).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PACKAGE_DIR) -> dict[str, dict[str, list[tuple[int, bool]]]]:
  """{module: {module it imports: [(line, at top level?), ...]}} over the package at `root`.

  `from pkg import x` is an edge to the submodule pkg.x where there is one, else to pkg itself (a
  name its __init__ defines or loads); `import a.b.c` to the longest module of the package it names.
  The parent packages Python initialises on the way are not edges: a package's __init__ that imports
  its own submodules is not a circle. Function-level imports are edges too (they only defer the
  circle to the first call)."""
  modules = {_module_name(p, root): p for p in root.rglob("*.py")}

  def owner(name):  # the longest prefix of `name` that is a module of the package
    while name not in modules and "." in name:
      name = name.rsplit(".", 1)[0]
    return name if name in modules else None

  graph = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: `from . import x` inside a/b.py is `from a import x`
          base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
      else:
        continue
      for target in filter(None, map(owner, targets)):
        if target != name:
          graph.setdefault(name, {}).setdefault(target, []).append((node.lineno, id(node) in top))
  return graph


def circles(graph, *, top_level_only: bool) -> list[tuple[str, ...]]:
  """The strongly connected components of more than one module (each sorted), Tarjan's algorithm."""
  edges = {a: [b for b, at in bs.items() if not top_level_only or any(t for _, t in at)] for a, bs in graph.items()}
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(tuple(sorted(component)))

  for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
    if v not in index:
      visit(v)
  return sorted(found)


def _describe(graph, circle) -> str:
  """Each import inside the circle, with its file line and whether it sits in a function."""
  return "; ".join(
    f"{a} -> {b} (line {line}{'' if top else ', in a function'})"
    for a in circle
    for b, at in sorted(graph.get(a, {}).items())
    if b in circle
    for line, top in sorted(set(at))[:1]
  )


def test_no_import_circle_at_top_level():
  graph = import_graph()
  found = circles(graph, top_level_only=True)
  assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)


def test_no_import_circle_through_function_level_imports():
  """A function-level import that closes a circle only hides it until the function runs."""
  graph = import_graph()
  found = circles(graph, top_level_only=False)
  assert not found, "import circles: " + " | ".join(_describe(graph, c) for c in found)


def test_circle_check_finds_top_level_and_function_level_circles(tmp_path):
  """The check itself, on a made-up package: a -> b at the top, b -> a in a function, c -> a alone."""
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("from pkg import a\n")  # a package importing its own module: no circle
  (pkg / "a.py").write_text("from pkg.sub import b\n")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n  from .. import a\n")
  (pkg / "c.py").write_text("import pkg.a\n")
  graph = import_graph(pkg)
  assert circles(graph, top_level_only=True) == []
  assert circles(graph, top_level_only=False) == [("pkg.a", "pkg.sub.b")]
  assert "pkg.sub.b -> pkg.a (line 4, in a function)" in _describe(graph, ("pkg.a", "pkg.sub.b"))
  (pkg / "sub" / "b.py").write_text("from pkg.a import x\n")  # `x` a name in a: the edge is to a
  assert circles(import_graph(pkg), top_level_only=True) == [("pkg.a", "pkg.sub.b")]
