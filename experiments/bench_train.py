"""Training throughput (tokens/s) of the `small` config for FPA, FoX and softmax, side by side.

    python -m experiments.bench_train                 # 30 timed steps each, writes results/bench_train.json
    python -m experiments.bench_train --quick         # 5 timed steps each (smoke)
    python -m experiments.bench_train --steps 50 --set dtype=bfloat16 --mesh data=8

Each attention type gets the same model/batch/mesh; the jitted train step (forward, backward,
AdamW update) is compiled and warmed up first, then timed over --steps steps with a
block_until_ready per step. Reports median tokens/s and the FPA/FoX ratio (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax

from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.train import SyntheticPipeline, TrainStep, create_state


def bench_one(cfg: C.Config, mesh, steps: int, warmup: int) -> dict:
  graphdef, state, shardings, _ = create_state(cfg, mesh)
  step = TrainStep(cfg, graphdef, shardings, mesh, None)
  data = SyntheticPipeline(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
  batches = [S.shard_batch(next(data), mesh) for _ in range(4)]
  t0 = time.perf_counter()
  state, m = step(state, batches[0])
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  for i in range(warmup):
    state, m = step(state, batches[i % 4])
  jax.block_until_ready(m)
  times = []
  for i in range(steps):
    t = time.perf_counter()
    state, m = step(state, batches[i % 4])
    jax.block_until_ready((state, m))
    times.append(time.perf_counter() - t)
  tokens = cfg.batch_size * cfg.seq_len
  med = statistics.median(times)
  return {"tokens_per_s": tokens / med, "step_s_median": med, "step_s_min": min(times),
          "compile_s": compile_s, "final_loss": float(m["loss"]), "traces": step.traces}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="small", choices=sorted(C.CONFIGS))
  ap.add_argument("--attention", nargs="+", default=["fpa", "fox", "softmax"], choices=C.ATTENTIONS)
  ap.add_argument("--steps", type=int, default=30, help="timed steps per attention type")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="5 timed steps, 1 warmup")
  ap.add_argument("--mesh", default=None)
  ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
  ap.add_argument("--out", default="results/bench_train.json")
  args = ap.parse_args(argv)
  if args.quick:
    args.steps, args.warmup = 5, 1
  overrides = C.parse_overrides(C.CONFIGS[args.config], args.sets)
  mesh = S.make_mesh(args.mesh)
  results = {}
  for att in args.attention:
    cfg = C.get_config(args.config, **{**overrides, "attention": att, "task": "synthetic"})
    cfg.validate_mesh(dict(mesh.shape))
    results[att] = bench_one(cfg, mesh, args.steps, args.warmup)
    print(f"{att:8s} {results[att]['tokens_per_s']:12.0f} tokens/s  (step {results[att]['step_s_median'] * 1e3:.1f} ms, "
          f"compile {results[att]['compile_s']:.1f} s)", flush=True)
  out = {"config": args.config, "overrides": overrides, "mesh": dict(mesh.shape), "steps": args.steps,
         "backend": jax.default_backend(), "devices": jax.device_count(), "host": platform.node(),
         "jax": jax.__version__, "results": results}
  if "fpa" in results and "fox" in results:
    out["fpa_over_fox"] = results["fpa"]["tokens_per_s"] / results["fox"]["tokens_per_s"]
    print(f"FPA / FoX throughput: {out['fpa_over_fox']:.3f} (target >= 0.9)")
  if "softmax" in results and "fox" in results:
    out["fox_over_softmax"] = results["fox"]["tokens_per_s"] / results["softmax"]["tokens_per_s"]
  out["command"] = "python -m experiments.bench_train " + " ".join(argv if argv is not None else sys.argv[1:])
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  md = os.path.splitext(args.out)[0] + ".md"
  with open(md, "w") as f:
    f.write(markdown(out))
  print(f"wrote {args.out} and {md}")
  return out


def markdown(out: dict) -> str:
  """The results as a README table."""
  cfg = C.get_config(out["config"], **out["overrides"])
  lines = [f"`{out['command'].strip()}`: config `{out['config']}` (d_model {cfg.d_model}, {cfg.n_layers} layers, "
           f"{cfg.n_heads} heads, seq {cfg.seq_len}, batch {cfg.batch_size}, block {cfg.block_size or 'default'}), "
           f"{out['devices']} {out['backend']} device(s), jax {out['jax']}, median of {out['steps']} steps.", "",
           "| attention | tokens/s | step ms (median) | compile s |", "|---|---:|---:|---:|"]
  for att, r in out["results"].items():
    lines.append(f"| {att} | {r['tokens_per_s']:.0f} | {r['step_s_median'] * 1e3:.1f} | {r['compile_s']:.1f} |")
  if "fpa_over_fox" in out:
    ratio = out["fpa_over_fox"]
    lines += ["", f"FPA / FoX throughput: **{ratio:.3f}** (target ≥ 0.9: {'met' if ratio >= 0.9 else 'not met'})."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
