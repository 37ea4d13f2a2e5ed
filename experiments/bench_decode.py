"""Decode speed and KV-cache bytes at 1x..8x a model's training length: full vs the eviction policies.

    python -m experiments.bench_decode                     # `small` config (L=256), contexts 1x 2x 4x 8x
    python -m experiments.bench_decode --workdir runs/x    # a trained run's model and length
    python -m experiments.bench_decode --quick             # contexts 1x 2x, fewer tokens (smoke)
    python -m experiments.bench_decode --policies full fpa_budget fpa_global   # a subset (labels below)

Policies (`POLICIES`, label -> policy and arguments): full; fpa_budget, window, snapkv at 25%;
fpa_global at 25% (one shared slot pool per row of 25% of every layer's and head's keys: the cache
bytes of fpa_budget 25% plus an int32 owner tag per slot; the default `FPAGlobal.pool_impl` "packed":
the pool repacked by owner every `repack_every` steps, each head over its own range); fpa_global_cap
at 25% with a per-head limit of 50% (the same bytes); fpa_global_masked, fpa_global_gather and
fpa_global_sort: fpa_global's other implementations ("masked": each head over the whole pool,
masked; "gather": each head over its own slots, gathered; "reference": masked with eviction by one
sort of the pool), the same keys. fpa_heads at 25%: fpa_global's split between heads, measured on
the context's own prompts (`inference.calibrate_head_split`, parallel prefill) and then fixed, each
head evicting in its own capacity, a cache of its own read in place (`FPAHeads`: the split's keys,
about fpa_budget 25%'s bytes; on an untrained model the split is near even).
Each context's policies are timed interleaved (a repeat of each in turn), so a loaded machine slows
them alike: compare the ratios to full, not the seconds. With --profile (default) fpa_global's step
at the largest context is split into attention, eviction and the rest (each part: the step's time
minus the step's with that part replaced by a stand-in of no cost). Budgets are thus compared at equal cache bytes (the
`cache MiB` column: what each policy's cache allocates). For the global budgets, the kept fraction
per layer and kv head at the end of the largest context is written as a heat map
(`<out>_kept_<label>.png`). With --tolerance (default 1e-3; 0: skip) the `fpa` tolerance policy's
kept fraction and measured lost mass at 1x (`cached_logits` on the same prompts) are reported for
both bounds, per-key (`bound="keys"`) and parameter (`bound="params"`).

For each context P (a prompt of P tokens, prefilled by the parallel kernel under the policy) and
each policy, N greedy decode steps run as one jitted scan (the loop `generate` runs), compiled and
warmed up first, then timed (median of --repeats) and divided by N: prefill is excluded.
Cache bytes: every array the cache allocates (`inference.Decoder.nbytes`, no allocation: the
per-layer caches, or fpa_global's pool).
Speed does not depend on the weights, so an untrained model is measured unless --workdir is given
(kept fractions and the tolerance study do: random prompts on an untrained model say little;
`--tolerance-prompts passkey` reads a passkey model its own kind of text).
Writes results/bench_decode.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments._common import ROOT, md_table, run_meta, study_parser, write_json
from fpa_jax import configs as C
from fpa_jax.inference import Decoder, cached_logits, calibrate_head_split, load_model, make_policy, stand_in
from fpa_jax.models import build_model

POLICIES: dict[str, tuple[str, dict]] = {
  "full": ("full", {}),
  "fpa_budget": ("fpa_budget", {"budget": 0.25}),
  "window": ("window", {"budget": 0.25}),
  "snapkv": ("snapkv", {"budget": 0.25}),
  "fpa_global": ("fpa_global", {"budget": 0.25}),  # fpa_budget 25%'s bytes (a shared pool)
  "fpa_global_cap": ("fpa_global", {"budget": 0.25, "head_cap": 0.5}),  # the same, a per-head limit
  # the same policy, other implementations (`FPAGlobal.pool_impl`; the same keys and tokens)
  "fpa_global_masked": ("fpa_global", {"budget": 0.25, "pool_impl": "masked"}),
  "fpa_global_gather": ("fpa_global", {"budget": 0.25, "pool_impl": "gather"}),
  "fpa_global_sort": ("fpa_global", {"budget": 0.25, "pool_impl": "reference"}),
  # fpa_global's split calibrated on the context's prompts, then fixed per head (`FPAHeads`)
  "fpa_heads": ("fpa_heads", {"budget": 0.25, "split": "calibrate"}),
}
QUICK = ("full", "fpa_budget", "window", "fpa_global", "fpa_global_masked")

MODULE = "experiments.bench_decode"


def plot_kept_heatmap(kept, path: str, title: str) -> None:
  """kept [L, KVH] (kept fraction per layer and kv head) -> a png heat map (heads x layers)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  kept = np.asarray(kept, np.float64)
  fig, ax = plt.subplots(figsize=(max(4.0, 1.2 + 0.5 * kept.shape[0]), max(2.5, 1.0 + 0.4 * kept.shape[1])))
  im = ax.imshow(kept.T, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(kept.max()), 1e-6))
  ax.set_xlabel("layer")
  ax.set_ylabel("kv head")
  ax.set_xticks(range(kept.shape[0]))
  ax.set_yticks(range(kept.shape[1]))
  ax.set_title(title, fontsize=7, wrap=True)
  fig.colorbar(im, ax=ax, label="kept fraction")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def decode_timer(model, prompt, n_new: int, policy):
  """A function timing `n_new` decode steps (one jitted scan) after a parallel prefill of `prompt`."""
  graphdef, state = nnx.split(model)
  b, p = prompt.shape
  decoder = lambda state: Decoder(nnx.merge(graphdef, state), policy, max_len=p + n_new)  # noqa: E731

  @jax.jit
  def prefill(state, prompt):
    logits, caches = decoder(state).prefill(prompt, mode="parallel")  # fpa_global: into the pool
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), caches

  @jax.jit
  def decode(state, caches, tok):
    dec = decoder(state)

    def body(carry, pos, repack=True):
      caches, tok = carry
      logits, caches = dec.step(caches, tok, jnp.full((b,), pos, jnp.int32), repack=repack)
      return (caches, jnp.argmax(logits, -1).astype(jnp.int32)), None

    (caches, tok), _ = dec.scan(body, (caches, tok), jnp.arange(p, p + n_new))  # generate's loop
    held = caches.occupancy()[1]  # [L, B, KVH]
    return tok, jnp.mean(held, axis=1) / (p + n_new)  # kept fraction per layer and kv head

  tok, caches = prefill(state, jnp.asarray(prompt, jnp.int32))
  kept = []

  def run() -> float:
    t = time.perf_counter()
    out = jax.block_until_ready(decode(state, caches, tok))
    dt = time.perf_counter() - t
    kept[:] = [np.asarray(out[1])]
    return dt

  run.kept = kept
  return run


