"""Evaluate a trained model: loss by position and passkey retrieval, under any KV-cache policy.

The command line of `fpa_jax.eval` (`python -m fpa_jax.eval`; the package's docstring).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fpa_jax import cli as flags
from fpa_jax.data.passkey import EVAL_DEPTHS, EVAL_MULTIPLES
from fpa_jax.eval.passkey import passkey_eval
from fpa_jax.eval.stats import check_policy
from fpa_jax.eval.tables import markdown, write_results
from fpa_jax.eval.text_loss import loss_by_position
from fpa_jax.inference.policies import add_policy_args, parse_budget, policy_from_args


TASKS = ("loss_by_position", "passkey")


def _policy_args(items: list[str]) -> dict[str, Any]:
  """['recent=16', 'bound=params'] -> {'recent': 16, 'bound': 'params'} (int, then float, else str)."""
  out = {}
  for item in items:
    key, sep, raw = item.partition("=")
    if not sep or not key.isidentifier():
      raise ValueError(f"--policy-arg takes KEY=VALUE (a make_policy keyword), got {item!r}")
    if key in ("budget", "compression_ratio", "tolerance", "threshold"):
      raise ValueError(f"give {key} as --{key.replace('_', '-')}, not as --policy-arg")
    try:
      out[key] = parse_budget(raw)
    except ValueError:
      out[key] = raw
  return out


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(
    prog="python -m fpa_jax.eval",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  ap.add_argument("--workdir", required=True, help="a training workdir (python -m fpa_jax.train --workdir ...)")
  ap.add_argument("--task", required=True, choices=TASKS)
  ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  add_policy_args(ap, of="each row / cell length")
  ap.add_argument(
    "--policy-arg",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="any other keyword of fpa_jax.inference.make_policy (e.g. obs_window=16); repeatable",
  )
  ap.add_argument("--batch-size", type=int, help="rows per pass (default: 8 / up to --eval-tokens tokens)")
  ap.add_argument("--out", help="results JSON (a .md table beside it); default WORKDIR/eval/<task>_<policy>.json")
  ap.add_argument("--no-progress", action="store_true")
  g = ap.add_argument_group("loss_by_position")
  g.add_argument("--multiple", type=int, default=4, help="rows of this many times the training length")
  g.add_argument("--length", type=int, help="row length in tokens (overrides --multiple)")
  g.add_argument("--rows", type=int, default=32, help="held-out windows (spread over every validation document)")
  g.add_argument("--bucket", type=int, help="positions per bucket (default: length / 16)")
  g.add_argument("--rows-npy", help="token rows int [N, T + 1] from a .npy file instead of the text pipeline")
  g.add_argument("--data-dir", help="fpa_text / tokenizer location (default: the run's data_dir)")
  g.add_argument("--text-source", default="stdlib", help="the text pipeline's source (stdlib, a directory, tfds:NAME)")
  g = ap.add_argument_group("passkey")
  g.add_argument("--train-len", type=int, help="the length prompts are multiples of (default: the run's seq_len)")
  g.add_argument("--multiples", type=int, nargs="+", default=list(EVAL_MULTIPLES))
  g.add_argument("--depths", type=int, nargs="+", default=list(EVAL_DEPTHS), help="needle depths in percent")
  g.add_argument("--n", type=int, default=20, help="prompts per (length, depth) cell")
  g.add_argument("--seed", type=int, default=0, help="0: the fpa_passkey eval splits' prompts")
  g.add_argument(
    "--prefill",
    choices=("parallel", "decode"),
    help="generate the answer with this prefill (default: teacher-forced exact match, one pass per prompt)",
  )
  g.add_argument("--eval-tokens", type=int, default=16384, help="tokens per pass when --batch-size is not given")
  return flags.parse(ap, argv)


def _text_rows(cfg, a, seq_len: int, batch: int):
  """The trainer's held-out set at `seq_len`: `--rows` windows spread over every validation
  document (`fpa_jax.data.make_heldout`, seed 0), not the first rows of the stream (one or two
  files). -> (pipeline, coverage) with coverage as `fpa_jax.data.windows.coverage`."""
  from fpa_jax.data import make_heldout

  h = make_heldout(
    "validation",
    data_dir=a.data_dir or cfg.data_dir,
    seq_len=seq_len,
    batch_size=batch,
    n_windows=a.rows,
    tokenizer=cfg.tokenizer,
    small=cfg.small_data,
    text_source=a.text_source,
    process_index=0,
    process_count=1,
  )
  return h, h.info["coverage"]


def default_out(workdir, task: str, rec: dict[str, Any], prefill: str | None = None) -> Path:
  """WORKDIR/eval/<task>_<policy>[_b<budget>][_cr<ratio>][_e<tol>][_t<tau>][_<key><value>...][_<prefill>].json"""
  tag = rec["policy"]
  short = {"budget": "b", "compression_ratio": "cr", "tolerance": "e", "threshold": "t"}
  for key, v in rec.items():
    if key != "policy" and v is not None and not key.startswith(("cache_", "kept_", "lost_", "overflow", "batches")):
      tag += f"_{short.get(key, key)}{v:g}" if isinstance(v, (int, float)) else f"_{key}{v}"
  return Path(workdir) / "eval" / f"{task}_{tag}{'_' + prefill if prefill else ''}.json"


def run(a: argparse.Namespace, argv=None) -> tuple[dict, Path]:
  """Evaluate as the parsed CLI arguments say; -> (results, results path). Raises ValueError /
  FileNotFoundError on bad arguments, before the model runs."""
  from fpa_jax.checkpoint import Checkpointer
  from fpa_jax.data.tokenizers import load_tokenizer
  from fpa_jax.inference import load_model

  pol = dict(policy=policy_from_args(a, **_policy_args(a.policy_arg)))
  for flag in ("batch_size", "rows", "bucket", "length", "multiple", "train_len", "n", "eval_tokens"):
    v = getattr(a, flag)
    if v is not None and v < 1:
      raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
  if a.task == "loss_by_position" and a.prefill is not None:
    raise ValueError("--prefill applies to --task passkey only")
  if a.task == "passkey" and any(v is not None for v in (a.rows_npy, a.length, a.bucket)):
    raise ValueError("--rows-npy, --length and --bucket apply to --task loss_by_position only")
  t0 = time.perf_counter()
  model, cfg = load_model(a.workdir, step=a.step)
  ck = Checkpointer(os.path.join(a.workdir, "checkpoints"), async_save=False)
  try:
    step = a.step if a.step is not None else ck.latest_step()
  finally:
    ck.close()
  show = not a.no_progress
  if a.task == "loss_by_position":
    if a.rows_npy:
      rows = np.load(a.rows_npy)
      if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"{a.rows_npy}: token rows must be int [N, T + 1], got shape {rows.shape}")
      seq_len = rows.shape[1] - 1
    else:
      seq_len = a.length or a.multiple * cfg.seq_len
    check_policy(seq_len=seq_len, **pol)  # before the pipeline is built
    batch = a.batch_size or 8
    coverage = None
    if not a.rows_npy:
      rows, coverage = _text_rows(cfg, a, seq_len, batch)
    res = loss_by_position(
      model,
      rows,
      bucket=a.bucket or max(1, seq_len // 16),
      batch_size=batch,
      max_rows=a.rows,
      train_len=cfg.seq_len,
      show_progress=show,
      **pol,
    )
    res["data"] = a.rows_npy or (
      f"fpa_text validation ({a.text_source}{', small' if cfg.small_data else ''}): {a.rows} held-out windows "
      "spread over every document"
    )
    if coverage is not None:
      res["coverage"] = coverage
  else:
    tok = load_tokenizer(cfg.tokenizer, a.data_dir or cfg.data_dir, small=cfg.small_data)
    res = passkey_eval(
      model,
      a.train_len or cfg.seq_len,
      multiples=a.multiples,
      depths=a.depths,
      n=a.n,
      seed=a.seed,
      prefill=a.prefill,
      eval_tokens=a.eval_tokens,
      batch_size=a.batch_size,
      tokenizer=tok,
      show_progress=show,
      **pol,
    )
  res["meta"] = {
    "command": " ".join(["python", "-m", "fpa_jax.eval", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
    "workdir": str(a.workdir),
    "step": step,
    "attention": cfg.attention,
    "train_seq_len": cfg.seq_len,
    "backend": jax.default_backend(),
    "wall_s": round(time.perf_counter() - t0, 1),
    "finished": datetime.datetime.now().isoformat(timespec="seconds"),
  }
  out = Path(a.out) if a.out else default_out(a.workdir, a.task, res["cache"], a.prefill)
  write_results(res, out)
  return res, out


def main(argv=None) -> int:
  a = parse_args(argv)
  try:
    res, out = run(a, argv)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(markdown(res))
  print(f"wrote {out} and {out.with_suffix('.md')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
