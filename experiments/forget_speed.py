"""Forgetting turned into speed: on a trained model's own fields, what the two ways of
skipping under the sound bound (`skip_tolerance` eps; each row loses <= eps of its attention) drop,
and the attention and prefill time with each on and off.

    python -m experiments.forget_speed                      # fpa_fox5_evict, fpa_fox5, fox_b5
    python -m experiments.forget_speed --models fpa_fox5_evict --tolerances 1e-3 1e-1

The passkey study's models (their workdirs are in results/passkey.json) read `--batch` passkey test
prompts at `--multiple` x their training length (depths spread over 0-100%). For each tolerance eps:
  * tiles (`skip="tiles"`, forward and backward): `ops.chunked.skipped_tile_fraction` on every
    layer's own q, k, field and level (recorded from one forward pass), per (batch, kv head) and for
    all of them at once (only then is a tile's compute skipped), averaged over the layers;
  * keys (`skip="keys"`, `ops.sparse`): the share of keys before each query block
    that are kept per (batch, kv head), and the share the shared chunk loop reads (the densest head
    of each block sets it), averaged over the layers;
  * time, median of `--repeats` after a compile and a warm-up: the attention ops alone on the
    recorded inputs (summed over layers; forward for both ways, forward + backward for tiles) and
    the jitted forward pass of the whole model (prefill), each against the exact kernel;
  * answers: greedy exact match of the passkey answers with each way on (teacher-forced, as the
    passkey study scores them), which the bound says cannot change beyond eps per row.
Writes results/forget_speed.{json,md}.

    python -m experiments.forget_speed --workdirs t25=runs/one_recipe/recipe_t25_fh0_s2 \
        none=runs/one_recipe/recipe_fh0_no_objective_s2 --train-length 512 --batch 2 --tolerances 1e-3

Trainer workdirs instead (`--workdirs NAME=PATH`, e.g. the one-recipe models trained with the
evictability objective; `--train-length` their L): per tolerance, the key-sparse schedules side by
side (`ops.sparse`, reads "shared" / "per_head" / "auto"): keys kept per (row, kv head) and read by
each schedule (`live_key_stats`), the attention ops' forward with each and forward + backward
(skip="keys") against exact, and prefill with each. Every time of one table row is measured
interleaved (round robin over the variants, median of `--repeats`), so a loaded machine slows
them alike. Rows are merged into the results file by name (a rerun of one model keeps the others).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from fpa_jax.layers import FirstPassageAttention

MODULE = "experiments.forget_speed"


def record_attention_inputs(model, tokens):
  """[(q, k, v, gates, layer cfg)] of every attention layer in path order, from one jitted forward pass
  over tokens [B, T] (what the layers sow: `fpa_jax.layers.attention_inputs`). gates are the kernel's
  arguments: (field, level) for FPA, (log forget,) for FoX, softmax and nope (the layer sows their
  running sum, its field, so they come back as its differences: equal up to float rounding)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from fpa_jax.layers import attention_inputs

  graphdef, state = nnx.split(model)
  paths = []

  @jax.jit
  def forward(state, tokens):  # paths are static: kept from the trace, arrays returned
    _, found = attention_inputs(nnx.merge(graphdef, state), tokens)
    paths[:] = [path for path, _ in found]
    return [calls for _, calls in found]

  found = forward(state, tokens)
  nodes = dict(nnx.iter_graph(model))
  out = []
  for path, calls in zip(paths, found):
    layer = nodes[path]
    for q, k, v, field, level in calls:  # one call per layer (a scanned stack would need a layer axis)
      gates = (field, level) if layer.spec.kind == "fpa" else (jnp.diff(field, axis=1, prepend=0.0),)
      out.append((q, k, v, gates, layer.cfg))
  return out


def _bias(gates):
  import jax.numpy as jnp

  from fpa_jax.ops import bias

  if len(gates) == 2:
    return bias.FPABias(*gates)
  return bias.FoXBias(jnp.cumsum(gates[0], axis=1))  # FoX: the kernels tile c = cumsum(log forget)


