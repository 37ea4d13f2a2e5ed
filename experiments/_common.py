"""Shared helpers for the studies in `experiments/`: run metadata, results files, training, eval.

meta = run_meta(argv, configs={...}, seeds=[0, 1, 2], wall_s=...)   # commit, machine, command, ...
write_json("results/x.json", {...}); md_table(["a", "b"], [[1, 2]])
out = train_lm(cfg, workdir, data)   # resumable library trainer + cumulative train wall time
fwd = forward_fn(out["graphdef"], out["state"])   # jitted tokens [B, T] -> logits [B, T, V]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# the evictability objective as the LM studies train it from scratch (defined with the recipes)
from experiments.recipes import EVICT_FROM_SCRATCH  # noqa: F401

# The progress bar, the markdown table and the parallel model's token NLL are the evaluation's
# (`fpa_jax.eval`): the studies call them by these names.
from fpa_jax.eval import md_table, progress, token_nll_fn  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# Metadata and results files
# ------------------------------------------------------------------------------------------------


def git_commit() -> str:
  """HEAD commit, with '+dirty' when the working tree has uncommitted changes; 'unknown' outside git."""
  try:
    sha = subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return sha + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def machine() -> dict[str, Any]:
  import jax

  return {
    "host": platform.node(),
    "platform": platform.platform(),
    "processor": platform.machine(),
    "cpu_count": os.cpu_count(),
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "device_kind": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "python": platform.python_version(),
  }


def params_digest(model) -> str:
  """sha256 (hex, 16 chars) of a model's parameters, path by path: which checkpoint a results file
  scored (a retrained run that is not bit-identical gets another digest). The library's definition."""
  from fpa_jax.eval.retrieval import params_digest as digest

  return digest(model)


def command(module: str, argv: list[str] | None) -> str:
  """The command line that reproduces this run, e.g. `python -m experiments.passkey --steps 10`."""
  args = sys.argv[1:] if argv is None else argv
  return " ".join(["python", "-m", module, *map(shlex.quote, args)])


def run_meta(module: str, argv: list[str] | None, *, wall_s: float, **extra: Any) -> dict[str, Any]:
  return {
    "command": command(module, argv),
    "commit": git_commit(),
    "machine": machine(),
    "load_avg_1_5_15min": [round(x, 1) for x in os.getloadavg()],  # shared machines: wall times depend on it
    "wall_s": round(wall_s, 1),
    "finished": datetime.datetime.now().isoformat(timespec="seconds"),
    **extra,
  }


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Atomic write (tmp + rename): a killed run never leaves a half-written results file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, default=_json_default) + "\n")
  os.replace(tmp, path)


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON serialisable: {type(x)}")


def write_study(out_dir: str | os.PathLike, name: str, res: dict, markdown, plot=None) -> None:
  """A study's results files: out_dir/name.json (res), name.md (markdown(res)), name.png (plot(res, path))."""
  out_dir = Path(out_dir)
  write_json(out_dir / f"{name}.json", res)
  (out_dir / f"{name}.md").write_text(markdown(res))
  if plot is not None:
    plot(res, out_dir / f"{name}.png")


def write_prefixed(prefix: str | os.PathLike, res: dict, md: str) -> None:
  """A study's results at a path prefix (`--out results/x`): x.json (res) and x.md (md), md printed too."""
  write_json(f"{prefix}.json", res)
  Path(f"{prefix}.md").write_text(md if md.endswith("\n") else md + "\n")
  print(md)