def time_decode(model, prompt, n_new: int, repeats: int, policy) -> tuple[float, np.ndarray]:
  """(median seconds per decode step (compile and one warm-up call excluded), kept [L, KVH] at the end)."""
  (per_token,), (kept,) = time_interleaved(model, prompt, n_new, repeats, [policy])
  return per_token, kept


def time_interleaved(model, prompt, n_new: int, repeats: int, policies) -> tuple[list[float], list[np.ndarray]]:
  """`time_decode` for several policies on one prompt, their repeats interleaved (policy 1, 2, ...,
  1, 2, ...) so a machine loaded by other jobs slows each alike: ([median s per step], [kept])."""
  runs = [decode_timer(model, prompt, n_new, p) for p in policies]
  for run in runs:
    run(), run()
  times = [[] for _ in runs]
  for _ in range(repeats):
    for t, run in zip(times, runs):
      t.append(run())
  return [statistics.median(t) / n_new for t in times], [run.kept[0] for run in runs]


def profile_global(model, prompt, n_new: int, repeats: int, policy) -> dict:
  """fpa_global's step split by stand-ins (`fpa_jax.inference.stand_in`), timed interleaved with the whole step:
  {"step_ms", "attention_ms", "eviction_ms", "rest_ms"} per token (a part's time: the whole step's
  minus the step's without it)."""
  runs = [decode_timer(model, prompt, n_new, policy)]
  for part in ("attention", "eviction"):
    with stand_in(part):  # traced (and compiled) inside: the stand-in is baked into this program
      run = decode_timer(model, prompt, n_new, policy)
      run(), run()
    runs.append(run)
  runs[0](), runs[0]()
  times = [[] for _ in runs]
  for _ in range(repeats):
    for t, run in zip(times, runs):
      t.append(run())
  step, no_attn, no_evict = (statistics.median(t) / n_new * 1e3 for t in times)
  attn, evict = step - no_attn, step - no_evict
  return {"step_ms": step, "attention_ms": attn, "eviction_ms": evict, "rest_ms": step - attn - evict}