def tiles_dropped(recorded, eps: float) -> tuple[float, float]:
  """(per (batch, kv head), for all at once) fraction of off-diagonal tiles dropped, mean over layers."""
  from fpa_jax.ops import chunked

  per, every = [], []
  for q, k, _, gates, cfg in recorded:
    a, b = chunked.skipped_tile_fraction(
      q, k, _bias(gates), skip_tolerance=eps, scale=cfg.head_dim**-0.5, block_size=cfg.block_size or None
    )
    per.append(a)
    every.append(b)
  return float(np.mean(per)), float(np.mean(every))


def keys_kept(recorded, eps: float) -> tuple[float, float]:
  """(kept per (batch, kv head), read by the shared chunk loop) share of the off-diagonal keys, mean over layers."""
  from fpa_jax.ops import sparse

  st = [
    sparse.live_key_stats(
      q, k, _bias(gates), skip_tolerance=eps, scale=cfg.head_dim**-0.5, block_size=cfg.block_size or None
    )
    for q, k, _, gates, cfg in recorded
  ]
  return float(np.mean([x["kept_per_head"] for x in st])), float(np.mean([x["read"] for x in st]))


def _median_s(fn, args, repeats: int) -> float:
  import jax

  jax.block_until_ready(fn(*args))  # compile
  jax.block_until_ready(fn(*args))  # warm up
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def attention_seconds(recorded, eps, skip: str, repeats: int, grad: bool = False) -> float:
  """Median time of every layer's attention op on its recorded inputs, summed over layers; grad:
  forward + backward (d sum(out * ct) / d every input)."""
  import jax
  import jax.numpy as jnp

  from fpa_jax import ops

  total = 0.0
  for q, k, v, gates, cfg in recorded:
    op = ops.fpa_attention if len(gates) == 2 else ops.fox_attention
    kw = dict(block_size=cfg.block_size or None, scale=cfg.head_dim**-0.5)
    if eps is not None:
      kw.update(skip_tolerance=eps, skip=skip)
    fwd = lambda q, k, v, *g: op(q, k, v, *g, **kw)  # noqa: B023 (used within this iteration)
    if grad:
      ct = jax.random.normal(jax.random.key(0), q.shape[:3] + v.shape[-1:], q.dtype)
      loss = lambda *a: jnp.sum(fwd(*a) * ct)  # noqa: B023
      fn = jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(gates)))))
    else:
      fn = jax.jit(fwd)
    total += _median_s(fn, (q, k, v, *gates), repeats)
  return total


def interleaved_seconds(fns: dict, repeats: int) -> dict:
  """{name: median seconds} of fns {name: (fn, args)}, each compiled and warmed up first, then
  timed round robin: one call of each per round, so load on a shared machine hits all alike."""
  import jax

  for fn, args in fns.values():
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
  times = {n: [] for n in fns}
  for _ in range(repeats):
    for n, (fn, args) in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[n].append(time.perf_counter() - t)
  return {n: statistics.median(x) for n, x in times.items()}


KEY_SKIPS = ("keys_shared", "keys_per_head", "keys")  # reads: shared, per_head, auto


