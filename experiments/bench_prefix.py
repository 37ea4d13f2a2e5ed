"""Chunked prefill against a cache vs re-prefilling the whole conversation at every turn.

    python -m experiments.bench_prefix                         # `small` config, 8 turns of 128 tokens
    python -m experiments.bench_prefix --turns 4 --turn-tokens 32 --config tiny   # smoke

A conversation of N turns of T tokens per row. At turn n a chat server either re-runs the whole
conversation so far (n T tokens) through the model's parallel prefill (`inference.decode.
prefill_parallel`, the `full` policy: what `generate(prefill="parallel")` does with the whole
history as its prompt), or runs only the new turn's T tokens against the cache the previous turns
left (`inference.extend`, `ops.prefix.prefix_attention`): with the `full` policy (a cache of N T
slots, the same logits) and with `fpa_budget` at --budget of N T (every query sees at most that
many cached keys plus its own turn).

Per turn and method: wall time (median of --repeats, after a compiled, untimed pass of the whole
conversation); per method, XLA's compiled temp memory of a turn's program (`.lower().compile().
memory_analysis()`: re-prefill per turn, it grows with the context; chunked: one program for every
turn) and the bytes kept between turns (the cache; re-prefill keeps none, it rebuilds it). The last turn's logits of chunked `full` against re-prefill are reported (they must agree up to
fp32 reduction order). Speed does not depend on the weights: an untrained model.
Writes results/bench_prefix.{json,md} (with the command).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments._common import ROOT, md_table, run_meta, study_parser, write_prefixed
from fpa_jax import configs as C
from fpa_jax.inference import conversation as E
from fpa_jax.inference import make_policy
from fpa_jax.inference.decode import prefill_parallel
from fpa_jax.models import build_model

MODULE = "experiments.bench_prefix"
MiB = 2**20


def _temp_bytes(compiled) -> int | None:
  mem = compiled.memory_analysis()
  return None if mem is None else int(mem.temp_size_in_bytes)


def reprefill(model, tokens, n_keys: int):
  """A compiled whole-conversation prefill: () -> (logits [B, P, V], caches), its temp bytes."""
  graphdef, state = nnx.split(model)
  b, p = tokens.shape
  pol = make_policy("full", n_keys)

  def run(state, tokens):
    return prefill_parallel(nnx.merge(graphdef, state), tokens, jnp.full((b,), p, jnp.int32), pol, n_keys)

  compiled = jax.jit(run).lower(state, tokens).compile()
  return (lambda: compiled(state, tokens)), _temp_bytes(compiled)


def chunk_program_temp(model, conv, tokens) -> int | None:
  """Compiled temp bytes of one `extend` call of `tokens` after `conv` (every turn runs this one
  program: the cache has max_len slots from the first turn on)."""
  graphdef, state = nnx.split(model)
  b = tokens.shape[0]
  lengths, seen = jnp.full((b,), tokens.shape[1], jnp.int32), jnp.asarray(conv.seen, jnp.int32)
  lowered = E._extend_program.lower(graphdef, state, conv.caches, tokens, lengths, seen, policy=conv.policy)
  return _temp_bytes(lowered.compile())


def run_chunked(model, turns, max_len: int, policy: str, kw: dict, repeats: int):
  """extend turn by turn: (per-turn median seconds, the program's temp bytes, cache bytes, the last
  turn's logits)."""

  def once():
    conv, times, logits = None, [], None
    for t in turns:
      start = time.perf_counter()
      logits, conv = E.extend(model, t, conv, **({} if conv else dict(max_len=max_len, policy=policy, **kw)))
      jax.block_until_ready(logits)
      times.append(time.perf_counter() - start)
    return times, conv, logits

  once()  # compiles the one program every turn runs
  runs = [once() for _ in range(repeats)]
  per_turn = [statistics.median(r[0][i] for r in runs) for i in range(len(turns))]
  _, conv, logits = runs[-1]
  return per_turn, chunk_program_temp(model, conv, turns[-1]), conv.nbytes(), np.asarray(logits)


def main(argv=None) -> dict:
  ap = study_parser(MODULE, __doc__)
  ap.add_argument("--config", default="small", choices=sorted(C.CONFIGS))
  ap.add_argument("--turns", type=int, default=8)
  ap.add_argument("--turn-tokens", type=int, default=128)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--budget", type=float, default=0.25, help="fpa_budget's share of the whole conversation")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=str(ROOT / "results" / "bench_prefix"))
  a = ap.parse_args(argv)
  t0 = time.perf_counter()
  cfg = C.get_config(a.config)
  model = build_model(cfg)
  n, tt = a.turns, a.turn_tokens
  max_len = n * tt
  rng = np.random.default_rng(0)
  conversation = jnp.asarray(rng.integers(3, cfg.vocab_size, (a.batch, max_len)), jnp.int32)
  turns = [conversation[:, i * tt : (i + 1) * tt] for i in range(n)]

  re_ms, re_temp = [], []
  for i in range(n):
    run, temp = reprefill(model, conversation[:, : (i + 1) * tt], max_len)
    jax.block_until_ready(run())
    times = []
    for _ in range(a.repeats):
      start = time.perf_counter()
      out = run()
      jax.block_until_ready(out)
      times.append(time.perf_counter() - start)
    re_ms.append(1e3 * statistics.median(times))
    re_temp.append(temp)
  re_logits = np.asarray(out[0][:, -tt:])
  re_cache = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out[1])))

  methods = {"chunked_full": ("full", {}), "chunked_fpa_budget": ("fpa_budget", {"budget": a.budget})}
  res_methods = {}
  for label, (policy, kw) in methods.items():
    per_turn, temp, cache, logits = run_chunked(model, turns, max_len, policy, kw, a.repeats)
    res_methods[label] = {
      "policy": policy,
      **kw,
      "turn_ms": [1e3 * s for s in per_turn],
      "temp_bytes": temp,
      "cache_bytes": cache,
      "total_ms": 1e3 * sum(per_turn),
    }
    if policy == "full":
      res_methods[label]["last_turn_max_abs_diff_vs_reprefill"] = float(np.abs(logits - re_logits).max())
  res = {
    "config": a.config,
    "d_model": cfg.d_model,
    "n_layers": cfg.n_layers,
    "n_heads": cfg.n_heads,
    "batch": a.batch,
    "turns": n,
    "turn_tokens": tt,
    "reprefill": {"turn_ms": re_ms, "turn_temp_bytes": re_temp, "cache_bytes": re_cache, "total_ms": sum(re_ms)},
    "methods": res_methods,
  }
  res["meta"] = run_meta(MODULE, argv, wall_s=time.perf_counter() - t0)
  write_prefixed(a.out, res, markdown(res))
  return res


