"""Real text for language modelling: corpus listing, the deterministic file split, manifests.

Sources (the `source` string of `fpa_text`):
  * `"stdlib"` (default, offline): the running interpreter's standard-library `.py` sources -- a
    real corpus nobody here wrote, with deep nesting. Sorted file list, split by file.
  * a local directory path (`--text-dir PATH`): every UTF-8 file under it, split by file.
  * `"tfds:NAME"` (e.g. `tfds:pg19`, `tfds:lm1b`): a TFDS catalog dataset, not listed here but
    read through `sources.catalog_source`.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

import numpy as np

SPLITS = ("train", "validation", "test")
SMALL_MAX_FILES, SMALL_MAX_BYTES = 48, 16_000


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def list_files(root: str, *, python_only: bool = False) -> list[str]:
  """Sorted relative paths of the regular, non-hidden files under `root` (site-packages skipped)."""
  if not os.path.isdir(root):
    raise ValueError(f"text directory {root!r} does not exist or is not a directory")
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Installed packages are not the interpreter's own source; caches are not text.
    dirnames[:] = [
      d for d in dirnames if not d.startswith(".") and d not in ("site-packages", "dist-packages", "__pycache__")
    ]
    for f in filenames:
      if f.startswith(".") or (python_only and not f.endswith(".py")):
        continue
      p = os.path.join(dirpath, f)
      if os.path.isfile(p) and not os.path.islink(p):
        out.append(os.path.relpath(p, root))
  return sorted(out)


def read_utf8(path: str) -> str | None:
  """File text, or None when it is not valid UTF-8 (stdlib has a few deliberately broken files)."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def split_files(files: list[str], seed: int = 0, frac: float = 0.05) -> dict[str, list[str]]:
  """Deterministic split by file: a seeded permutation of the sorted list; `frac` each (>= 1 file)
  to validation and test, the rest to train. Each split's list is returned sorted."""
  files = sorted(files)
  if len(files) < 3:
    raise ValueError(f"need at least 3 files to split train/validation/test, got {len(files)}")
  perm = np.random.default_rng(seed).permutation(len(files))
  k = max(1, int(round(frac * len(files))))
  picked = [files[i] for i in perm]
  return {"validation": sorted(picked[:k]), "test": sorted(picked[k : 2 * k]), "train": sorted(picked[2 * k :])}


def corpus_files(source: str, small: bool) -> tuple[str, list[str]]:
  """(root, sorted relative paths) of a local source; `small` keeps a few small files."""
  if source == "stdlib":
    root, files = stdlib_root(), list_files(stdlib_root(), python_only=True)
  else:
    root = os.path.abspath(os.path.expanduser(source))
    files = list_files(root)
  if small:
    files = [f for f in files if os.path.getsize(os.path.join(root, f)) <= SMALL_MAX_BYTES]
    files = files[:SMALL_MAX_FILES]
  if not files:
    raise ValueError(f"no files found under text source {root!r}")
  return root, files


def manifest(root: str, files: list[str], splits: dict[str, list[str]]) -> dict:
  """JSON-able record of the corpus: root, and per file its split, size and sha256."""
  where = {f: s for s, fs in splits.items() for f in fs}
  entries = []
  for f in files:
    with open(os.path.join(root, f), "rb") as fh:
      data = fh.read()
    entries.append({"path": f, "split": where[f], "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
  return {"root": root, "n_files": len(files), "files": entries}
