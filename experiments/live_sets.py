"""Study 1: do single-head attention layers converge to the target live-key sets?

    python -m experiments.live_sets --task all                 # 5 seeds x {fpa, stack, fox, softmax}, both tasks
    python -m experiments.live_sets --task scopes --seeds 2 --small   # a quick look (~1-2 min), 600 steps
    python -m experiments.live_sets --ablations                # study 5: gate choices, coverage, 3 seeds

One attention layer, one head: token embedding -> RMSNorm -> the library's own
`fpa_jax.layers.FirstPassageAttention` (d_model 16, n_heads 1, every gate field at its `Config`
default; softmax gets RoPE as the config does), trained with Adam on in-memory `fpa_scopes` /
`fpa_dips` examples (the generators' defaults at T=64) and evaluated on held-out examples at 1x and
2x that length. Only the attention weights of each QUERY token are trained and scored; queries
with an empty live set are left out. Two heads per seed and method (same init, same data):

  mass      trained with -log(attention mass on the live set); scored as that mass.
  coverage  trained with KL(uniform over the live set || attention); scored as 1 - TV to it.

A seed succeeds on a metric when it reaches >= 0.95 at both 1x and 2x; `successes` counts seeds
that succeed on both metrics. The attention weights are the layer's own math in the quadratic
formulation (`ops.first_passage_penalty` of the layer's `gate_field_level`, q.k logits), checked once
per method against the layer's chunked forward output. The seeds of one method are trained
together (`jax.vmap` over stacked parameters; each seed's init, data and batches depend on the seed
alone). Resuming: a rerun with the same settings skips the (method, seed) pairs the results file
already holds with the same layer config, and trains only the missing seeds.

Writes results/{scopes,dips}.{json,md,png} (or results/ablations_live_sets.{json,md}).
Shape legend: R replicas (seeds x heads), N examples, B batch, T sequence, H heads, K head_dim.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from experiments import _common as U
from experiments import recipes
from fpa_jax import configs as C
from fpa_jax.data import dips as dips_data
from fpa_jax.data import scopes as scopes_data
from fpa_jax.layers import GATE_OPTIONS, FirstPassageAttention, RMSNorm
from fpa_jax.ops import first_passage_penalty

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("scopes", "dips")
METHODS = ("fpa", "stack", "fox", "softmax")
OBJECTIVES = ("mass", "coverage")
THRESHOLD = 0.95
TRAIN_LEN = 64
# The same training budget for every method (no per-method tuning).
DEFAULTS = dict(steps=1500, batch=16, lr=3e-3, pool=2048, n_eval=256, chunk=50)
SMALL = dict(steps=600, pool=512, n_eval=64)  # ~70 s for 4 methods x 2 seeds on scopes (2-core CPU)
# Study 5: gate choices on the coverage objective (3 seeds), `experiments.recipes`
ABLATIONS = recipes.LIVE_SETS_ABLATIONS

MODULE = "experiments.live_sets"


# ---------------------------------------------------------------------------------------------
# data


def task_module(task: str):
  return {"scopes": scopes_data, "dips": dips_data}[task]


def gen_config(task: str, length: int):
  return scopes_data.ScopesConfig(length=length) if task == "scopes" else dips_data.DipsConfig(length=length)


def vocab_size(task: str) -> int:
  return task_module(task).vocab_size(gen_config(task, TRAIN_LEN))


def token_names(task: str) -> list[str]:
  """Short display names of the vocabulary (figures)."""
  if task == "scopes":
    c = gen_config(task, TRAIN_LEN).n_symbols
    return ["pad", "bos", "eos", "(", ")", "?", "none"] + [f"c{s}" for s in range(c)] + [f"A{s}" for s in range(c)]
  cfg = gen_config(task, TRAIN_LEN)
  return (
    ["pad", "bos", "eos", "?", "none"]
    + [f"dip{v}" for v in range(cfg.n_levels)]
    + [f"L{l}c{s}" for l in range(cfg.n_levels) for s in range(cfg.n_symbols)]
    + [f"A{s}" for s in range(cfg.n_symbols)]
  )


def make_examples(task: str, n: int, length: int, seed: int) -> dict[str, np.ndarray]:
  """n generator examples as dense arrays.

  Returns tokens [N, T] int32 and target [N, T, T] bool: target[n, i, j] iff i is a QUERY position
  and key j is in its live set (rows of other tokens, and of queries with no live key, are empty).
  """
  mod, cfg = task_module(task), gen_config(task, length)
  rng = np.random.default_rng(seed)
  tokens = np.zeros((n, length), np.int32)
  target = np.zeros((n, length, length), bool)
  for e in range(n):
    ex = mod.generate(rng, cfg)
    tokens[e] = ex["tokens"]
    ends = np.cumsum(ex["live_len"])
    for q, lo, hi in zip(ex["query_pos"], ends - ex["live_len"], ends):
      target[e, q, ex["live_idx"][lo:hi]] = True
  return {"tokens": tokens, "target": target}


def example_rows(ex: dict) -> np.ndarray:
  """The scored query rows of the first example (the figure's), [rows] int."""
  return np.flatnonzero(ex["target"][0].any(-1))


def pad_examples(ex: dict, length: int) -> dict:
  """Pads tokens [N, T] with PAD and target [N, T, T] with False to `length`."""
  n, t = ex["tokens"].shape
  tokens = np.zeros((n, length), np.int32)  # PAD = 0 in both tasks
  target = np.zeros((n, length, length), bool)
  tokens[:, :t], target[:, :t, :t] = ex["tokens"], ex["target"]
  return {"tokens": tokens, "target": target}


def train_seed(task: str, seed: int) -> int:
  return 1000 * TASKS.index(task) + seed


def eval_seed(task: str, length: int) -> int:  # one held-out set per task and length, shared by all methods
  return 10**6 + 1000 * TASKS.index(task) + length


# ---------------------------------------------------------------------------------------------
# metrics (pure: attention weights w [..., T, T], target [..., T, T] bool)


def query_rows(target):
  """[..., T] bool: rows that are scored (a query with at least one live key)."""
  return target.any(-1)


def target_mass(w, target):
  """Mean attention mass on the live set over all scored rows (pooled over leading dims) -> scalar."""
  rows = query_rows(target)
  m = jnp.where(target, w, 0.0).sum(-1)
  return (m * rows).sum() / jnp.maximum(rows.sum(), 1)


def coverage(w, target):
  """Mean over all scored rows of 1 - TV(w_i, uniform over the live set of row i) -> scalar."""
  rows = query_rows(target)
  u = target / jnp.maximum(target.sum(-1, keepdims=True), 1)
  cov = 1.0 - 0.5 * jnp.abs(w - u).sum(-1)
  return (cov * rows).sum() / jnp.maximum(rows.sum(), 1)


def losses(logits, target):
  """logits [B, T, T] (masked entries very negative) -> (mass loss, coverage loss), means over scored rows."""
  rows = query_rows(target)
  n = jnp.maximum(rows.sum(), 1)
  lse = jax.nn.logsumexp(logits, -1)  # [B, T]
  mass = -(jax.nn.logsumexp(jnp.where(target, logits, -1e30), -1) - lse)  # -log mass on the set
  n_live = jnp.maximum(target.sum(-1), 1)
  # KL(u || p) = -mean_{j in set} log p_j - log |set|
  kl = -jnp.where(target, logits - lse[..., None], 0.0).sum(-1) / n_live - jnp.log(n_live)
  return jnp.where(rows, mass, 0.0).sum() / n, jnp.where(rows, kl, 0.0).sum() / n


# ---------------------------------------------------------------------------------------------
# model


class Head(nnx.Module):
  """Token embedding -> RMSNorm -> one `FirstPassageAttention` layer (the library's, unchanged)."""

  def __init__(self, cfg: C.Config, *, rngs: nnx.Rngs):
    self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (cfg.vocab_size, cfg.d_model)))
    self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
    self.attn = FirstPassageAttention(cfg, rngs=rngs)

  def inputs(self, tokens):
    """tokens [B, T] -> x [B, T, D]."""
    return self.norm(self.embed[...][tokens])

  def logits(self, tokens):
    """[B, H, T, T] attention logits of the quadratic formulation: q.k / sqrt(K) - penalty, causal."""
    x = self.inputs(tokens)
    b, t = tokens.shape
    q, k, _ = self.attn.project(x, jnp.broadcast_to(jnp.arange(t), (b, t)))  # [B, T, H, K]
    field, level, _ = self.attn.gate_field_level(x)  # [B, T, H]
    pen = first_passage_penalty(jnp.swapaxes(field, 1, 2), jnp.swapaxes(level, 1, 2))  # [B, H, T, T]
    causal = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.einsum("bihk,bjhk->bhij", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    return jnp.where(causal, s - jnp.where(causal, pen, 0.0), -1e30)

  def weights(self, tokens):
    """[B, H, T, T] attention weights."""
    return jax.nn.softmax(self.logits(tokens), -1)

  def quadratic_output(self, tokens):
    """The layer's output [B, T, D] computed from `weights` (to check against the chunked kernel)."""
    x = self.inputs(tokens)
    b, t = tokens.shape
    _, _, v = self.attn.project(x, jnp.broadcast_to(jnp.arange(t), (b, t)))
    return self.attn.output(jnp.einsum("bhij,bjhk->bihk", self.weights(tokens), v), x)

  def __call__(self, tokens):
    """The layer's own forward (chunked kernel) [B, T, D]."""
    return self.attn(self.inputs(tokens))


def layer_config(task: str, **overrides) -> C.Config:
  base = dict(vocab_size=vocab_size(task), d_model=16, n_heads=1, n_layers=1, seq_len=TRAIN_LEN)
  return C.replace(C.Config(), **{**base, **overrides})


@nnx.jit
def _both_outputs(model: Head, tokens):
  return model.quadratic_output(tokens), model(tokens)


@nnx.jit
def _weights(model: Head, tokens):
  return model.weights(tokens)


def check_quadratic_matches_layer(model: Head, tokens, atol=2e-5) -> float:
  """Asserts the quadratic attention weights reproduce the layer's chunked output; returns max |diff|."""
  a, b = _both_outputs(model, tokens)
  diff = float(jnp.max(jnp.abs(a - b)))
  scale = float(jnp.max(jnp.abs(b))) + 1e-6
  assert diff <= atol + 1e-4 * scale, (
    f"quadratic weights do not match the layer: max |diff| {diff:.3g} (scale {scale:.3g})"
  )
  return diff


# ---------------------------------------------------------------------------------------------
# training (all replicas of one method at once)


def train_variant(
  cfg: C.Config,
  task: str,
  seeds: list[int],
  objectives: tuple[str, ...],
  *,
  steps: int,
  batch: int,
  lr: float,
  pool: int,
  n_eval: int,
  chunk: int,
  eval_sets: dict,
  desc: str = "",
) -> dict:
  """Trains len(seeds) x len(objectives) heads; returns per-replica metrics and the figure maps."""
  reps = [(s, o) for s in seeds for o in objectives]
  rep_seed = np.array([seeds.index(s) for s, _ in reps])
  rep_obj = jnp.array([OBJECTIVES.index(o) for _, o in reps])
  # Same init and data for the heads of one seed.
  models = [Head(cfg, rngs=nnx.Rngs(train_seed(task, s))) for s in seeds]
  graphdef, _ = nnx.split(models[0])
  params = jax.tree.map(lambda *xs: jnp.stack([xs[i] for i in rep_seed]), *[nnx.state(m) for m in models])
  tx = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.1))
  opt = jax.vmap(tx.init)(params)
  data = [make_examples(task, pool, TRAIN_LEN, train_seed(task, s)) for s in seeds]
  tokens = jnp.asarray(np.stack([d["tokens"] for d in data]))  # [S, N, T]
  target = jnp.asarray(np.stack([d["target"] for d in data]))  # [S, N, T, T]
  rngs = [np.random.default_rng(train_seed(task, s) + 77) for s in seeds]  # per seed: batches do not depend on grouping

  def loss_fn(p, obj, tok, tgt):
    lg = nnx.merge(graphdef, p).logits(tok)[:, 0]  # [B, T, T]
    lm, lc = losses(lg, tgt)
    return jnp.where(obj == 0, lm, lc)

  def one_step(p, o, obj, tok, tgt):
    loss, g = jax.value_and_grad(loss_fn)(p, obj, tok, tgt)
    upd, o = tx.update(g, o, p)
    return optax.apply_updates(p, upd), o, loss

  @jax.jit
  def run_chunk(p, o, tokens, target, idx):  # idx [n, R, B] example indices into each replica's seed pool
    def body(carry, ix):
      p, o = carry
      tok = tokens[rep_seed[:, None], ix]  # [R, B, T]
      tgt = target[rep_seed[:, None], ix]
      p, o, loss = jax.vmap(one_step)(p, o, rep_obj, tok, tgt)
      return (p, o), loss

    (p, o), loss = jax.lax.scan(body, (p, o), idx)
    return p, o, loss[-1]

  t0 = time.perf_counter()
  with tqdm(total=steps, desc=desc, leave=False, mininterval=2.0) as bar:
    done = 0
    while done < steps:
      n = min(chunk, steps - done)
      # Both heads of a seed draw the same batches.
      ix = np.stack([r.integers(pool, size=(n, batch)) for r in rngs], 1)[:, rep_seed]
      params, opt, loss = run_chunk(params, opt, tokens, target, jnp.asarray(ix))
      done += n
      bar.update(n)
      bar.set_postfix(loss=f"{float(loss.mean()):.3f}")
  train_s = time.perf_counter() - t0

  @jax.jit
  def evaluate(p, tok, tgt):
    w = jax.vmap(lambda p: nnx.merge(graphdef, p).weights(tok)[:, 0])(p)  # [R, B, T, T]
    rows = query_rows(tgt).sum()
    per = lambda f: jax.vmap(lambda w: f(w, tgt))(w) * rows  # noqa: E731
    return per(target_mass), per(coverage), rows, w[:, 0]

  # Causal attention: rows < T never see what follows, so every set is scored padded to the longest
  # length (one compile); padded rows have no target and are not scored.
  t_max = max(ev["tokens"].shape[1] for ev in eval_sets.values())
  out = {"final_loss": np.asarray(loss).tolist(), "train_s": train_s}
  for name, ev in eval_sets.items():
    ev = pad_examples(ev, t_max)
    m = c = r = 0.0
    for lo in range(0, len(ev["tokens"]), 32):
      dm, dc, dr, w0 = evaluate(
        params, jnp.asarray(ev["tokens"][lo : lo + 32]), jnp.asarray(ev["target"][lo : lo + 32])
      )
      m, c, r = m + np.asarray(dm), c + np.asarray(dc), r + float(dr)
      if name == "1x" and lo == 0:  # the figure's example: the first held-out example at 1x
        t1 = eval_sets["1x"]["tokens"].shape[1]
        maps = np.asarray(w0)[:, :t1, :t1]
    out[f"mass_{name}"], out[f"coverage_{name}"] = (m / r).tolist(), (c / r).tolist()
  # The first seed's heads: check against the layer's chunked kernel, and keep the figure's maps
  # (the scored query rows of the example only: [rows, T]).
  ex_rows = example_rows(eval_sets["1x"])
  out["max_abs_diff_vs_chunked"] = 0.0
  out["example_maps"] = {}
  for r_i, (s, o) in enumerate(reps):
    if s != seeds[0]:
      continue
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x[r_i], params))
    out["max_abs_diff_vs_chunked"] = max(
      out["max_abs_diff_vs_chunked"], check_quadratic_matches_layer(model, jnp.asarray(eval_sets["1x"]["tokens"][:8]))
    )
    out["example_maps"][o] = maps[r_i][ex_rows].round(4).tolist()
  out["reps"] = reps
  out["model"] = lambda r: nnx.merge(graphdef, jax.tree.map(lambda x: x[r], params))  # replica r's trained head
  return out