def markdown(res: dict) -> str:
  m, re_ = res["methods"], res["reprefill"]
  full, bud = m["chunked_full"], m["chunked_fpa_budget"]
  mib = lambda x: None if x is None else x / MiB
  rows = []
  for i in range(res["turns"]):
    ctx = (i + 1) * res["turn_tokens"]
    rows.append([i + 1, ctx, re_["turn_ms"][i], full["turn_ms"][i], bud["turn_ms"][i], mib(re_["turn_temp_bytes"][i])])
  head = ["turn", "context", "re-prefill ms", "chunked full ms", f"chunked fpa_budget {bud['budget']:g} ms"]
  head.append("re-prefill temp MiB")
  meta = res["meta"]
  lines = [
    f"`{meta['command']}`: {res['config']} model (d_model {res['d_model']}, {res['n_layers']} layers, "
    f"{res['n_heads']} heads, untrained), batch {res['batch']}, a conversation of {res['turns']} turns of "
    f"{res['turn_tokens']} tokens; {meta['machine']['backend']}, {meta['machine']['cpu_count']} cores, load "
    f"{meta['load_avg_1_5_15min']}. Per turn: median of the timed passes; temp: XLA's compiled temp memory of "
    "the turn's program (chunked: one program for every turn).",
    "",
    md_table(head, rows),
    md_table(
      ["method", "all turns ms", "vs re-prefill", "temp MiB (largest turn)", "cache kept between turns MiB"],
      [
        ["re-prefill (whole conversation, full)", re_["total_ms"], 1.0, mib(max(re_["turn_temp_bytes"])), 0.0],
        [
          "chunked, full cache",
          full["total_ms"],
          full["total_ms"] / re_["total_ms"],
          mib(full["temp_bytes"]),
          mib(full["cache_bytes"]),
        ],
        [
          f"chunked, fpa_budget {bud['budget']:g}",
          bud["total_ms"],
          bud["total_ms"] / re_["total_ms"],
          mib(bud["temp_bytes"]),
          mib(bud["cache_bytes"]),
        ],
      ],
    ),
    f"Chunked full vs re-prefill, last turn's logits: max |diff| = "
    f"{full['last_turn_max_abs_diff_vs_reprefill']:.2e} (fp32 reduction order). Re-prefill rebuilds a cache of "
    f"{mib(re_['cache_bytes']):.2f} MiB at every turn.",
  ]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