def reads_cell(model, recorded, tokens, eps: float, repeats: int) -> dict:
  """The key-sparse schedules side by side at eps: reads (`live_key_stats`, mean over layers),
  attention forward / forward + backward and prefill seconds, each against exact, interleaved."""
  import jax
  import jax.numpy as jnp

  from fpa_jax import ops
  from fpa_jax.ops import sparse
  from fpa_jax.ops.chunked import block_for

  st = [
    sparse.live_key_stats(
      q, k, _bias(g), skip_tolerance=eps, scale=cfg.head_dim**-0.5, block_size=cfg.block_size or None
    )
    for q, k, _, g, cfg in recorded
  ]
  cell = {f"keys_{n}": float(np.mean([x[n] for x in st])) for n in st[0]}
  half = [  # the per_head reads with chunks of half a block (rounding per head halved; not timed)
    sparse.live_key_stats(
      q,
      k,
      _bias(g),
      skip_tolerance=eps,
      scale=cfg.head_dim**-0.5,
      block_size=cfg.block_size or None,
      key_chunk=max(1, (cfg.block_size or 256) // 2),
    )["read_per_head"]
    for q, k, _, g, cfg in recorded
  ]
  cell["keys_read_per_head_half_chunk"] = float(np.mean(half))
  att = {}
  for q, k, v, gates, cfg in recorded:
    op = ops.fpa_attention if len(gates) == 2 else ops.fox_attention
    base = dict(block_size=cfg.block_size or None, scale=cfg.head_dim**-0.5)
    ct = jax.random.normal(jax.random.key(0), q.shape[:3] + v.shape[-1:], q.dtype)
    fns = {}
    for name, kw in [("exact", {})] + [(sk, dict(skip_tolerance=eps, skip=sk)) for sk in KEY_SKIPS]:
      fwd = functools.partial(op, **base, **kw)
      fns[name] = (jax.jit(fwd), (q, k, v, *gates))
      if name in ("exact", "keys"):
        loss = lambda *a, f=fwd: jnp.sum(f(*a) * ct)  # noqa: B023 (ct of this layer)
        fns[f"{name}_grad"] = (jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(gates))))), (q, k, v, *gates))
    # the profile of the key-sparse forward: per_head with half-block chunks (reads closer to what is
    # kept, twice the steps), and the bound alone (every block's live-key set, no attention)
    blk = block_for(q.shape[1], cfg.block_size or None)
    sk = dict(scale=cfg.head_dim**-0.5, skip_tolerance=eps, block_size=cfg.block_size or None)
    fns["keys_per_head_half"] = (
      jax.jit(
        lambda q, k, v, *g: sparse.key_sparse_attention(
          q, k, v, _bias(g), reads="per_head", key_chunk=max(1, blk // 2), **sk
        )
      ),
      (q, k, v, *gates),
    )
    fns["bound"] = (jax.jit(lambda q, k, *g: sparse.live_keys(q, k, _bias(g), **sk)), (q, k, *gates))
    for n, t in interleaved_seconds(fns, repeats).items():
      att[n] = att.get(n, 0.0) + t
  cell.update({f"attention_s_{n}": t for n, t in att.items()})
  pre = {"exact": (U.forward_fn(with_skip(model, None)), (tokens,))}
  pre.update({sk: (U.forward_fn(with_skip(model, eps, sk)), (tokens,)) for sk in KEY_SKIPS})
  pre["no_attention"] = (without_attention(with_skip(model, None)), (tokens,))
  cell.update({f"prefill_s_{n}": t for n, t in interleaved_seconds(pre, repeats).items()})
  return cell


def without_attention(model):
  """The jitted prefill with every layer's attention op replaced by a copy of its values (the
  projections, gates, norms and logits stay): what the prefill costs besides attention. The layers
  of a copy of `model` become `_ValuesCopied` (the layer's own hook, `parallel_attention`), so the
  model itself and every other model keep their attention."""
  from flax import nnx

  copy = nnx.clone(model)  # the same parameters in modules of our own
  for _, node in nnx.iter_graph(copy):
    if type(node) is FirstPassageAttention:
      node.__class__ = _ValuesCopied
  return U.forward_fn(copy)


class _ValuesCopied(FirstPassageAttention):
  """The layer with its attention op a copy of its values (each kv head to its query heads)."""

  def parallel_attention(self, op, q, k, v, gates, segment_ids):
    import jax.numpy as jnp

    return jnp.repeat(v, q.shape[2] // v.shape[2], axis=2).astype(q.dtype)


READS_COLUMNS = [
  "model",
  "eps",
  "keys kept per head",
  "read: shared / per_head / auto (x kept)",
  "per_head, chunk blk/2",
  "attention fwd s: exact",
  "shared",
  "per_head",
  "auto",
  "fwd+bwd s: exact",
  "auto",
  "prefill s: exact",
  "shared",
  "per_head",
  "auto",
]


def reads_markdown(res: dict) -> str:
  meta = res["reads_meta"]
  md = (
    f"\n### Key-sparse schedules and backward\n\n`{meta['command']}`: trainer workdirs reading "
    f"{meta['batch']} passkey prompts of {meta['prompt_tokens']} tokens ({meta['multiple']}x L={meta['train_length']}), "
    f"{meta['machine']['backend']}, {meta['machine']['cpu_count']} cores, load {meta['load_avg_1_5_15min']}. "
    "Keys kept per (row, kv head) and read by each schedule of `skip='keys'` (shares of the off-diagonal "
    "keys; in brackets read / kept): shared (one chunk loop for every row and head, the densest sets it), "
    "per_head (each (row, kv head) its own chunks), auto (per query block the one with fewer steps, "
    "`ops.sparse.PER_HEAD_COST`). Times: medians, every variant of a row measured interleaved; "
    "speed-up against exact in brackets. fwd+bwd: d sum(out * ct) / d every input.\n\n"
  )
  sp = lambda base, t: f"{t:.3f} ({base / t:.2f}x)"
  rows = []
  for m, r in res["reads_rows"].items():
    for e, v in r.items():
      kept = v["keys_kept_per_head"]
      rd = " / ".join(
        f"{v[f'keys_read_{n}']:.3f} ({v[f'keys_read_{n}'] / max(kept, 1e-12):.2f})"
        for n in ("shared", "per_head", "auto")
      )
      a, g, p = v["attention_s_exact"], v["attention_s_exact_grad"], v["prefill_s_exact"]
      hc = v.get("keys_read_per_head_half_chunk")
      hc = "-" if hc is None else f"{hc:.3f} ({hc / max(kept, 1e-12):.2f})"
      rows.append(
        [m, e, f"{kept:.3f}", rd, hc, f"{a:.3f}"]
        + [sp(a, v[f"attention_s_{n}"]) for n in KEY_SKIPS]
        + [f"{g:.3f}", sp(g, v["attention_s_keys_grad"]), f"{p:.3f}"]
        + [sp(p, v[f"prefill_s_{n}"]) for n in KEY_SKIPS]
      )
  md += U.md_table(READS_COLUMNS, rows)
  runs = {m: v["run"] for m, r in res["reads_rows"].items() for v in r.values() if "run" in v}
  if runs:  # rows are merged by name: each says which run measured it
    md += "\n" + "".join(f"- `{m}`: `{r['command']}` (load {r['load_avg_1_5_15min']})\n" for m, r in runs.items())
  prof = [(m, e, v) for m, r in res["reads_rows"].items() for e, v in r.items() if "prefill_s_no_attention" in v]
  if prof:
    md += (
      "\nWhere the key-sparse prefill's time goes (the same rows; seconds, medians): the prefill without "
      "attention (every attention op replaced by a copy of its values: projections, gates, norms, logits), "
      "the attention ops (forward, summed over layers) exact and key-sparse (auto), the bound alone "
      "(every block's live-key set), per_head with half-block chunks; cap = the prefill's speed-up if "
      "attention cost only its kept share of its exact time in the prefill: exact / (rest + kept x (exact - rest)).\n\n"
    )
    md += U.md_table(
      ["model", "eps", "prefill exact", "rest (no attention)", "attention exact", "keys (auto)", "bound alone",
       "per_head, chunk blk/2", "prefill keys", "cap"],
      [
        [m, e, f"{v['prefill_s_exact']:.3f}", f"{v['prefill_s_no_attention']:.3f}", f"{v['attention_s_exact']:.3f}",
         f"{v['attention_s_keys']:.3f}", f"{v['attention_s_bound']:.3f}", f"{v['attention_s_keys_per_head_half']:.3f}",
         f"{v['prefill_s_keys']:.3f} ({v['prefill_s_exact'] / v['prefill_s_keys']:.2f}x)",
         f"{_cap(v):.2f}x"]
        for m, e, v in prof
      ],
    )  # fmt: skip
  return md


def _cap(v: dict) -> float:
  """The key-sparse prefill's speed-up if attention cost only its kept share (Amdahl, the rest as measured)."""
  rest, exact = v["prefill_s_no_attention"], v["prefill_s_exact"]
  return exact / (rest + v["keys_kept_per_head"] * max(exact - rest, 0.0))


def main_workdirs(a, argv) -> dict:
  import jax.numpy as jnp

  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.inference import load_model

  t0 = time.perf_counter()
  depths = np.linspace(0, 100, a.batch).round().astype(int).tolist()
  exs = [passkey_eval_examples(a.train_length, a.multiple, d, n=1, seed=i)[0] for i, d in enumerate(depths)]
  cut = min(len(e["tokens"]) for e in exs)
  tokens = jnp.asarray(np.stack([e["tokens"][:cut] for e in exs]).astype(np.int32))
  res = U.read_json(f"{a.out}.json", {}) or {}
  rows = res.setdefault("reads_rows", {})
  for spec in a.workdirs:
    name, path = spec.split("=", 1)
    model, _ = load_model(U.ROOT / path if not path.startswith("/") else path)
    recorded = record_attention_inputs(with_skip(model, None), tokens)
    rows[name] = {}
    for eps in a.tolerances:
      c = rows[name][f"{eps:g}"] = reads_cell(model, recorded, tokens, eps, a.repeats)
      c["run"] = {
        k: v
        for k, v in U.run_meta(MODULE, argv, wall_s=0.0).items()
        if k in ("command", "commit", "load_avg_1_5_15min")
      }
      print(
        f"[forget_speed] {name} eps={eps:g}: kept {c['keys_kept_per_head']:.3f}, read shared "
        f"{c['keys_read_shared']:.3f} per_head {c['keys_read_per_head']:.3f} auto {c['keys_read_auto']:.3f}; "
        f"prefill exact {c['prefill_s_exact']:.3f} s, per_head {c['prefill_s_keys_per_head']:.3f}, auto "
        f"{c['prefill_s_keys']:.3f}; fwd+bwd {c['attention_s_exact_grad']:.3f} -> {c['attention_s_keys_grad']:.3f}",
        file=sys.stderr,
      )
  res["reads_meta"] = U.run_meta(
    MODULE,
    argv,
    wall_s=time.perf_counter() - t0,
    prompt_tokens=cut,
    batch=a.batch,
    multiple=a.multiple,
    train_length=a.train_length,
  )
  md = (markdown(res) if "rows" in res else "") + reads_markdown(res)
  U.write_prefixed(a.out, res, md)
  return res


def prefill_seconds(model, tokens, repeats: int) -> float:
  return _median_s(U.forward_fn(model), (tokens,), repeats)


def with_skip(model, eps, skip: str = "tiles"):
  """The same parameters in a model whose layers skip dead tiles or keys at eps (None: exact)."""
  from flax import nnx

  from fpa_jax import configs as C
  from fpa_jax.models import build_model

  skip = "tiles" if eps is None else skip
  other = build_model(C.replace(model.cfg, skip_tolerance=eps, skip=skip, attn_impl="chunked"), seed=0)
  nnx.update(other, nnx.state(model))
  return other


COLUMNS = [
  "model",
  "eps",
  "tiles dropped (per head / all)",
  "keys kept (per head / read)",
  "attention s: exact",
  "tiles",
  "keys",
  "attention fwd+bwd s: exact",
  "tiles",
  "prefill s: exact",
  "keys",
  "exact match: tiles / keys",
]


def markdown(res: dict) -> str:
  meta = res["meta"]
  md = (
    f"`{meta['command']}`: passkey models of Study 2 reading {meta['batch']} test prompts of "
    f"{meta['prompt_tokens']} tokens ({res['multiple']}x their training length {res['train_length']}), "
    f"{meta['machine']['backend']}, {meta['machine']['cpu_count']} cores. Dropped under the bound that puts "
    "every weight skipped below eps / T (each row loses <= eps of its attention): whole tiles "
    "(`skip='tiles'`; per (batch row, kv head), and for all of them at once, the only tiles whose "
    "compute the kernel skips), or single keys per query block (`skip='keys'`; kept per "
    "(row, kv head), and read: what the chunk loop shared by all rows and heads reads), shares of the "
    "off-diagonal keys / tiles, mean over layers. Attention: the ops alone on the recorded inputs, summed "
    "over layers; prefill: the jitted forward pass of the whole model. Times are medians (speed-up "
    "against exact in brackets).\n\n"
  )
  sp = lambda base, t: f"{t:.3f} ({base / t:.2f}x)"
  rows = []
  for m, r in res["rows"].items():
    for e, v in r["tolerances"].items():
      rows.append(
        [
          m,
          e,
          f"{v['tiles_dropped_per_head']:.3f} / {v['tiles_dropped_all_heads']:.3f}",
          f"{v['keys_kept_per_head']:.3f} / {v['keys_read']:.3f}",
          f"{r['attention_s']:.3f}",
          sp(r["attention_s"], v["attention_s_tiles"]),
          sp(r["attention_s"], v["attention_s_keys"]),
          f"{r['attention_grad_s']:.3f}",
          sp(r["attention_grad_s"], v["attention_grad_s_tiles"]),
          f"{r['prefill_s']:.3f}",
          sp(r["prefill_s"], v["prefill_s_keys"]),
          f"{v['exact_match_tiles']:.2f} / {v['exact_match_keys']:.2f}",
        ]
      )
  return md + U.md_table(COLUMNS, rows)


# ------------------------------------------------------------------------------------------------
# Claims: this study's rows of the README's claims table (`experiments.report` collects them)
# ------------------------------------------------------------------------------------------------


def _speed(doc) -> str:
  """The speed target (>= 2x attention on a model trained with the objective: forgetting made useful), per passkey model
  at the smallest tolerance: key skipping's attention and prefill speed-ups, tile skipping's on the
  forward and backward pass (training), and the answers with keys skipped."""
  if doc is None:
    return "not run yet (`python -m experiments.forget_speed`)"
  parts = []
  for m, r in doc["rows"].items():
    eps = min(r["tolerances"], key=float)
    c = r["tolerances"][eps]
    parts.append(
      f"**{m}** (ε={eps}): keys read {c['keys_read']:.2f}, attention {r['attention_s'] / c['attention_s_keys']:.2f}x, "
      f"prefill {r['prefill_s'] / c['prefill_s_keys']:.2f}x, exact match {c['exact_match_keys']:.2f}; "
      f"tile skipping forward + backward {r['attention_grad_s'] / c['attention_grad_s_tiles']:.2f}x"
    )
  return (
    f"skip='keys' at {doc['multiple']}x (L={doc['train_length']}), against the exact kernel on the same prompts: "
    + "; ".join(parts)
    + ". Tile skipping was what these runs trained with (key skipping has a backward pass since), so the speed-up is prefill's, not training's"
  )


def _speed_row(root: Path) -> tuple[str, str]:
  doc = U.load_result(root, "forget_speed")
  if doc is None or not doc.get("rows"):
    return "not run", "`python -m experiments.forget_speed`"

  def gain(r):
    c = r["tolerances"][min(r["tolerances"], key=float)]
    return r["attention_s"] / c["attention_s_keys"], r["attention_grad_s"] / c["attention_grad_s_tiles"]

  m = max(doc["rows"], key=lambda m: gain(doc["rows"][m])[0])
  att, train = gain(doc["rows"][m])
  return U.seed_verdict([att >= 2.0]), (
    f"`{m}` (one seed), skip='keys' at {doc['multiple']}x: attention {att:.2f}x; training (tile skipping) {train:.2f}x"
  )


def claim_rows(root: Path = U.ROOT) -> list[U.ClaimRow]:
  """The speed claim (>= 2x attention on a model trained to forget), with every model's speed-ups."""
  return [
    U.ClaimRow(
      ">= 2x attention speed-up on a model trained to forget",
      *_speed_row(root),
      "docs/results/kv_compression.md",
      (
        "Forgetting turned into speed: >= 2x attention speed-up on a model trained to forget",
        _speed(U.load_result(root, "forget_speed")),
      ),
    )
  ]


def main(argv=None) -> dict:
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--models", nargs="+", default=["fpa_fox5_evict", "fpa_fox5", "fox_b5"])
  ap.add_argument("--passkey-results", default=str(U.ROOT / "results" / "passkey.json"))
  ap.add_argument("--multiple", type=int, default=8)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--tolerances", type=float, nargs="+", default=[1e-3, 1e-1])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default=str(U.ROOT / "results" / "forget_speed"))
  ap.add_argument("--workdirs", nargs="+", metavar="NAME=PATH", help="trainer workdirs instead of --models")
  ap.add_argument("--train-length", type=int, default=512, help="the workdirs' training length L")
  a = ap.parse_args(argv)
  if a.workdirs:
    return main_workdirs(a, argv)
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
    r = rows[m] = {
      "attention_s": attention_seconds(recorded, None, "tiles", a.repeats),
      "attention_grad_s": attention_seconds(recorded, None, "tiles", a.repeats, grad=True),
      "prefill_s": prefill_seconds(exact, tokens, a.repeats),
      "tolerances": {},
    }
    for eps in a.tolerances:
      per, every = tiles_dropped(recorded, eps)
      kept, read = keys_kept(recorded, eps)
      cell = {
        "tiles_dropped_per_head": per,
        "tiles_dropped_all_heads": every,
        "keys_kept_per_head": kept,
        "keys_read": read,
        "attention_s_tiles": attention_seconds(recorded, eps, "tiles", a.repeats),
        "attention_s_keys": attention_seconds(recorded, eps, "keys", a.repeats),
        "attention_grad_s_tiles": attention_seconds(recorded, eps, "tiles", a.repeats, grad=True),
      }
      for skip in ("tiles", "keys"):
        skipping = with_skip(model, eps, skip)
        cell[f"prefill_s_{skip}"] = prefill_seconds(skipping, tokens, a.repeats)
        cell[f"exact_match_{skip}"] = float(passkey_cell(skipping, exs, batch_size=a.batch)["accuracy"])
      r["tolerances"][f"{eps:g}"] = cell
      print(
        f"[forget_speed] {m} eps={eps:g}: tiles dropped {per:.3f} ({every:.3f} for all heads), keys kept "
        f"{kept:.3f} (read {read:.3f}); attention {r['attention_s']:.3f} s -> tiles {cell['attention_s_tiles']:.3f}, "
        f"keys {cell['attention_s_keys']:.3f} ({r['attention_s'] / cell['attention_s_keys']:.2f}x); prefill "
        f"{r['prefill_s']:.3f} s -> keys {cell['prefill_s_keys']:.3f}; exact match {cell['exact_match_tiles']:.2f} / "
        f"{cell['exact_match_keys']:.2f}",
        file=sys.stderr,
      )
  meta = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0, prompt_tokens=cut, batch=a.batch)
  res = {**(U.read_json(f"{a.out}.json", {}) or {}), "rows": rows, "train_length": train_len, "multiple": a.multiple}
  res["meta"] = meta
  md = markdown(res) + (reads_markdown(res) if "reads_rows" in res else "")
  U.write_prefixed(a.out, res, md)
  return res


if __name__ == "__main__":
  main()