def tolerance_study(model, prompt, eps: float) -> dict:
  """The `fpa` tolerance policy with each bound on `prompt` [B, T]: kept fraction and measured lost mass."""
  out = {}
  for bound in ("keys", "params"):
    _, s = cached_logits(model, prompt, policy="fpa", tolerance=eps, bound=bound)
    out[bound] = {k: s[k] for k in ("kept_fraction_mean", "cache_fraction", "lost_mass_max", "overflow")}
  return out


def tolerance_prompts(kind: str, random_prompts: np.ndarray, length: int) -> jax.Array:
  """[B, length'] prompts of the tolerance study: the random ones cut to `length`, or B passkey test
  prompts at 1x (depths spread over 0..100%) cut before the answer, all to the shortest."""
  if kind == "random":
    return jnp.asarray(random_prompts)[:, :length]
  from fpa_jax.data import passkey_eval_examples

  b = len(random_prompts)
  exs = [
    passkey_eval_examples(length, 1, depth, n=1, seed=i)[0]
    for i, depth in enumerate(np.linspace(0, 100, b).round().astype(int).tolist())
  ]
  cut = min(ex["answer_start"] for ex in exs)
  return jnp.asarray(np.stack([np.asarray(ex["tokens"][:cut], np.int32) for ex in exs]))


