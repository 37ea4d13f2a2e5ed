"""Forgetting turned into speed (issue 21 §2): on a trained model's own fields, the share of tiles
dead-tile skipping (`skip_tolerance`) drops, and the prefill time with it on and off.

    python -m experiments.forget_speed                              # fpa_fox5_evict and fpa_fox5
    python -m experiments.forget_speed --models fpa_fox5_evict --tolerances 1e-3 1e-1

The passkey study's models (their workdirs are in results/passkey.json) read `--batch` passkey test
prompts at `--multiple` x their training length (depths spread over 0-100%). For each tolerance eps:
  * tiles dropped: `ops.chunked.skipped_tile_fraction` on every layer's own q, k, field and level
    (recorded from one forward pass), per (batch, kv head) and for all of them at once (only
    then is a tile's compute skipped), averaged over the layers;
  * prefill time: the jitted forward pass of the whole model over the prompts, skipping on (eps)
    and off (None), median of `--repeats` after a compile and a warm-up;
  * answers: greedy exact match of the passkey answers with skipping on (teacher-forced, as the
    passkey study scores them), which the bound says cannot change beyond eps per row.
Writes results/forget_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from experiments import _common as U

MODULE = "experiments.forget_speed"


def record_attention_inputs(model, tokens):
  """[(q, k, gates, layer cfg)] of every attention layer, from one jitted forward pass over tokens [B, T]."""
  import jax
  from flax import nnx

  from fpa_jax import layers

  seen, cfgs, orig = [], [], layers.FirstPassageAttention.parallel_attention

  def rec(self, op, q, k, v, gates, segment_ids):
    seen.append((q, k, tuple(gates)))
    cfgs.append(self.cfg)
    return orig(self, op, q, k, v, gates, segment_ids)

  graphdef, state = nnx.split(model)

  def forward(state, tokens):  # returns what the layers saw (traced once: one compile)
    seen.clear()
    nnx.merge(graphdef, state)(tokens)
    return list(seen)

  layers.FirstPassageAttention.parallel_attention = rec
  try:
    out = jax.jit(forward)(state, tokens)
  finally:
    layers.FirstPassageAttention.parallel_attention = orig
  return [(q, k, g, c) for (q, k, g), c in zip(out, cfgs)]


def tiles_dropped(recorded, eps: float) -> tuple[float, float]:
  """(per (batch, kv head), for all at once) fraction of off-diagonal tiles dropped, mean over layers."""
  import jax.numpy as jnp

  from fpa_jax.ops import chunked

  per, every = [], []
  for q, k, gates, cfg in recorded:
    if len(gates) == 2:
      gate = chunked.FPAGate(*gates)
    else:  # FoX: the kernel tiles c = cumsum(log forget)
      gate = chunked.FoXGate(jnp.cumsum(gates[0], axis=1))
    a, b = chunked.skipped_tile_fraction(
      q, k, gate, skip_tolerance=eps, scale=cfg.head_dim**-0.5, block_size=cfg.block_size or None
    )
    per.append(a)
    every.append(b)
  return float(np.mean(per)), float(np.mean(every))


def prefill_seconds(model, tokens, repeats: int) -> float:
  fwd = U.forward_fn(model)
  fwd(tokens).block_until_ready()  # compile
  fwd(tokens).block_until_ready()  # warm up
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fwd(tokens).block_until_ready()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def with_skip(model, eps):
  """The same parameters in a model whose layers skip dead tiles at eps (None: exact)."""
  from flax import nnx

  from fpa_jax import configs as C
  from fpa_jax.models import build_model

  other = build_model(C.replace(model.cfg, skip_tolerance=eps, attn_impl="chunked"), seed=0)
  nnx.update(other, nnx.state(model))
  return other


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", nargs="+", default=["fpa_fox5_evict", "fpa_fox5"])
  ap.add_argument("--passkey-results", default=str(U.ROOT / "results" / "passkey.json"))
  ap.add_argument("--multiple", type=int, default=8)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--tolerances", type=float, nargs="+", default=[1e-3, 1e-1])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=str(U.ROOT / "results" / "forget_speed"))
  a = ap.parse_args(argv)
  import jax.numpy as jnp

  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.eval import passkey_cell
  from fpa_jax.inference import load_model

  t0 = time.perf_counter()
  pk = U.passkey_models(a.passkey_results, a.models)
  train_len = pk["train_length"]
  depths = np.linspace(0, 100, a.batch).round().astype(int).tolist()
  exs = [passkey_eval_examples(train_len, a.multiple, d, n=1, seed=i)[0] for i, d in enumerate(depths)]
  cut = min(len(e["tokens"]) for e in exs)
  tokens = jnp.asarray(np.stack([e["tokens"][:cut] for e in exs]).astype(np.int32))
  rows = {}
  for m in a.models:
    model, _ = load_model(U.ROOT / pk[m]["workdir"])
    exact = with_skip(model, None)
    recorded = record_attention_inputs(exact, tokens)
    base = prefill_seconds(exact, tokens, a.repeats)
    rows[m] = {"exact_prefill_s": base, "tolerances": {}}
    for eps in a.tolerances:
      per, every = tiles_dropped(recorded, eps)
      skipping = with_skip(model, eps)
      t = prefill_seconds(skipping, tokens, a.repeats)
      acc = passkey_cell(skipping, exs, batch_size=a.batch)["accuracy"]
      rows[m]["tolerances"][f"{eps:g}"] = {
        "tiles_dropped_per_head": per,
        "tiles_dropped_all_heads": every,
        "prefill_s": t,
        "speedup": base / t,
        "exact_match": float(acc),
      }
      print(
        f"[forget_speed] {m} eps={eps:g}: tiles dropped {per:.3f} ({every:.3f} for all heads), "
        f"prefill {base:.3f} s -> {t:.3f} s ({base / t:.2f}x), exact match {acc:.2f}",
        file=sys.stderr,
      )
  meta = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0, prompt_tokens=cut, batch=a.batch)
  res = {"rows": rows, "train_length": train_len, "multiple": a.multiple, "meta": meta}
  U.write_json(a.out + ".json", res)
  md = (
    f"`{meta['command']}`: passkey models of Study 2 reading {a.batch} test prompts of {cut} tokens "
    f"({a.multiple}x their training length {train_len}) in one jitted forward pass (prefill), {meta['machine']['backend']}, "
    f"{meta['machine']['cpu_count']} cores. Tiles: the share of off-diagonal attention tiles whose every weight is "
    "provably <= eps / T on the model's own fields (per batch row and kv head; for all at once, the share whose "
    "compute is skipped), mean over layers.\n\n"
  )
  md += U.md_table(
    [
      "model",
      "eps",
      "tiles dropped",
      "for all heads",
      "prefill s (exact)",
      "prefill s (skipping)",
      "speed-up",
      "exact match",
    ],
    [
      [
        m,
        e,
        f"{v['tiles_dropped_per_head']:.3f}",
        f"{v['tiles_dropped_all_heads']:.3f}",
        f"{r['exact_prefill_s']:.3f}",
        f"{v['prefill_s']:.3f}",
        f"{v['speedup']:.2f}",
        f"{v['exact_match']:.2f}",
      ]
      for m, r in rows.items()
      for e, v in r["tolerances"].items()
    ],
  )
  with open(a.out + ".md", "w") as f:
    f.write(md + "\n")
  print(md)
  return res


if __name__ == "__main__":
  main()