def study_parser(module: str, doc: str):
  """The argparse parser of `python -m module`: its docstring's first paragraph as the description."""
  import argparse

  return argparse.ArgumentParser(
    prog=f"python -m {module}", description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
  path = Path(path)
  return json.loads(path.read_text()) if path.exists() else default


def load_result(root: Path, name: str) -> Any:
  """results/NAME.json under `root` (a repository, or a test's folder), None before its study has run."""
  return read_json(Path(root) / "results" / f"{name}.json")


def result_methods(doc: dict) -> list[str]:
  """The methods of a study's results file: its entries that are dicts, less `meta` and `cells`."""
  return [k for k, v in doc.items() if isinstance(v, dict) and k not in ("meta", "cells")]


# The label of rows from models trained before the text-pipeline fix (text rows drawn one file at a time).
STALE_TEXT = " *(models trained before the text-pipeline fix: their fpa_text rows came one file at a time)*"


class ClaimRow(NamedTuple):
  """One claim of the README's claims table, as the study that measured it states it: the claim, its
  verdict (`seed_verdict`), a short line of evidence and the page that shows it; `detail` = (the claim
  as the paper words it, everything the study measured for it) for the long table in docs/results.md."""

  claim: str
  verdict: str
  evidence: str
  link: str
  detail: tuple[str, str] | None = None


def seed_verdict(ok: list[bool]) -> str:
  """A claim's verdict from one bool per seed (each paired with FoX of the same seed where the claim
  compares with FoX): it holds only when it holds on every seed; else it is met on k of n seeds, or
  not met; "not run" without a seed."""
  n, k = len(ok), sum(bool(x) for x in ok)
  if n == 0:
    return "not run"
  if k == n:
    return f"holds ({n} of {n} seed{'s' * (n != 1)})"
  return f"{k} of {n} seeds" if k else f"not met (0 of {n} seeds)"


def mean_std(xs: list[float]) -> str:
  """'m ± s' (sample std over seeds; '± 0' for one seed)."""
  xs = np.asarray(xs, float)
  s = xs.std(ddof=1) if len(xs) > 1 else 0.0
  return f"{xs.mean():.4f} ± {s:.4f}"


# ------------------------------------------------------------------------------------------------
# Configs: the model apart from the run, the method's recipe over both
# ------------------------------------------------------------------------------------------------


def study_model(args, **over) -> dict[str, Any]:
  """The studies' byte LM, architecture only, from their flags --layers, --d-model, --heads and (where
  the study has it) --block-size: d_ff = 0 (SwiGLU's width from d_model), the byte vocabulary (259);
  `over` replaces or adds fields (a vocabulary of the study's own, the attention kernel)."""
  model = {"n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads, "d_ff": 0, "vocab_size": 259}
  if hasattr(args, "block_size"):
    model["block_size"] = args.block_size
  return {**model, **over}


def study_run(args, *, task: str, steps: int, seed: int, **over) -> dict[str, Any]:
  """The run the byte-LM studies share: `task` rows of --train-len bytes (--data-dir, --small-data),
  --batch-size, --lr after --warmup steps, to `steps`; a log line every 10 steps, a checkpoint every
  --ckpt-every; `over` adds the study's own (its cosine horizon, its cooldown)."""
  run = {
    "task": task,
    "data_dir": args.data_dir,
    "small_data": args.small_data,
    "tokenizer": "bytes",
    "seq_len": args.train_len,
    "batch_size": args.batch_size,
    "steps": steps,
    "lr": args.lr,
    "warmup_steps": args.warmup,
    "seed": seed,
    "log_every": 10,
    "ckpt_every": args.ckpt_every,
  }
  return {**run, **over}


def study_config(model: dict, run: dict, recipe: dict):
  """A study's trainer config (the `small` preset's fields replaced): `model` (the architecture,
  `study_model`), `run` (data, schedule, seed, logging: `study_run`) and the method's `recipe` (gate,
  objective, skipping: `experiments.recipes`), the recipe last, so that a method may set any field."""
  from fpa_jax.configs import get_config

  return get_config("small", **{**model, **run, **recipe})


# ------------------------------------------------------------------------------------------------
# Training and evaluation
# ------------------------------------------------------------------------------------------------


def train_lm(cfg, workdir: str, data, *, progress_bar: bool | None = None) -> dict[str, Any]:
  """`fpa_jax.train.train` (resumes from `workdir`'s checkpoints), plus the cumulative training
  wall time over all sessions in `workdir/study_wall.json`. Returns the trainer's summary with
  `train_wall_s` (all sessions) and `model` (the trained `DecoderLM`)."""
  from flax import nnx

  from fpa_jax.train import train

  os.makedirs(workdir, exist_ok=True)
  wall_path = Path(workdir) / "study_wall.json"
  wall = read_json(wall_path, {"train_wall_s": 0.0, "sessions": []})
  # The config a run *started* with: library defaults (e.g. the gate init) may change between
  # sessions, and a resumed session only restores parameters, so record the first one.
  init_path = Path(workdir) / "study_init_config.json"
  if not init_path.exists() and not (Path(workdir) / "checkpoints").exists():
    write_json(init_path, cfg.to_dict())
  t0 = time.perf_counter()
  out = train(cfg, workdir=workdir, data=data, progress=progress_bar)
  dt = time.perf_counter() - t0
  if out["step"] > out["start_step"]:  # a session that trained (not a pure restore)
    wall["train_wall_s"] += dt
    wall["sessions"].append({"from": out["start_step"], "to": out["step"], "wall_s": round(dt, 1)})
    write_json(wall_path, wall)
  model, _ = nnx.merge(out["graphdef"], out["state"])
  return {
    **out,
    "model": model,
    "train_wall_s": round(wall["train_wall_s"], 1),
    "sessions": wall["sessions"],
    "init_config": init_config(workdir, out["config"]),
  }


def passkey_models(path, models) -> dict[str, Any]:
  """The passkey study's results file (`experiments.passkey`) with every one of `models` in it, or a
  SystemExit that says to train the missing ones first."""
  pk = read_json(path, {})
  missing = [m for m in models if m not in pk]
  if missing:
    raise SystemExit(f"{missing} not in {path}: train them first (python -m experiments.passkey)")
  return pk


def init_config(workdir: str, fallback=None) -> dict | None:
  """The config `workdir`'s run started with (`study_init_config.json`), else `fallback` (a Config or dict).

  A relative `workdir` (as results files record them) is taken from the repository root."""
  saved = read_json(ROOT / workdir / "study_init_config.json")
  if saved is not None:
    return saved
  return fallback.to_dict() if hasattr(fallback, "to_dict") else fallback


def forward_fn(model):
  """Jitted parallel forward: tokens int [B, T] (+ segment_ids) -> logits fp32 [B, T, V]."""
  import jax
  from flax import nnx

  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, tokens, segment_ids=None):
    return nnx.merge(graphdef, state)(tokens, segment_ids)

  return lambda tokens, segment_ids=None: fwd(state, tokens, segment_ids)