def main(argv=None) -> dict:
  ap = study_parser(MODULE, __doc__)
  ap.add_argument("--workdir", help="a training run to load (default: an untrained --config model)")
  ap.add_argument("--config", default="small", choices=sorted(C.CONFIGS))
  ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help=f"multiples 1 2, 16 new tokens, 1 repeat, {QUICK}, no tolerance")
  ap.add_argument("--policies", nargs="+", choices=sorted(POLICIES), help="labels to run (default: all)")
  ap.add_argument("--tolerance", type=float, help="fpa tolerance study at 1x (default 1e-3, --quick: 0 = skip)")
  ap.add_argument(
    "--tolerance-prompts",
    choices=("random", "passkey"),
    default="random",
    help="prompts of the tolerance study: random tokens, or the passkey test prompts at 1x (byte models trained "
    "by experiments.passkey: what the model was trained to read)",
  )
  ap.add_argument(
    "--profile",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="split fpa_global's step at the largest context into attention, eviction and the rest",
  )
  ap.add_argument("--out", default=str(ROOT / "results" / "bench_decode"))
  a = ap.parse_args(argv)
  labels = list(a.policies or (QUICK if a.quick else POLICIES))
  if "full" not in labels:
    labels.insert(0, "full")  # the reference of every ratio
  if a.quick:
    a.multiples, a.new_tokens, a.repeats = [1, 2], 16, 1
  if a.tolerance is None:
    a.tolerance = 0.0 if a.quick else 1e-3

  t_start = time.perf_counter()
  if a.workdir:
    model, cfg = load_model(a.workdir)
  else:
    cfg = C.get_config(a.config)
    model = build_model(cfg)
  length = cfg.seq_len
  rng = np.random.default_rng(0)
  rows, table = {}, []
  prompts = {m: rng.integers(3, cfg.vocab_size, (a.batch, length * m)) for m in a.multiples}

  splits = {}

  def resolve(label: str, p: int):
    policy, kw = POLICIES[label]
    if kw.get("split") == "calibrate":  # fpa_global's split on this context's prompts, once per context
      if (label, p) not in splits:
        splits[(label, p)] = calibrate_head_split(model, prompts[p // length], kw["budget"], show_progress=False)
      kw = {**kw, "split": splits[(label, p)]}
    return make_policy(policy, p + a.new_tokens, **kw)

  timed = {}
  for mult in tqdm(a.multiples, desc="bench_decode", disable=None):  # each context's policies interleaved
    p = length * mult
    pols = [resolve(label, p) for label in labels]
    timed[mult] = dict(zip(labels, zip(*time_interleaved(model, prompts[mult], a.new_tokens, a.repeats, pols))))
  for mult, label in [(m, label) for m in a.multiples for label in labels]:
    p = length * mult
    policy, kw = POLICIES[label]
    pol = resolve(label, p)
    per_token, kept = timed[mult][label]
    r = {
      "context": p,
      "multiple": mult,
      "policy": policy,
      "label": label,
      "budget": kw.get("budget"),
      "head_cap": kw.get("head_cap"),
      "pool_impl": pol.pool_impl if pol.is_global else None,
      "head_keys": getattr(pol, "head_keys", None),  # fpa_heads: each (layer, kv head)'s capacity
      "capacity": pol.capacity,
      "slots_per_row": Decoder(model, pol, max_len=p + a.new_tokens).slots_per_row(),
      "recent": pol.recent,
      "cache_bytes": Decoder(model, pol, max_len=p + a.new_tokens).nbytes(a.batch),
      "decode_ms_per_token": per_token * 1e3,
      "tokens_per_s": a.batch / per_token,
      "kept_fraction_mean": float(np.mean(kept)),
      "kept_fraction_per_head": kept.tolist(),
    }
    rows[f"{mult}x/{label}"] = r
  top = max(a.multiples)
  heatmaps = {}
  for label in labels:
    if POLICIES[label][0] == "fpa_global" and "pool_impl" not in POLICIES[label][1]:
      path = f"{a.out}_kept_{label}.png"
      r = rows[f"{top}x/{label}"]
      title = f"{cfg.name} {cfg.attention} {label} ({r['budget']} keys, head cap {r['head_cap'] or 'none'}) at {top}x"
      plot_kept_heatmap(r["kept_fraction_per_head"], path, title)
      heatmaps[label] = path
  tol = None
  if a.tolerance:
    tol = {
      "tolerance": a.tolerance,
      "context": length,
      "prompts": a.tolerance_prompts,
      **tolerance_study(model, tolerance_prompts(a.tolerance_prompts, prompts[min(a.multiples)], length), a.tolerance),
    }
  for mult in a.multiples:
    full = rows[f"{mult}x/full"]
    for label in labels:
      r = rows[f"{mult}x/{label}"]
      r["cache_bytes_over_full"] = r["cache_bytes"] / full["cache_bytes"]
      r["decode_time_over_full"] = r["decode_ms_per_token"] / full["decode_ms_per_token"]
      table.append(
        [
          f"{mult}x ({r['context']})",
          label,
          "-" if r["policy"] == "fpa_global" and r["head_cap"] is None else r["capacity"],
          r["slots_per_row"],
          f"{r['cache_bytes'] / 2**20:.2f}",
          f"{r['cache_bytes_over_full']:.3f}",
          f"{r['decode_ms_per_token']:.2f}",
          f"{r['decode_time_over_full']:.3f}",
          f"{r['tokens_per_s']:.0f}",
          f"{r['kept_fraction_mean']:.3f}",
        ]
      )
  targets = {}
  for label in ("fpa_budget", "fpa_global", "fpa_heads", "fpa_global_masked", "fpa_global_gather", "fpa_global_sort"):
    if label in labels:
      targets[f"{label}_cache_bytes_over_full_{top}x"] = rows[f"{top}x/{label}"]["cache_bytes_over_full"]
      targets[f"{label}_decode_time_over_full_{top}x"] = rows[f"{top}x/{label}"]["decode_time_over_full"]
  profile = None
  if "fpa_global" in labels and a.profile:
    profile = profile_global(model, prompts[top], a.new_tokens, a.repeats, resolve("fpa_global", length * top))
    profile["context"] = length * top
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
  out = {"rows": rows, "targets": targets, "profile": profile, "tolerance": tol, "heatmaps": heatmaps, "meta": meta}
  write_json(a.out + ".json", out)
  head = (
    f"`{meta['command']}`: {cfg.name} {cfg.attention} model (d_model {cfg.d_model}, {cfg.n_layers} layers, "
    f"{cfg.n_heads} heads, training length {length}), batch {a.batch}, {a.new_tokens} new tokens after a "
    f"prompt of the given context (parallel prefill, excluded), {meta['machine']['backend']}, "
    f"{meta['machine']['cpu_count']} cores.\n\n"
  )
  legend = "; ".join(f"{k}: {v[0]} {v[1]}" for k, v in POLICIES.items() if k in labels)
  head += f"Policies: {legend} (capacity: slots per layer and head, for fpa_global its per-head limit inside the pool, - = none; slots / row: all layers' and heads' slots of a row, for fpa_global its pool; kept: keys held at the end / seen).\n\n"
  md = head + md_table(
    [
      "context",
      "policy",
      "capacity",
      "slots / row",
      "cache MiB",
      "cache / full",
      "decode ms/token",
      "time / full",
      "tokens/s",
      "kept",
    ],
    table,
  )
  for label, goal in (("fpa_budget", 1.0), ("fpa_global", 0.5), ("fpa_heads", 0.5)):
    if label in labels:
      tb, tt = targets[f"{label}_cache_bytes_over_full_{top}x"], targets[f"{label}_decode_time_over_full_{top}x"]
      md += (
        f"\nAt {top}x: {label} holds **{tb:.3f}x** the cache bytes of full (target <= 0.3: "
        f"{'met' if tb <= 0.3 else 'not met'}) and decodes a token in **{tt:.3f}x** full's time (target <= {goal:g}: "
        f"{'met' if tt <= goal else 'not met'}).\n"
      )
  for label in ("fpa_global_masked", "fpa_global_gather", "fpa_global_sort"):
    if label in labels:
      md += (
        f"\nAt {top}x: {label} (`pool_impl={POLICIES[label][1]['pool_impl']!r}`: the same keys and tokens) decodes a "
        f"token in **{targets[f'{label}_decode_time_over_full_{top}x']:.3f}x** full's time.\n"
      )
  if profile:
    st = profile["step_ms"]
    md += (
      f"\nfpa_global's step at {top}x ({profile['context']} tokens; each part: the step's time minus the step's "
      f"with that part replaced by a stand-in of no cost, interleaved): {st:.2f} ms/token = attention "
      f"{profile['attention_ms']:.2f} ({profile['attention_ms'] / st:.0%}) + eviction between steps "
      f"{profile['eviction_ms']:.2f} ({profile['eviction_ms'] / st:.0%}) + the rest (projections, MLP, pool "
      f"bookkeeping) {profile['rest_ms']:.2f} ({profile['rest_ms'] / st:.0%}).\n"
    )
  if tol:
    md += (
      f"\nTolerance policy `fpa` (eps = {a.tolerance:g}) at 1x ({length} tokens, every token decoded; "
      f"{a.tolerance_prompts} prompts):\n\n"
    )
    md += md_table(
      ["bound", "kept / seen (mean)", "peak keys held / seq", "max lost mass", "overflow"],
      [
        [b, f"{v['kept_fraction_mean']:.3f}", f"{v['cache_fraction']:.3f}", f"{v['lost_mass_max']:.2e}", v["overflow"]]
        for b, v in tol.items()
        if b in ("keys", "params")
      ],
    )
  with open(a.out + ".md", "w") as f:
    f.write(md)
  print(md)
  return out


if __name__ == "__main__":
  main()
  sys.exit(0)
