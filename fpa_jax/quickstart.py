"""The README's first command: a CPU-sized, fully offline tour of fpa_jax in a few minutes.

    bash run.sh quickstart              # = python -m fpa_jax.quickstart [--steps N] [--workdir DIR]

1. The operator: live keys of a bracket walk under the first-passage penalty form a stack.
2. Training: a small FPA language model and a FoX one of the same size, on the embedded corpus
   (the Python standard library's own source, built offline into ./data on first use), side by
   side; each run writes metrics.jsonl, TensorBoard events and orbax checkpoints under --workdir.
   Rerunning resumes from the checkpoints (try a larger --steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

DEMO = "x(a(bc)d(e)f)y"


def live_keys_demo(text: str = DEMO) -> list[str]:
  """Shared walk on brackets: field = level = nesting depth. Returns one line per query."""
  import jax.numpy as jnp

  from fpa_jax.ops import first_passage_penalty

  depth = np.cumsum([1 if c == "(" else -1 if c == ")" else 0 for c in text]).astype(np.float32)
  # A ")" is written at the depth it closes into, so its own scope is already gone.
  pen = np.asarray(first_passage_penalty(jnp.asarray(depth), jnp.asarray(depth)))
  lines = []
  for i, c in enumerate(text):
    live = "".join(text[j] if pen[i, j] == 0 else "." for j in range(i + 1))
    lines.append(f"  query {i:2d} {c!r}: live keys {live}")
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=150)
  ap.add_argument("--workdir", default="runs/quickstart")
  ap.add_argument("--data-dir", default="data")
  ap.add_argument("--attention", default="fpa,fox", help="comma-separated attention types to train")
  a = ap.parse_args(argv)

  print("1) First-passage penalty on a bracket walk (field = level = depth): a key stays live")
  print("   until the depth dips below its own; closed scopes vanish, enclosing ones stay.")
  print("\n".join(live_keys_demo()))

  from fpa_jax.configs import get_config
  from fpa_jax.train import train

  print(f"\n2) Training byte-level LMs on Python stdlib source, {a.steps} steps each (CPU).")
  summary = {}
  for attention in a.attention.split(","):
    cfg = get_config("small", attention=attention, task="text", steps=a.steps, data_dir=a.data_dir,
                     small_data=True, eval_every=a.steps, lr_decay_steps=a.steps)
    wd = os.path.join(a.workdir, attention)
    out = train(cfg, workdir=wd)
    h = out["history"]
    if not h:
      print(f"   {attention}: already trained to step {out['step']} in {wd} (use a larger --steps)")
      continue
    last = h[-1]
    summary[attention] = {"step": last["step"], "first_loss": h[0]["loss"], "loss": last["loss"],
                          "eval_loss": last.get("eval_loss"),
                          "tokens_per_s": last["tokens_per_s"], "workdir": wd}
  if summary:
    print("\n   attention | step | train loss (first -> last) | val loss | val bits/byte | tokens/s")
    for k, s in summary.items():
      ev = s["eval_loss"]
      bpb = "—" if ev is None else f"{ev / math.log(2):.3f}"
      evs = "—" if ev is None else f"{ev:.3f}"
      print(f"   {k:9s} | {s['step']:4d} | {s['first_loss']:12.3f} -> {s['loss']:6.3f} | {evs:>8s} | {bpb:>13s} | "
            f"{s['tokens_per_s']:8.0f}")
    os.makedirs(a.workdir, exist_ok=True)
    with open(os.path.join(a.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    print(f"\n   wrote {a.workdir}/summary.json; per-run metrics.jsonl, TensorBoard events and checkpoints "
          f"under {a.workdir}/<attention>/")
  return 0


if __name__ == "__main__":
  sys.exit(main())