def summarise(out: dict, seeds: list[int], objectives: tuple[str, ...]) -> dict:
  """Per-replica metrics -> the results entry of one method: per-seed lists and success counts."""
  reps = [tuple(r) for r in out["reps"]]
  pick = lambda key, obj: [out[key][reps.index((s, obj))] for s in seeds]  # noqa: E731
  res: dict = {"seeds": len(seeds), "seed_ids": list(seeds)}
  for obj in objectives:
    metric = "target_mass" if obj == "mass" else "coverage"
    other = "coverage" if obj == "mass" else "mass"
    for L in ("1x", "2x"):
      res[f"{metric}_{L}"] = pick(f"{obj}_{L}", obj)
      # the other metric of the same head, for reading (a mass head rarely covers the set)
      res[f"{obj}_head_{other}_{L}"] = pick(f"{other}_{L}", obj)
    res[f"final_loss_{obj}"] = pick("final_loss", obj)
  res["max_abs_diff_vs_chunked"] = out["max_abs_diff_vs_chunked"]
  res["train_s"] = out["train_s"]
  res["example_maps"] = out["example_maps"]
  return count_successes(res, objectives)


def count_successes(res: dict, objectives) -> dict:
  """Adds successes_<objective> (seeds >= THRESHOLD at 1x and 2x) and successes (every head ok)."""
  ok = np.ones(res["seeds"], bool)
  for obj in objectives:
    metric = "target_mass" if obj == "mass" else "coverage"
    good = (np.array(res[f"{metric}_1x"]) >= THRESHOLD) & (np.array(res[f"{metric}_2x"]) >= THRESHOLD)
    res[f"successes_{obj}"] = int(good.sum())
    ok &= good
  res["successes"] = int(ok.sum())
  return res


