"""XLA compile time on CPU under the test suite's compile flags against XLA's defaults.

    python -m experiments.bench_compile                  # 3 repeats of each flag set
    python -m experiments.bench_compile --repeats 1 --seq-len 24 --out /tmp/bc   # smoke

The test suite is mostly compiling (`docs/testing.md`, "Time"), so `tests/conftest.py` compiles
with flags that trade the machine code's speed for the compiler's. This measures what each flag set
costs and saves on programs the suite compiles: a tiny FPA model's jitted `value_and_grad` (the
trainer tests' kind of program) and its jitted forward. Each (flag set, repeat) runs in a fresh
interpreter (XLA reads `XLA_FLAGS` once, when the backend starts; no compilation cache), the flag
sets interleaved per repeat; per flag set the best compile time, the best run time of the compiled
program, and the largest difference of its loss and gradients from the default flags' (the same
HLO, other machine code: float32 rounding, nothing more).
Writes results/bench_compile.{json,md} (with the command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from experiments._common import ROOT, md_table, run_meta, study_parser, write_prefixed

MODULE = "experiments.bench_compile"
# name -> XLA_FLAGS; "default" first: the others are read against it
FLAG_SETS = {
  "default": "",
  "level 0": "--xla_backend_optimization_level=0",
  "no fusion emitters": "--xla_cpu_use_fusion_emitters=false",
  "level 0, no fusion emitters (tests)": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
}

# One measurement in a fresh interpreter: prints one JSON line.
_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from fpa_jax.configs import ModelConfig
from fpa_jax.models import DecoderLM

seq_len = int(sys.argv[1])
cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention="fpa")
model = DecoderLM(cfg, rngs=nnx.Rngs(0))
graph, params, rest = nnx.split(model, nnx.Param, ...)
tokens = jax.random.randint(jax.random.key(1), (2, seq_len), 0, 32)

def loss(p):
  return jnp.mean(nnx.merge(graph, p, rest)(tokens) ** 2)

out = {}
for name, fn in (("grad", jax.value_and_grad(loss)), ("forward", loss)):
  lowered = jax.jit(fn).lower(params)
  t = time.perf_counter(); compiled = lowered.compile(); out[f"{name}_compile_s"] = time.perf_counter() - t
  jax.block_until_ready(compiled(params))
  t = time.perf_counter(); res = jax.block_until_ready(compiled(params)); out[f"{name}_run_s"] = time.perf_counter() - t
  if name == "grad":
    val, g = res
    out["loss"] = float(val)
    out["grads"] = [np.asarray(x, np.float64).ravel().tolist() for x in jax.tree.leaves(g)]
print(json.dumps(out))
"""


def measure(flags: str, seq_len: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every compile is a compile
  res = subprocess.run([sys.executable, "-c", _CHILD, str(seq_len)], env=env, capture_output=True, text=True)
  if res.returncode:
    raise RuntimeError(f"XLA_FLAGS={flags!r}: the measurement failed:\n{res.stderr[-2000:]}")
  return json.loads(res.stdout.strip().splitlines()[-1])


def largest_difference(a: dict, b: dict) -> float:
  """The largest |a - b| of the loss (relative to it) and of any gradient entry, relative to the largest
  gradient entry: one scale for all leaves, since some (the gate's absolute bias, which shifts field
  and level alike) are sums that cancel to rounding noise, ~1e-9 against O(1e-2) elsewhere."""
  scale = max((abs(x) for g in b["grads"] for x in g), default=0.0) or 1.0
  worst = abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30)
  for ga, gb in zip(a["grads"], b["grads"], strict=True):
    worst = max(worst, max((abs(x - y) for x, y in zip(ga, gb, strict=True)), default=0.0) / scale)
  return worst


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
  base = runs["default"][0]
  out = {}
  for name, rs in runs.items():
    best = {k: min(r[k] for r in rs) for k in ("grad_compile_s", "forward_compile_s", "grad_run_s", "forward_run_s")}
    out[name] = {**best, "max_rel_difference": max(largest_difference(r, base) for r in rs)}
  d = out["default"]
  for row in out.values():
    row["grad_compile_vs_default"] = row["grad_compile_s"] / d["grad_compile_s"]
    row["forward_compile_vs_default"] = row["forward_compile_s"] / d["forward_compile_s"]
    row["grad_run_vs_default"] = row["grad_run_s"] / d["grad_run_s"]
  return out


def markdown(res: dict) -> str:
  rows = [
    [
      name,
      f"`{FLAG_SETS[name] or '(none)'}`",
      f"{r['grad_compile_s']:.2f}",
      f"{r['grad_compile_vs_default']:.3f}",
      f"{r['forward_compile_s']:.2f}",
      f"{r['forward_compile_vs_default']:.3f}",
      f"{r['grad_run_s'] * 1e3:.1f}",
      f"{r['grad_run_vs_default']:.2f}",
      f"{r['max_rel_difference']:.1e}",
    ]
    for name, r in res["flag_sets"].items()
  ]
  head = [
    "flags",
    "XLA_FLAGS",
    "grad compile s",
    "/ default",
    "forward compile s",
    "/ default",
    "grad run ms",
    "/ default",
    "max rel. difference",
  ]
  tests = res["flag_sets"]["level 0, no fusion emitters (tests)"]
  return (
    f"`{res['meta']['command']}`: a 2-layer FPA model (d_model 32, 4 heads, 2 kv heads), batch 2, "
    f"{res['seq_len']} tokens; best of {res['repeats']} fresh interpreters per flag set, interleaved, "
    f"{res['meta']['machine']['backend']}, {res['meta']['machine']['cpu_count']} cores, load (1, 5, 15 min) "
    f"{res['meta']['load_avg_1_5_15min']}.\n\n"
    + md_table(head, rows)
    + f"\n\nThe suite's flags compile the model's gradient in **{tests['grad_compile_vs_default']:.3f}x** and its "
    f"forward in **{tests['forward_compile_vs_default']:.3f}x** the default flags' time; the compiled gradient "
    f"runs in {tests['grad_run_vs_default']:.2f}x the time, and its loss and gradients differ from the "
    f"default's by at most {tests['max_rel_difference']:.1e} of their scale (float32 rounding).\n"
  )


def main(argv=None) -> dict:
  ap = study_parser(MODULE, __doc__)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--seq-len", type=int, default=200, help="tokens per row (several 64-token tiles)")
  ap.add_argument("--out", default=str(ROOT / "results" / "bench_compile"))
  a = ap.parse_args(argv)
  if a.repeats < 1 or a.seq_len < 2:
    raise SystemExit(f"--repeats must be >= 1 and --seq-len >= 2, got {a.repeats} and {a.seq_len}")
  t0 = time.perf_counter()
  runs: dict[str, list[dict]] = {name: [] for name in FLAG_SETS}
  for i in range(a.repeats):
    for name, flags in FLAG_SETS.items():
      runs[name].append(measure(flags, a.seq_len))
      print(f"[bench_compile] repeat {i + 1}/{a.repeats} {name}: grad compile {runs[name][-1]['grad_compile_s']:.2f} s")
  res = {
    "seq_len": a.seq_len,
    "repeats": a.repeats,
    "flag_sets": summarise(runs),
    "meta": run_meta(MODULE, argv, wall_s=time.perf_counter() - t0),
  }
  write_prefixed(a.out, res, markdown(res))
  return res


if __name__ == "__main__":
  main()
