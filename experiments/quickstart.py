"""The README's first command: what First Passage Attention is for, in a few minutes on a CPU.

    bash run.sh quickstart          # = python -m experiments.quickstart [--workdir runs/quickstart]

1. The operator: on a bracket walk (field = level = depth) the live keys form a stack.
2. Study 1, reduced: one attention head per method (fpa, stack, fox, softmax+RoPE) trained to put
   its attention on the live keys of nested scopes; mean attention mass on the target set at 1x and
   2x the training length (2 seeds; the full study is `python -m experiments.live_sets`).
3. The learned KV-cache rule: a small FPA language model trained on nested-scope sequences, then
   decoded token by token at 2x its training length with the cache under each policy: how many
   keys each keeps and how often it still answers the scope queries right.
Writes results/quickstart/{summary.json, live_sets.md, decode.md}; ends with the full study commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
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


class ScopesLM:
  """In-memory LM batches of `fpa_scopes` sequences (the generator, seeded per batch); the loss is on
  every next token, answers weighted x`answer_weight`. `get_state`/`set_state`: the batch counter."""

  def __init__(self, *, seq_len: int, batch_size: int, seed: int = 0, answer_weight: float = 4.0):
    from fpa_jax.data import scopes

    self.cfg = scopes.ScopesConfig(length=seq_len + 1, max_depth=6)
    self.vocab_size = scopes.vocab_size(self.cfg)
    self.batch_size, self.seed, self.w, self.n = batch_size, seed, answer_weight, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    from fpa_jax.data import scopes

    rng = np.random.default_rng([self.seed, self.n])
    self.n += 1
    toks = np.stack([scopes.generate(rng, self.cfg)["tokens"] for _ in range(self.batch_size)])
    mask = 1.0 + (self.w - 1.0) * np.stack([scopes.loss_mask(t) for t in toks])
    return {
      "inputs": toks[:, :-1],
      "targets": toks[:, 1:],
      "segment_ids": np.ones_like(toks[:, :-1]),
      "loss_mask": mask.astype(np.float32),
    }

  def get_state(self) -> dict:
    return {"n": self.n}

  def set_state(self, state: dict) -> None:
    self.n = int(state["n"])


def cached_decode_table(model, seq_len: int, n: int = 16, seed: int = 123) -> tuple[list[dict], str]:
  """Decode held-out scope sequences of `seq_len` tokens under each cache policy: answer accuracy on
  the queries, keys held and (where measurable) the attention mass lost to eviction."""
  from experiments._common import md_table
  from fpa_jax.data import scopes
  from fpa_jax.inference import cached_logits

  cfg = scopes.ScopesConfig(length=seq_len, max_depth=6)
  rng = np.random.default_rng(seed)
  toks = np.stack([scopes.generate(rng, cfg)["tokens"] for _ in range(n)])
  is_q = toks[:, :-1] == scopes.QUERY
  rows = []
  for name, kw in [
    ("full", dict(policy="full")),
    ("fpa ε=0.01", dict(policy="fpa", tolerance=1e-2)),
    ("fpa_threshold τ=8", dict(policy="fpa_threshold", threshold=8.0)),
    ("fpa_budget 25%", dict(policy="fpa_budget", budget=0.25)),
    ("window 25%", dict(policy="window", budget=0.25)),
    ("fpa_budget 12.5%", dict(policy="fpa_budget", budget=0.125)),
    ("window 12.5%", dict(policy="window", budget=0.125)),
  ]:
    logits, st = cached_logits(model, toks, **kw)
    pred = np.argmax(np.asarray(logits)[:, :-1], -1)
    acc = float((pred == toks[:, 1:])[is_q].mean())
    rows.append(
      {
        "policy": name,
        "query_accuracy": acc,
        "cache_fraction": st["cache_fraction"],
        "kept_fraction_mean": st["kept_fraction_mean"],
        "lost_mass_max": st["lost_mass_max"],
      }
    )
  md = md_table(
    ["policy", "query accuracy", "peak keys held / seq", "mean kept / seen", "max lost mass"],
    [
      [
        r["policy"],
        f"{r['query_accuracy']:.3f}",
        f"{r['cache_fraction']:.3f}",
        f"{r['kept_fraction_mean']:.3f}",
        f"{r['lost_mass_max']:.2g}",
      ]
      for r in rows
    ],
  )
  return rows, md


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workdir", default="runs/quickstart", help="checkpoints of the step-3 model (resumes)")
  ap.add_argument("--out", default=str(ROOT / "results" / "quickstart"))
  ap.add_argument("--seeds", type=int, default=2)
  ap.add_argument("--head-steps", type=int, default=400, help="step 2: training steps per head")
  ap.add_argument("--lm-steps", type=int, default=300, help="step 3: training steps of the FPA LM")
  ap.add_argument("--small", action="store_true", help="tiny settings (tests)")
  a = ap.parse_args(argv)
  if a.small:
    a.seeds, a.head_steps, a.lm_steps = 1, 20, 4
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()

  print("1) First-passage penalty on a bracket walk (field = level = depth): a key stays live")
  print("   until the depth dips below its own; closed scopes vanish, enclosing ones stay.")
  print("\n".join(live_keys_demo()))

  from experiments import live_sets

  print(
    f"\n2) One attention head per method, trained to attend to the live keys of nested scopes "
    f"({a.seeds} seeds x {a.head_steps} steps; CPU):"
  )
  small = dict(pool=128, n_eval=16) if a.small else dict(pool=512, n_eval=64)
  res = live_sets.run(
    "scopes", seeds=a.seeds, steps=a.head_steps, objectives=("mass",), out=None, figure=False, **small
  )
  md_heads = live_sets.markdown(
    res,
    title=f"Task `scopes`, single head, d_model 16, T={live_sets.TRAIN_LEN}, "
    f"{a.head_steps} steps, {a.seeds} seeds (`bash run.sh quickstart`).",
  )
  print(md_heads)
  (out / "live_sets.md").write_text(md_heads)

  print(
    f"3) The learned KV-cache rule: an FPA LM trained on nested-scope sequences ({a.lm_steps} steps), decoded\n"
    "   token by token at 2x its training length with each cache policy:"
  )
  from fpa_jax import configs as C
  from fpa_jax.train import train

  seq = 128
  data = ScopesLM(seq_len=seq, batch_size=16)
  cfg = C.get_config(
    "small",
    **C.SINGLE_HEAD_GATE,  # a synthetic nested task: the single-head gate (configs docstring)
    attention="fpa",
    task="synthetic",
    d_model=64,
    n_layers=2,
    n_heads=2,
    d_ff=0,
    vocab_size=data.vocab_size,
    seq_len=seq,
    batch_size=16,
    block_size=32,
    steps=a.lm_steps,
    warmup_steps=min(20, a.lm_steps),  # --small trains 4 steps
    lr=3e-3,
    log_every=50,
    ckpt_every=a.lm_steps,
  )
  run = train(cfg, workdir=os.path.join(a.workdir, "fpa_scopes_lm"), data=data)
  from flax import nnx

  model, _ = nnx.merge(run["graphdef"], run["state"])
  rows, md_cache = cached_decode_table(model, 2 * seq, n=4 if a.small else 16)
  print(md_cache)
  (out / "decode.md").write_text(md_cache)
  summary = {
    "live_sets": res,
    "decode": rows,
    "lm_loss": run["history"][-1]["loss"] if run["history"] else None,
    "wall_s": round(time.perf_counter() - t0, 1),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
  print(
    f"wrote {out}/ in {summary['wall_s']:.0f} s. The full studies:\n"
    "  python -m experiments.live_sets --task all      # study 1: live-key sets, 5 seeds (+ --ablations)\n"
    "  python -m experiments.passkey                   # study 2: passkey retrieval at 1x..8x\n"
    "  python -m experiments.kv_compression            # study 3: passkey at 8x with a compressed cache\n"
    "  python -m experiments.perplexity                # study 4: bits per byte, loss by position\n"
    "  python -m experiments.report                    # README results from results/"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