def merge_seeds(old: dict, new: dict, objectives) -> dict:
  """Appends the seeds of `new` to `old` (same variant and settings): per-seed lists concatenated."""
  res = dict(old)
  for k, v in new.items():
    if isinstance(v, list) and len(v) == new["seeds"] and k != "seed_ids":
      res[k] = old[k] + v
  res["seed_ids"] = old["seed_ids"] + new["seed_ids"]
  res["seeds"] = len(res["seed_ids"])
  res["train_s"] = old["train_s"] + new["train_s"]
  res["max_abs_diff_vs_chunked"] = max(old["max_abs_diff_vs_chunked"], new["max_abs_diff_vs_chunked"])
  return count_successes(res, objectives)


# ---------------------------------------------------------------------------------------------
# the study


def _git_commit() -> str:
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()
  except Exception:  # noqa: BLE001
    return "unknown"


def _uncommitted() -> list[str]:
  """Library / experiment files that differ from the commit (the results then depend on them)."""
  try:
    st = subprocess.run(
      ["git", "status", "--porcelain", "--", "fpa_jax", "experiments"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
    return sorted(line[3:] for line in st.splitlines() if line.strip())
  except Exception:  # noqa: BLE001
    return []


def _machine() -> str:
  return f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} {jax.default_backend()}"


def run(
  task: str = "scopes",
  *,
  seeds: int = 5,
  steps: int = DEFAULTS["steps"],
  methods=METHODS,
  objectives=OBJECTIVES,
  variants: dict | None = None,
  batch: int = DEFAULTS["batch"],
  lr: float = DEFAULTS["lr"],
  pool: int = DEFAULTS["pool"],
  n_eval: int = DEFAULTS["n_eval"],
  chunk: int = DEFAULTS["chunk"],
  overrides: dict | None = None,
  out: str | Path | None = None,
  resume: bool = True,
  figure: bool = True,
  command: str | None = None,
) -> dict:
  """Trains and scores every method (or named config `variants`) on one task; returns the results dict.

  variants: {name: Config overrides} (default: {method: {"attention": method}} for `methods`).
  overrides: Config overrides applied to every variant (e.g. {"step_init_std": 1e-3}).
  out: results/<task>.json path (also writes .md and, with `figure`, .png beside it); None -> no files.
  resume: keep what `out` holds from runs with the same settings (any seed count) and the same layer
    config: variants and seeds already there are not rerun; other variants in the file are kept.
  """
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; use one of {TASKS}")
  variants = variants or {m: {"attention": m} for m in methods}
  overrides = dict(overrides or {})
  objectives = tuple(objectives)
  settings = dict(
    task=task,
    seeds=seeds,
    steps=steps,
    batch=batch,
    lr=lr,
    pool=pool,
    n_eval=n_eval,
    objectives=list(objectives),
    train_len=TRAIN_LEN,
    overrides=overrides,
  )
  out = Path(out) if out else None
  results: dict = {}
  prev_wall = 0.0
  if out and resume and out.exists():
    old = json.loads(out.read_text())
    drop_seeds = lambda d: {k: v for k, v in d.items() if k != "seeds"}  # noqa: E731
    if drop_seeds(old.get("meta", {}).get("settings", {})) == drop_seeds(settings):
      results = {k: v for k, v in old.items() if k != "meta"}
      prev_wall = old["meta"].get("wall_s", 0.0)  # counted only while some old entry is kept (below)
  seed_ids = list(range(seeds))
  eval_sets = {f"{m}x": make_examples(task, n_eval, m * TRAIN_LEN, eval_seed(task, m * TRAIN_LEN)) for m in (1, 2)}
  t0 = time.perf_counter()
  fresh: set[str] = set()  # variants (re)trained in this call
  # wall time of what the file holds: earlier calls count while any of their entries is kept
  wall = lambda: (prev_wall if set(results) - fresh else 0.0) + time.perf_counter() - t0  # noqa: E731
  for name, ov in variants.items():
    cfg = layer_config(task, **{**overrides, **ov})
    cfg_d = {k: v for k, v in cfg.to_dict().items() if k in _CONFIG_KEYS}
    have = results.get(name)
    if have is not None and {k: have.get("config", {}).get(k) for k in cfg_d} != cfg_d:
      have = None  # run with another config (e.g. changed defaults): redo, in place
    todo = [s_ for s_ in seed_ids if have is None or s_ not in have["seed_ids"]]
    if not todo:
      print(f"{task}/{name}: seeds {seed_ids} already in {out}, skipped", flush=True)
      continue
    res = train_variant(
      cfg,
      task,
      todo,
      objectives,
      steps=steps,
      batch=batch,
      lr=lr,
      pool=pool,
      n_eval=n_eval,
      chunk=chunk,
      eval_sets=eval_sets,
      desc=f"{task}/{name} seeds {todo[0]}..{todo[-1]}",
    )
    entry = summarise(res, todo, objectives)
    entry["config"] = cfg_d
    if not figure:
      entry.pop("example_maps")
    if have is None:
      fresh.add(name)
    results[name] = entry if have is None else merge_seeds(have, entry, objectives)
    print(f"{task}/{name}: {_line(results[name])}  ({res['train_s']:.0f} s)", flush=True)
    if out:
      _write(out, results, settings, command, wall(), eval_sets, figure)
  if out:
    _write(out, results, settings, command, wall(), eval_sets, figure)
  return {**results, "meta": _meta(settings, command, wall(), eval_sets)}


_CONFIG_KEYS = ("attention", "d_model", "n_heads", "vocab_size", *GATE_OPTIONS, "rope")


def _line(r: dict) -> str:
  parts = []
  for metric in ("target_mass", "coverage"):
    if f"{metric}_1x" in r:
      parts.append(f"{metric} {np.mean(r[f'{metric}_1x']):.3f}/{np.mean(r[f'{metric}_2x']):.3f}")
  return ", ".join(parts) + f", successes {r['successes']}/{r['seeds']}"


def _meta(settings, command, wall_s, eval_sets) -> dict:
  command = command or " ".join(["python -m experiments.live_sets"] + sys.argv[1:])
  return {
    "command": command,
    "commit": _git_commit(),
    "uncommitted": _uncommitted(),
    "settings": settings,
    "config": {
      "d_model": 16,
      "n_heads": 1,
      "gate": "fpa_jax.configs.Config defaults unless overridden",
      "optimizer": f"adam, cosine {settings['lr']} -> 10%",
      "success_threshold": THRESHOLD,
    },
    "wall_s": round(wall_s, 1),
    "machine": _machine(),
    "example_tokens": eval_sets["1x"]["tokens"][0].tolist(),
  }


def _write(out: Path, results, settings, command, wall_s, eval_sets, figure):
  out.parent.mkdir(parents=True, exist_ok=True)
  doc = {**results, "meta": _meta(settings, command, wall_s, eval_sets)}
  out.write_text(json.dumps(doc, indent=1) + "\n")
  out.with_suffix(".md").write_text(markdown(doc))
  if figure:
    plot(doc, out.with_suffix(".png"), eval_sets["1x"]["target"][0])


def _ms(xs) -> str:
  return f"{np.mean(xs):.3f} ± {np.std(xs):.3f}"


def markdown(doc: dict, title: str | None = None) -> str:
  """The results table (mean ± std over seeds, successes/seeds per metric) from a results dict."""
  meta = doc["meta"]
  s = meta["settings"]
  rows = [k for k in doc if k != "meta"]
  lines = [
    title
    or f"`{meta['command']}`: task `{s['task']}`, single head, d_model 16, T={s['train_len']} "
    f"(2x = {2 * s['train_len']}), {s['steps']} Adam steps x batch {s['batch']}, {s['seeds']} seeds, "
    f"{s['n_eval']} held-out examples per length; {meta['machine']}; {meta['wall_s']:.0f} s."
    + (f" Overrides: `{s['overrides']}`." if s["overrides"] else ""),
    "",
  ]
  cols = [(m, L) for m in ("target_mass", "coverage") for L in ("1x", "2x") if any(f"{m}_{L}" in doc[r] for r in rows)]
  objs = [o for o in OBJECTIVES if any(f"successes_{o}" in doc[r] for r in rows)]
  lines.append(
    "| method | "
    + " | ".join([f"{m.replace('target_', '')} {L}" for m, L in cols] + [f"{o} ok" for o in objs])
    + " | successes |"
  )
  lines.append("|---|" + "---:|" * (len(cols) + len(objs) + 1))
  for r in rows:
    d = doc[r]
    cells = []
    for m, L in cols:
      v = d.get(f"{m}_{L}")
      cells.append("—" if v is None else f"{_ms(v)} ({int((np.array(v) >= THRESHOLD).sum())}/{d['seeds']})")
    oks = [f"{d[f'successes_{o}']}/{d['seeds']}" for o in objs]
    lines.append(f"| {r} | " + " | ".join(cells + oks) + f" | **{d['successes']}/{d['seeds']}** |")
  lines += [
    "",
    f"Cells: mean ± std over seeds (seeds ≥ {THRESHOLD} at that length). \"ok\": seeds ≥ {THRESHOLD} "
    "at both 1x and 2x for that head; successes: seeds where every trained head is ok. mass = held-out mean "
    "attention mass on the live set (head trained on -log mass); coverage = 1 - TV to uniform over the "
    "live set (head trained with KL to it).",
    "",
  ]
  return "\n".join(lines)


def plot(doc: dict, path: Path, target_map: np.ndarray):
  """Each method's attention (first seed, coverage head if trained) on one held-out example beside the target.

  target_map: [T, T] bool, the example's live sets; each entry's maps hold its scored rows [rows, T].
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import PowerNorm

  rows = np.flatnonzero(target_map.any(-1))
  u = target_map / np.maximum(target_map.sum(-1, keepdims=True), 1)
  names = [k for k in doc if k != "meta" and doc[k].get("example_maps")]
  panels = [("target (uniform over live set)", u[rows])]
  for n in names:
    maps = doc[n]["example_maps"]
    obj = "coverage" if "coverage" in maps else next(iter(maps))
    panels.append((f"{n} ({obj} head, seed 0)", np.asarray(maps[obj])))
  fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.22 * len(rows) * len(panels)), squeeze=False)
  toks = doc["meta"]["example_tokens"]
  names = token_names(doc["meta"]["settings"]["task"])
  for ax, (title, m) in zip(axes[:, 0], panels):
    ax.imshow(m, aspect="auto", cmap="viridis", norm=PowerNorm(0.5, vmin=0, vmax=1), interpolation="nearest")
    ys, xs = np.nonzero(target_map[rows])
    ax.scatter(xs, ys, s=6, c="red", marker=".", linewidths=0)
    ax.set_title(title, fontsize=8, loc="left")
    ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=5)
    ax.set_xticks(range(len(toks)), [names[t] for t in toks], fontsize=4, rotation=90)
  axes[-1, 0].set_xlabel("key (token at that position); red dots: live set; rows: query positions", fontsize=7)
  fig.suptitle(
    f"{doc['meta']['settings']['task']}: attention of each QUERY row (colour: sqrt of the weight)", fontsize=9
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_ablations(
  *,
  seeds: int = 3,
  steps: int = DEFAULTS["steps"],
  out: str | Path = ROOT / "results" / "ablations_live_sets.json",
  overrides: dict | None = None,
  command: str | None = None,
  **kw,
) -> dict:
  """Study 5 for study 1: every `ABLATIONS` variant on scopes and dips, coverage heads only."""
  out = Path(out)
  doc: dict = {}
  t0 = time.perf_counter()
  for task in TASKS:
    part = out.with_name(f"{out.stem}.{task}.json")  # per-task resume file, removed once `out` is written
    if not part.exists() and out.exists():  # resume from the committed combined file
      prev = json.loads(out.read_text()).get(task)
      if prev is not None:
        part.write_text(json.dumps(prev))
    doc[task] = run(
      task,
      seeds=seeds,
      steps=steps,
      variants=ABLATIONS,
      objectives=("coverage",),
      out=part,
      overrides=overrides,
      figure=False,
      command=command,
      **kw,
    )
  doc["meta"] = {**doc[TASKS[0]]["meta"], "wall_s": round(time.perf_counter() - t0, 1)}
  doc["meta"].pop("example_tokens", None)
  out.write_text(json.dumps(doc, indent=1) + "\n")
  md = [
    f"`{doc['meta']['command']}`: gate ablations on study 1, coverage heads only, {seeds} seeds, {steps} steps, "
    f"{doc['meta']['machine']}, {doc['meta']['wall_s']:.0f} s.",
    "",
  ]
  for task in TASKS:
    md += [f"### {task}", "", markdown(doc[task]).strip(), ""]
  out.with_suffix(".md").write_text("\n".join(md))
  for task in TASKS:  # the per-task parts are only for resuming
    for suffix in (".json", ".md"):
      out.with_name(f"{out.stem}.{task}{suffix}").unlink(missing_ok=True)
  return doc


# ---------------------------------------------------------------------------------------------
# Claims: this study's rows of the README's claims table (`experiments.report` collects them), and
# results/dips_limits.md (what limits FPA on `dips`)


LIVE_KEYS = ("target_mass_1x", "target_mass_2x", "coverage_1x", "coverage_2x")


def live_set_seeds(doc: dict, method: str, thr: float = THRESHOLD) -> dict[int, bool]:
  """{seed: the method's heads reach mass and coverage >= thr at 1x and 2x} of a live-set study."""
  e = doc[method]
  ids = e.get("seed_ids", list(range(e["seeds"])))
  return {s: all(e[k][i] >= thr for k in LIVE_KEYS if k in e) for i, s in enumerate(ids)}


def _dips_variant_runs(root: Path) -> list[tuple[str, dict]]:
  """(variant, its dips.json) of every run under results/dips_limits/ that holds an FPA head."""
  docs = [
    (d.name, U.load_result(root, f"dips_limits/{d.name}/dips"))
    for d in sorted((root / "results" / "dips_limits").glob("*"))
  ]
  return [(name, doc) for name, doc in docs if doc is not None and "fpa" in doc]


def _head_dim_steps(doc: dict, method: str) -> tuple[int, int]:
  cfg = doc[method]["config"]
  return cfg["d_model"] // cfg["n_heads"], doc["meta"]["settings"]["steps"]


def _dips_variants(root: Path) -> str:
  """The `dips` variants run with every method (results/dips_limits/<variant>), as the claim's detail."""
  out = []
  for name, doc in _dips_variant_runs(root):
    ms = [m for m in METHODS if m in doc]
    if len(ms) < 2:
      continue
    hd, steps = _head_dim_steps(doc, "fpa")
    out.append(
      f"with head dim {hd} and {steps} steps (`{name}`): "
      + ", ".join(f"{m} {doc[m]['successes']}/{doc[m]['seeds']}" for m in ms)
    )
  return "".join(f"; {o}" for o in out)


def _dips_variant_short(root: Path) -> str:
  out = []
  for name, doc in _dips_variant_runs(root):
    if "fox" in doc:
      hd, steps = _head_dim_steps(doc, "fpa")
      out.append(f"; head dim {hd}, {steps} steps: fpa {doc['fpa']['successes']}/{doc['fpa']['seeds']}")
  return "".join(out)


def dips_limits_table(root: Path = ROOT) -> str | None:
  """results/dips_limits.md: FPA's coverage on `dips` (what limits it: head dim, steps, ...) under each variant run into
  results/dips_limits/<variant>/dips.json (`python -m experiments.live_sets --task dips --methods fpa
  --seeds 5 ... --out-dir results/dips_limits/<variant>`), beside the study's default row."""
  default, variants = U.load_result(root, "dips"), _dips_variant_runs(root)
  if default is None or "fpa" not in default or not variants:
    return None
  rows = []
  for name, doc in [("default (study 1)", default)] + variants:
    cmd = doc["meta"]["command"].replace("python -m experiments.live_sets ", "")
    # FPA first; the other methods of a variant run too (heads of the same dimension) follow it
    for m in ["fpa"] + [m for m in METHODS if m != "fpa" and m in doc and doc is not default]:
      e = doc[m]
      hd, steps = _head_dim_steps(doc, m)
      rows.append(
        f"| {name} | {m} | `{cmd}` | {hd} | {steps} | {_ms(e['coverage_1x'])} | {_ms(e['coverage_2x'])} | "
        f"{e['successes_coverage']}/{e['seeds']} |"
      )
  head = (
    "FPA's coverage head on `dips` (1 - TV to uniform over the live set; a seed succeeds at >= 0.95 at both "
    "1x and 2x), single head, d_model = head dim:\n\n"
    "| variant | method | command | head dim | steps | coverage 1x | coverage 2x | seeds >= 0.95 |\n"
    "|---|---|---|---:|---:|---:|---:|---:|\n"
  )
  return head + "\n".join(rows) + "\n"


def _live_sets(doc, task: str) -> str:
  if doc is None:
    return f"not run yet (`python -m experiments.live_sets --task {task}`)"
  parts = [f"{m} {doc[m]['successes']}/{doc[m]['seeds']}" for m in U.result_methods(doc) if "successes" in doc[m]]
  return "seeds succeeding (mass and coverage >= 0.95 at 1x and 2x): " + ", ".join(parts)


def _live_row(doc, task: str, variants: str = "") -> tuple[str, str]:
  if doc is None or "fpa" not in doc:
    return "not run", f"`python -m experiments.live_sets --task {task}`"
  fpa = live_set_seeds(doc, "fpa")
  rivals = [live_set_seeds(doc, m) for m in ("fox", "softmax") if m in doc]
  ok = [fpa[s] and not any(r.get(s) for r in rivals) for s in fpa]
  counts = ", ".join(f"{m} {sum(live_set_seeds(doc, m).values())}/{doc[m]['seeds']}" for m in METHODS if m in doc)
  return U.seed_verdict(ok), f"seeds succeeding: {counts}{variants}"


def claim_rows(root: Path = ROOT) -> list[U.ClaimRow]:
  """The live-set claims, judged seed by seed against FoX and softmax: scopes, then dips with its variant runs."""
  scopes, dips = U.load_result(root, "scopes"), U.load_result(root, "dips")
  link = "docs/results/live_sets.md"
  return [
    U.ClaimRow(
      "Single-layer FPA heads learn nested-scope live-key sets where softmax and FoX fail",
      *_live_row(scopes, "scopes"),
      link,
      (
        "Single-layer FPA heads converge to target live-key sets where softmax and FoX fail on every seed "
        "(nested scopes)",
        _live_sets(scopes, "scopes"),
      ),
    ),
    U.ClaimRow(
      "... and the general case (levels per key, dips per token)",
      *_live_row(dips, "dips", _dips_variant_short(root)),
      link,
      (
        "... and on the general case (levels set per key, dips per token)",
        _live_sets(dips, "dips") + _dips_variants(root),
      ),
    ),
  ]


def main(argv=None) -> int:
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--task", default="all", choices=TASKS + ("all",))
  ap.add_argument("--seeds", type=int, default=None, help="default 5 (3 with --ablations)")
  ap.add_argument("--steps", type=int, default=None, help=f"default {DEFAULTS['steps']}")
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--small", action="store_true", help=f"a quick look: {SMALL} (unless given)")
  ap.add_argument("--ablations", action="store_true", help="study 5: gate ablations (coverage, 3 seeds)")
  ap.add_argument(
    "--set",
    dest="sets",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="Config override for every method, e.g. step_init_std=1e-3",
  )
  ap.add_argument("--out-dir", default=str(ROOT / "results"))
  ap.add_argument("--fresh", action="store_true", help="ignore existing results (no resume)")
  args = ap.parse_args(argv)
  kw = dict(SMALL) if args.small else {}
  if args.steps is not None:
    kw["steps"] = args.steps
  overrides = C.parse_overrides(C.Config, args.sets)
  command = " ".join(["python -m experiments.live_sets"] + (sys.argv[1:] if argv is None else list(argv)))
  out_dir = Path(args.out_dir)
  if args.ablations:
    run_ablations(
      seeds=args.seeds or 3,
      out=out_dir / "ablations_live_sets.json",
      overrides=overrides,
      command=command,
      resume=not args.fresh,
      **kw,
    )
    return 0
  methods = tuple(m for m in args.methods.split(",") if m)
  bad = set(methods) - set(C.ATTENTIONS)
  if bad:
    ap.error(f"unknown method(s) {sorted(bad)}; use {C.ATTENTIONS}")
  for task in TASKS if args.task == "all" else (args.task,):
    run(
      task,
      seeds=args.seeds or 5,
      methods=methods,
      out=out_dir / f"{task}.json",
      overrides=overrides,
      resume=not args.fresh,
      command=command,
      **kw,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
