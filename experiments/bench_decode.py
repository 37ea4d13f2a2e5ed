"""Decode speed and KV-cache bytes at 1x..8x a model's training length: full vs fpa_budget vs window.

    python -m experiments.bench_decode                     # `small` config (L=256), contexts 1x 2x 4x 8x
    python -m experiments.bench_decode --workdir runs/x    # a trained run's model and length
    python -m experiments.bench_decode --quick             # contexts 1x 2x, fewer tokens (smoke)

For each context P (a prompt of P tokens, prefilled by the parallel kernel under the policy) and
each policy, N greedy decode steps run as one jitted scan (the loop `generate` runs), compiled and
warmed up first, then timed (median of --repeats) and divided by N: prefill is excluded.
Cache bytes: every array of the per-layer caches (`jax.eval_shape`, no allocation). Speed does not
depend on the weights, so an untrained model is measured unless --workdir is given.
Writes results/bench_decode.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments._common import ROOT, md_table, run_meta, write_json
from fpa_jax import configs as C
from fpa_jax.inference import init_caches, load_model, make_policy, prefill_attend
from fpa_jax.inference.decode import _step
from fpa_jax.models import build_model

POLICIES = (("full", None), ("fpa_budget", 0.25), ("window", 0.25))


def cache_bytes(model, batch: int, policy) -> int:
  shapes = jax.eval_shape(lambda: init_caches(model, batch, policy, policy.capacity))
  return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def decode_timer(model, prompt, n_new: int, policy):
  """A function timing `n_new` decode steps (one jitted scan) after a parallel prefill of `prompt`."""
  graphdef, state = nnx.split(model)
  b, p = prompt.shape
  lengths = jnp.full((b,), p, jnp.int32)

  @jax.jit
  def prefill(state, prompt):
    m = nnx.merge(graphdef, state)
    attend = functools.partial(
      prefill_attend, policy=policy, scale=m.cfg.head_dim**-0.5, lengths=lengths, block_size=m.cfg.block_size or None
    )
    logits, caches = m(
      prompt,
      positions=jnp.broadcast_to(jnp.arange(p), (b, p)),
      caches=init_caches(m, b, policy, p + n_new),
      attend=attend,
    )
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), caches

  @jax.jit
  def decode(state, caches, tok):
    m = nnx.merge(graphdef, state)

    def body(carry, pos):
      caches, tok = carry
      logits, caches = _step(m, caches, tok, jnp.full((b,), pos, jnp.int32), policy)
      return (caches, jnp.argmax(logits, -1).astype(jnp.int32)), None

    (caches, tok), _ = jax.lax.scan(body, (caches, tok), jnp.arange(p, p + n_new))
    return tok

  tok, caches = prefill(state, jnp.asarray(prompt, jnp.int32))

  def run() -> float:
    t = time.perf_counter()
    jax.block_until_ready(decode(state, caches, tok))
    return time.perf_counter() - t

  return run


def time_decode(model, prompt, n_new: int, repeats: int, policy) -> float:
  """Median seconds per decode step (compile and one warm-up call excluded)."""
  run = decode_timer(model, prompt, n_new, policy)
  run(), run()
  return statistics.median(run() for _ in range(repeats)) / n_new


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", help="a training run to load (default: an untrained --config model)")
  ap.add_argument("--config", default="small", choices=sorted(C.CONFIGS))
  ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="multiples 1 2, 16 new tokens, 1 repeat")
  ap.add_argument("--out", default=str(ROOT / "results" / "bench_decode"))
  a = ap.parse_args(argv)
  if a.quick:
    a.multiples, a.new_tokens, a.repeats = [1, 2], 16, 1
  t_start = time.perf_counter()
  if a.workdir:
    model, cfg = load_model(a.workdir)
  else:
    cfg = C.get_config(a.config)
    model = build_model(cfg)
  length = cfg.seq_len
  rng = np.random.default_rng(0)
  rows, table = {}, []
  todo = [(m, p, b) for m in a.multiples for p, b in POLICIES]
  for mult, policy, budget in tqdm(todo, desc="bench_decode", disable=None):
    p = length * mult
    prompt = rng.integers(3, cfg.vocab_size, (a.batch, p))
    pol = make_policy(policy, p + a.new_tokens, budget=budget)
    per_token = time_decode(model, prompt, a.new_tokens, a.repeats, pol)
    r = {
      "context": p,
      "multiple": mult,
      "policy": policy,
      "budget": budget,
      "capacity": pol.capacity,
      "cache_bytes": cache_bytes(model, a.batch, pol),
      "decode_ms_per_token": per_token * 1e3,
      "tokens_per_s": a.batch / per_token,
    }
    rows[f"{mult}x/{policy}"] = r
  for mult in a.multiples:
    full = rows[f"{mult}x/full"]
    for policy, _ in POLICIES:
      r = rows[f"{mult}x/{policy}"]
      r["cache_bytes_over_full"] = r["cache_bytes"] / full["cache_bytes"]
      r["decode_time_over_full"] = r["decode_ms_per_token"] / full["decode_ms_per_token"]
      table.append(
        [
          f"{mult}x ({r['context']})",
          policy,
          r["capacity"],
          f"{r['cache_bytes'] / 2**20:.2f}",
          f"{r['cache_bytes_over_full']:.3f}",
          f"{r['decode_ms_per_token']:.2f}",
          f"{r['decode_time_over_full']:.3f}",
          f"{r['tokens_per_s']:.0f}",
        ]
      )
  top = max(a.multiples)
  targets = {
    f"fpa_budget_cache_bytes_over_full_{top}x": rows[f"{top}x/fpa_budget"]["cache_bytes_over_full"],
    f"fpa_budget_decode_time_over_full_{top}x": rows[f"{top}x/fpa_budget"]["decode_time_over_full"],
  }
  meta = run_meta(
    "experiments.bench_decode",
    argv,
    wall_s=time.perf_counter() - t_start,
    config={
      "name": cfg.name,
      "attention": cfg.attention,
      "d_model": cfg.d_model,
      "n_layers": cfg.n_layers,
      "n_heads": cfg.n_heads,
      "train_length": length,
    },
    batch=a.batch,
    new_tokens=a.new_tokens,
    workdir=a.workdir,
  )
  out = {"rows": rows, "targets": targets, "meta": meta}
  write_json(a.out + ".json", out)
  head = (
    f"`{meta['command']}`: {cfg.name} {cfg.attention} model (d_model {cfg.d_model}, {cfg.n_layers} layers, "
    f"{cfg.n_heads} heads, training length {length}), batch {a.batch}, {a.new_tokens} new tokens after a "
    f"prompt of the given context (parallel prefill, excluded), {meta['machine']['backend']}, "
    f"{meta['machine']['cpu_count']} cores.\n\n"
  )
  md = head + md_table(
    ["context", "policy", "capacity", "cache MiB", "cache / full", "decode ms/token", "time / full", "tokens/s"], table
  )
  tb, tt = targets.values()
  md += (
    f"\nAt {top}x: fpa_budget 25% holds **{tb:.3f}x** the cache bytes of full (target <= 0.3: "
    f"{'met' if tb <= 0.3 else 'not met'}) and decodes a token in **{tt:.3f}x** full's time (target < 1: "
    f"{'met' if tt < 1 else 'not met'}).\n"
  )
  with open(a.out + ".md", "w") as f:
    f.write(md)
  print(md)
  return out


if __name__ == "__main__":
  main()
  sys.exit(0)
