"""`head_split.json`: a split of a KV budget between (layer, kv head)s, saved with a model (written
by `head_budget.save_head_split`, read here so that the policy flags can read it without the
calibration's imports)."""

from __future__ import annotations

import json
import os

import numpy as np

SPLIT_FILE = "head_split.json"  # beside an `export_model` folder's params.npz and config.json


def split_path(path: str | os.PathLike) -> str:
  """The split file of `path`: `path` itself if it ends in .json (and is no folder), else path/head_split.json."""
  path = os.fspath(path)
  return os.path.join(path, SPLIT_FILE) if os.path.isdir(path) or not path.endswith(".json") else path


def load_head_split(path: str | os.PathLike) -> tuple[np.ndarray, float | int]:
  """(split [L, KVH] float64, budget) from `save_head_split`'s file (or the folder holding it); a
  model with other kv heads per layer: an object array of rows. FileNotFoundError naming the file;
  ValueError when it holds no split."""
  src = split_path(path)
  if not os.path.exists(src):
    raise FileNotFoundError(f"no {SPLIT_FILE} at {src}: write one with save_head_split(folder, split, budget)")
  with open(src) as f:
    rec = json.load(f)
  if not isinstance(rec, dict) or "split" not in rec or "budget" not in rec:
    raise ValueError(f"{src} holds no head split (keys 'split' and 'budget'): write it with save_head_split")
  rows = rec["split"]
  if len({len(r) for r in rows}) > 1:  # ragged: a model of your own
    return np.asarray([np.asarray(r, np.float64) for r in rows], dtype=object), rec["budget"]
  return np.asarray(rows, np.float64), rec["budget"]
