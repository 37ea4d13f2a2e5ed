"""Study 2: passkey retrieval at 1x, 2x, 4x, 8x the training length, per method.

    python -m experiments.passkey                                  # every method, resumable
    python -m experiments.passkey --methods fox softmax            # a subset (results merge)
    python -m experiments.passkey --scale base110m                 # print the accelerator recipe only
    python -m experiments.passkey --methods fpa_fox5_evict         # retrofit the trained fpa_fox5 (below)

Small byte-level LMs (`small` with 2 layers, d_model 128, 4 heads) are trained at length L on a mix
of `fpa_text` rows and `fpa_passkey` train prompts (one prompt per row, the train split's generator
run on the fly), the answer tokens weighted `--answer-weight` times. Each method trains in stages
of `--stage-steps` up to `--max-steps` (constant lr after warmup by default, so rerunning with a larger
`--max-steps` extends a run exactly) and
stops at the first stage whose greedy exact match at 1x on held-out *validation* prompts (other
keys than the test prompts) reaches `--competence`. Then the test prompts
(`fpa_jax.data.passkey_eval_examples`, seed 0: the `fpa_passkey` eval splits) are scored at
1/2/4/8 x L and depths 0/25/50/75/100% by greedy exact match of the whole answer, computed from one
teacher-forced forward pass per prompt with the parallel (chunked) model: greedy decoding
reproduces the answer iff the argmax at every answer position is the answer token.

A retrofit (`RETROFIT`: `fpa_fox5_evict`) does not start from scratch: it continues its source
method's trained run from the source's last checkpoint (optimizer state and data position
included) for `--retrofit-steps` more steps with its own settings, here the evictability objective
with its target ramped from the source's last step, as DMS retrofits a trained model.

Runs use the library trainer, so rerunning the same command resumes from `runs/passkey/...`
checkpoints. Writes results/passkey.{json,md} and results/passkey_<method>.png.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from experiments import _common as U
from experiments import recipes

# Scoring lives in fpa_jax.eval; its names stay importable from here (tests, notebooks).
from fpa_jax.eval import answer_span, argmax_fn, eval_batch, teacher_forced_exact_match  # noqa: F401

MODULE = "experiments.passkey"
# method -> config overrides (on top of the study's model/training settings; `experiments.recipes`)
METHODS = recipes.PASSKEY
# method -> the method whose trained run it continues from its last step, for --retrofit-steps whatever
# the validation says (competence does not end a continuation early).
RETROFIT = {"fpa_fox5_evict": "fpa_fox5", "fpa_fox5_cont": "fpa_fox5"}
FAMILY = recipes.PASSKEY_FAMILY  # method -> its attention family
# the method trained with the LM gate of its time (`recipes.LM_FOX_HEAD`, the LM default before the one-recipe study) at fox_b5's bias
DEFAULT_METHOD = "fpa_lm5_warmc10_fh1"
MULTIPLES = (1, 2, 4, 8)
DEPTHS = (0, 25, 50, 75, 100)


# ------------------------------------------------------------------------------------------------
# Data: fpa_text rows + fpa_passkey prompts, answer tokens weighted
# ------------------------------------------------------------------------------------------------


class PasskeyTextMix:
  """Batches of `batch_size` rows of `seq_len`: `n_passkey` rows hold one passkey train prompt each
  (needle at a random depth, exactly the `fpa_passkey` train generator at `target_len=seq_len`),
  the rest come from the `fpa_text` train pipeline. loss_mask: `prompt_weight` on the prompt's
  next-token pairs, `answer_weight` on the answer targets, 1 on text. Exact `get_state`/`set_state`.
  Batch: inputs/targets/segment_ids int32 [B, L], loss_mask float32 [B, L].
  """

  def __init__(
    self,
    *,
    data_dir: str,
    seq_len: int,
    batch_size: int,
    n_passkey: int,
    answer_weight: float,
    prompt_weight: float = 1.0,
    seed: int = 0,
    small: bool = False,
  ):
    from fpa_jax.data import ByteTokenizer, make_pipeline

    if not 0 <= n_passkey <= batch_size:
      raise ValueError(f"n_passkey={n_passkey} must be in [0, batch_size={batch_size}]")
    self.tok = ByteTokenizer()
    self.vocab_size = self.tok.vocab_size
    self.seq_len, self.batch_size, self.n_passkey, self.seed = seq_len, batch_size, n_passkey, seed
    self.answer_weight, self.prompt_weight = float(answer_weight), float(prompt_weight)
    self.text = (
      make_pipeline(
        "text",
        "train",
        data_dir=data_dir,
        seq_len=seq_len,
        batch_size=batch_size - n_passkey,
        seed=seed,
        small=small,
        process_index=0,
        process_count=1,
      )
      if n_passkey < batch_size
      else None
    )
    self.count = 0  # passkey prompts drawn so far

  def __iter__(self):
    return self

  def prompt_row(self, index: int) -> dict[str, np.ndarray]:
    """Train prompt `index` as one padded row (the fpa_passkey train split's generator, any index)."""
    from fpa_jax.data import passkey
    from fpa_jax.data.builders import example_rng

    rng = example_rng(self.seed, "train", index)
    depth = int(rng.integers(0, 101))
    ex = passkey.make_prompt(self.tok, self.seq_len, depth / 100, passkey.random_key(rng))
    toks, n = ex["tokens"], len(ex["tokens"]) - 1
    ans = passkey.loss_mask(toks, ex["answer_start"], len(self.tok.encode(ex["answer"])))  # [n]
    row = {k: np.zeros(self.seq_len, np.int32) for k in ("inputs", "targets", "segment_ids")}
    row["inputs"][:n], row["targets"][:n], row["segment_ids"][:n] = toks[:-1], toks[1:], 1
    row["loss_mask"] = np.zeros(self.seq_len, np.float32)
    row["loss_mask"][:n] = np.where(ans > 0, self.answer_weight, self.prompt_weight)
    return row

  def __next__(self) -> dict[str, np.ndarray]:
    rows = [self.prompt_row(self.count + i) for i in range(self.n_passkey)]
    self.count += self.n_passkey
    batch = {
      k: np.stack([r[k] for r in rows]) if rows else None for k in ("inputs", "targets", "segment_ids", "loss_mask")
    }
    if self.text is not None:
      t = next(self.text)
      batch = {k: t[k] if batch[k] is None else np.concatenate([batch[k], t[k]]) for k in t}
    return batch

  def get_state(self) -> dict:
    return {"passkey_count": self.count, "text": self.text.get_state() if self.text is not None else None}

  def set_state(self, state: dict) -> None:
    self.count = int(state["passkey_count"])
    if self.text is not None:
      self.text.set_state(state["text"])


# ------------------------------------------------------------------------------------------------
# Greedy exact match from one teacher-forced pass
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens):
  return nnx.merge(graphdef, state)(tokens)


def greedy_decode(model, prompt: np.ndarray, n: int, pad_to: int | None = None) -> np.ndarray:
  """Reference: an explicit greedy loop that re-runs the parallel model on the growing sequence and
  appends the argmax after its last token. prompt int [T] -> n generated tokens int [n] (tests).
  `pad_to`: right-pad every call to this length (one compile; causal, so the last real position's
  logits are unchanged); None runs each length as it is."""
  graphdef, state = nnx.split(model)
  toks = list(map(int, prompt))
  for _ in range(n):
    x = np.zeros((1, pad_to or len(toks)), np.int32)
    x[0, : len(toks)] = toks
    logits = np.asarray(_logits(graphdef, state, x))  # [1, T, V]
    toks.append(int(np.argmax(logits[0, len(toks) - 1])))
  return np.asarray(toks[len(prompt) :], np.int32)


def evaluate(
  model,
  train_len: int,
  *,
  n: int,
  seed: int = 0,
  multiples=MULTIPLES,
  depths=DEPTHS,
  eval_tokens: int = 16384,
  desc: str = "eval",
) -> dict:
  """Greedy exact match per (multiple, depth) cell on `passkey_eval_examples(train_len, m, d, n, seed)`
  (`fpa_jax.eval.passkey_eval`, teacher-forced on the parallel model).

  -> {"1": acc, ..., "by_depth": {"1": {"0": acc, ...}, ...}, "ci95": {"1": [lo, hi], ...}} (95% Wilson
  interval of each length's accuracy over its depths); rows are batched up to `eval_tokens` tokens.
  """
  from fpa_jax.eval import passkey_eval

  r = passkey_eval(
    model, train_len, multiples=multiples, depths=depths, n=n, seed=seed, eval_tokens=eval_tokens, desc=desc
  )
  by_depth = {m: {d: c["accuracy"] for d, c in cells.items()} for m, cells in r["cells"].items()}
  out = {m: float(np.mean(list(accs.values()))) for m, accs in by_depth.items()}
  out["by_depth"] = by_depth
  out["ci95"] = {m: r["by_length"][m]["ci95"] for m in by_depth}
  return out


# ------------------------------------------------------------------------------------------------
# Training to competence
# ------------------------------------------------------------------------------------------------


def study_config(method: str, args, steps: int, cooldown: int = 0, ramp_start: int = 0):
  """The trainer config of `method` trained to `steps` (the cosine horizon: --max-steps), the last
  `cooldown` of them cooling down; an objective's ramp starts at `ramp_start`."""
  run = U.study_run(
    args,
    task="passkey",
    steps=steps,
    seed=args.seed,
    lr_decay_steps=args.max_steps,
    min_lr_ratio=args.min_lr_ratio,
    cooldown_steps=cooldown,
  )
  recipe = METHODS[method]
  if "evict_weight" in recipe:
    recipe = {**recipe, "evict_ramp_start": ramp_start}
  return U.study_config(U.study_model(args), run, recipe)


def recipe(args) -> dict:
  return {
    "train_length": args.train_len,
    "layers": args.layers,
    "d_model": args.d_model,
    "heads": args.heads,
    "batch_size": args.batch_size,
    "passkey_rows": args.passkey_rows,
    "answer_weight": args.answer_weight,
    "prompt_weight": args.prompt_weight,
    "lr": args.lr,
    "min_lr_ratio": args.min_lr_ratio,
    "warmup": args.warmup,
    "max_steps": args.max_steps,
    "stage_steps": args.stage_steps,
    "competence": args.competence,
    "n_val": args.n_val,
    "seed": args.seed,
  }


def run_tag(args) -> str:
  return args.tag or (
    f"L{args.train_len}_l{args.layers}d{args.d_model}_b{args.batch_size}p{args.passkey_rows}"
    f"_w{args.answer_weight:g}_pw{args.prompt_weight:g}_lr{args.lr:g}_m{args.min_lr_ratio:g}_s{args.seed}"
  )


def train_to_competence(method: str, args, log) -> dict:
  """Train in stages until the 1x validation exact match reaches `args.competence` (or max_steps)."""
  from fpa_jax.data import passkey_eval_examples

  workdir = os.path.join(args.runs_dir, run_tag(args), method)
  val_path = Path(workdir) / "study_val.json"
  val = U.read_json(val_path, {})  # step -> validation accuracy (cached across sessions)
  # Validation prompts: other keys than the test prompts (seed 0), depths spread over 0-100%.
  per = max(1, args.n_val // len(DEPTHS))
  val_exs = [e for d in DEPTHS for e in passkey_eval_examples(args.train_len, 1, d, n=per, seed=1000 + args.seed)]

  def validate(model) -> dict:  # greedy exact match / digit accuracy at 1x, as the 1x test
    from fpa_jax.eval import passkey_cell

    c = passkey_cell(model, val_exs, length=args.train_len, batch_size=eval_batch(args.train_len, args.n_eval))
    return {"exact": float(c["accuracy"]), "digit": float(c["digit_accuracy"])}

  start = seed_retrofit(method, args, workdir) if method in RETROFIT else 0
  max_steps = start + args.retrofit_steps if method in RETROFIT else args.max_steps
  steps, out = start, None
  while steps < max_steps:
    steps = min(steps + args.stage_steps, max_steps)
    if str(steps) in val and (val[str(steps)]["exact"] < args.competence or method in RETROFIT) and steps < max_steps:
      continue  # a stage an earlier session finished and scored: go straight on to the next one
    cfg = study_config(method, args, steps, ramp_start=start)
    data = PasskeyTextMix(
      data_dir=args.data_dir,
      seq_len=args.train_len,
      batch_size=args.batch_size,
      n_passkey=args.passkey_rows,
      answer_weight=args.answer_weight,
      prompt_weight=args.prompt_weight,
      seed=args.seed,
      small=args.small_data,
    )
    out = U.train_lm(cfg, workdir, data)
    if str(steps) not in val:
      val[str(steps)] = validate(out["model"])
      U.write_json(val_path, val)
    last = out["history"][-1]["loss"] if out["history"] else None
    log(
      f"[passkey] {method}: step {steps}, val 1x exact match {val[str(steps)]['exact']:.3f} (digits "
      f"{val[str(steps)]['digit']:.3f}), train wall {out['train_wall_s']:.0f} s"
      + (f", last loss {last:.3f}" if last is not None else "")
    )
    if val[str(steps)]["exact"] >= args.competence and method not in RETROFIT:
      break
  if args.cooldown_steps:  # one more stage whose lr decays linearly to 0 (WSD): anneal the constant-lr run
    steps, out = (
      steps + args.cooldown_steps,
      U.train_lm(study_config(method, args, steps + args.cooldown_steps, args.cooldown_steps), workdir, data),
    )
    if str(steps) not in val:
      val[str(steps)] = {**validate(out["model"]), "cooldown": args.cooldown_steps}
      U.write_json(val_path, val)
    log(f"[passkey] {method}: cooldown to step {steps}, val 1x exact match {val[str(steps)]['exact']:.3f}")
  return {
    "model": out["model"],
    "steps": steps,
    "workdir": workdir,
    "train_wall_s": out["train_wall_s"],
    "val_history": {int(k): v for k, v in sorted(val.items(), key=lambda kv: int(kv[0])) if int(k) <= steps},
    "competent_1x": val[str(steps)]["exact"] >= args.competence,
    "competence": args.competence,
    "cooldown_steps": args.cooldown_steps,
    "config": out["init_config"],
    "sessions": out["sessions"],
    **({"retrofit_of": RETROFIT[method], "retrofit_from_step": start} if method in RETROFIT else {}),
  }


def seed_retrofit(method: str, args, workdir: str) -> int:
  """Start `method`'s run from the last checkpoint of the run it retrofits (`RETROFIT`), once:
  copies that step's checkpoint into `workdir` (the trainer resumes from it, optimizer state and
  data position included). -> the source's final step, where the continuation starts."""
  import shutil

  src = RETROFIT[method]
  done = U.read_json(Path(args.out_dir) / "passkey.json", {}).get(src)
  if not done or "steps" not in done:
    raise SystemExit(
      f"{method} continues {src}'s trained run: train it first (python -m {MODULE} --methods {src} ...), "
      f"then rerun with --methods {method}"
    )
  start = int(done["steps"])
  ckpt = Path(workdir) / "checkpoints"
  if ckpt.exists():  # seeded in an earlier session: it continues from where it was seeded
    return int(U.read_json(Path(workdir) / "study_init_config.json", {}).get("evict_ramp_start", start))
  src_step = Path(args.runs_dir) / run_tag(args) / src / "checkpoints" / str(start)
  if not src_step.is_dir():
    raise SystemExit(f"{src}'s checkpoint of step {start} is missing ({src_step}): retrain {src}")
  os.makedirs(ckpt)
  shutil.copytree(src_step, ckpt / str(start))
  U.write_json(Path(workdir) / "study_init_config.json", study_config(method, args, start, ramp_start=start).to_dict())
  return start


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


def write_outputs(res: dict, out_dir: Path) -> None:
  U.write_json(out_dir / "passkey.json", res)
  (out_dir / "passkey.md").write_text(markdown(res))
  for method in (m for m in res if m in METHODS):
    heatmap(res, method, out_dir / f"passkey_{method}.png")


def markdown(res: dict) -> str:
  L = res["train_length"]
  methods = [m for m in METHODS if m in res]
  r = res.get("recipe", {})
  comps = [res[m].get("competence", r.get("competence")) for m in methods]
  base_comp = max(set(comps), key=comps.count) if comps else r.get("competence")
  head = (
    f"`python -m {MODULE}` (each method's exact command and commit are in passkey.json): byte LMs ({r.get('layers')} layers, d_model {r.get('d_model')}, "
    f"{r.get('heads')} heads) trained at L={L}, batch {r.get('batch_size')} rows ({r.get('passkey_rows')} passkey "
    f"prompts + text), answer tokens weighted x{r.get('answer_weight')}, lr {r.get('lr')} (end ratio "
    f"{r.get('min_lr_ratio')}); trained in stages of "
    f"{r.get('stage_steps')} steps until validation exact match at 1x >= {base_comp} (unless noted) or "
    f"each method's max_steps (in passkey.json). Test: greedy exact match, {res.get('n_eval')} prompts per (length, depth) cell, "
    f"seed {r.get('seed')}, {res['meta']['machine']['cpu_count']} CPU cores. \"train min\" is wall time on a "
    f"shared machine (load average {res['meta'].get('load_avg_1_5_15min', ['?'])[-1]} at the end).\n\n"
  )
  rows = []
  for m in methods:
    e = res[m]
    rows.append(
      [
        m,
        e["steps"],
        f"{e['train_wall_s'] / 60:.1f}",
        ("yes" if e["competent_1x"] else "**no**")
        + (f" (>= {e['competence']:g})" if e.get("competence", base_comp) != base_comp else ""),
        *[_f(e[str(k)]) for k in MULTIPLES],
        "shuffled windows" if e.get("text_rows") == "windows" else "*one file at a time (before the fix)*",
      ]
    )
  table = U.md_table(
    ["method", "steps", "train min", "competent at 1x", *[f"{k}x ({k * L})" for k in MULTIPLES], "text rows"], rows
  )
  fam = {}
  for m in methods:  # best of each family by the mean over lengths
    f = FAMILY[m]
    if f not in fam or _mean_acc(res[m]) > _mean_acc(res[fam[f]]):
      fam[f] = m
  best = (
    "Best of each family (mean over lengths): "
    + ", ".join(f"{f}: `{m}` (8x {_f(res[m]['8'])})" for f, m in fam.items())
    + ".\n"
  )
  for m in methods:  # a retrofit's steps count from its source's start; its train min is its own
    if res[m].get("retrofit_of"):
      src = res[m]["retrofit_of"]
      own = ", ".join(f"{k}={v}" for k, v in METHODS[m].items() if METHODS[src].get(k) != v) or "none: a control"
      best += (
        f"\n`{m}` is `{src}` continued from step {res[m]['retrofit_from_step']} with its own settings "
        f"(`RETROFIT`; {own}); its train min is the continuation's.\n"
      )
  depth_rows = [
    [m, f"{k}x", *[_f(res[m]["by_depth"][str(k)][str(d)]) for d in DEPTHS]] for m in methods for k in MULTIPLES
  ]
  depth = U.md_table(["method", "length", *[f"depth {d}%" for d in DEPTHS]], depth_rows, "ll" + "r" * len(DEPTHS))
  stages = U.md_table(
    ["method", "validation exact match / digit accuracy at 1x after each stage (steps: exact / digits)"],
    [
      [
        m,
        ", ".join(
          f"{k}{' (lr cooled to 0)' if v.get('cooldown') else ''}: {v['exact']:.2f} / {v['digit']:.2f}"
          for k, v in res[m]["val_history"].items()
        ),
      ]
      for m in methods
      if res[m].get("val_history")
    ],
    "ll",
  )
  if any(res[m].get("text_rows") != "windows" for m in methods):
    note_rows = (
      "\nRows whose text rows came one file at a time were trained before the text pipeline shuffled windows "
      "over the whole train split; "
      "the whole pre-fix file is kept in `results/correlated_batches/passkey.md`.\n"
    )
  else:
    note_rows = ""
  note = note_rows + (
    "\nA method not competent at 1x has no retrieval to extrapolate: its longer-length numbers say nothing "
    "about extrapolation.\n"
    if not all(res[m]["competent_1x"] for m in methods)
    else ""
  )
  return (
    head
    + table
    + "\n"
    + best
    + note
    + "\nWhat it took (train to competence):\n\n"
    + stages
    + "\n<details><summary>by depth</summary>\n\n"
    + depth
    + "\n</details>\n"
  )


def _f(x) -> str:
  return "—" if x is None else f"{x:.2f}"


def _mean_acc(e: dict) -> float:
  return float(np.mean([e[str(k)] for k in MULTIPLES if e[str(k)] is not None]))


def heatmap(res: dict, method: str, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  L, e = res["train_length"], res[method]
  a = np.array(
    [
      [np.nan if e["by_depth"][str(k)][str(d)] is None else e["by_depth"][str(k)][str(d)] for k in MULTIPLES]
      for d in DEPTHS
    ]
  )  # [depth, multiple]
  fig, ax = plt.subplots(figsize=(4.2, 3.4))
  im = ax.imshow(a, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
  for i in range(len(DEPTHS)):
    for j in range(len(MULTIPLES)):
      ax.text(j, i, f"{a[i, j]:.2f}", ha="center", va="center", fontsize=8)
  ax.set_xticks(range(len(MULTIPLES)), [f"{k}x\n{k * L}" for k in MULTIPLES])
  ax.set_yticks(range(len(DEPTHS)), [f"{d}%" for d in DEPTHS])
  ax.set_xlabel("prompt length (x train length)")
  ax.set_ylabel("needle depth")
  ax.set_title(f"passkey exact match: {method} ({e['steps']} steps)", fontsize=9)
  fig.colorbar(im, ax=ax, fraction=0.046)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ------------------------------------------------------------------------------------------------
# The accelerator recipe (documented, not run)
# ------------------------------------------------------------------------------------------------


def base110m_recipe() -> str:
  from fpa_jax.configs import get_config
  from fpa_jax.models import abstract_model, count_params

  cfg = get_config("base110m", vocab_size=259, tokenizer="bytes")
  n = count_params(abstract_model(cfg))
  L, batch, steps, devices, peak, mfu = cfg.seq_len, 256, 8000, 8, 989e12, 0.35
  tokens = batch * L * steps
  flops = 6 * n * tokens + 6 * cfg.n_layers * cfg.d_model * L * tokens  # params + causal attention (fwd+bwd)
  hours = flops / (devices * peak * mfu) / 3600
  methods = " ".join(METHODS)
  return f"""passkey study at the paper's scale (NOT run here: it needs accelerators)

model    : base110m ({n / 1e6:.0f}M params with a byte vocabulary; d_model {cfg.d_model}, {cfg.n_layers} layers,
           {cfg.n_heads} heads), bf16 compute, fp32 params; train length L = {L}; eval at 1/2/4/8 x L = up to {8 * L} tokens
mesh     : --mesh data={devices},model=1 (8 x H100/H200-class, or a v5p-16 slice; data parallel is enough at 110M)
batch    : {batch} rows x {L} = {batch * L / 1e6:.2f}M tokens/step, 64 rows of them passkey prompts, answer weight 10
steps    : {steps} (lr 2e-3, warmup 1000, cosine), stages of 1000 with the 1x competence check
tokens   : {tokens / 1e9:.1f}B;  ~{flops:.2e} FLOPs
expected : ~{hours:.1f} h per method at {mfu:.0%} MFU of {peak / 1e12:.0f} TFLOP/s bf16 x {devices} devices
           ({len(METHODS)} methods: ~{hours * len(METHODS):.0f} h); eval 20 prompts x 20 cells: minutes
command  :
  for m in {methods}; do
    python -m experiments.passkey --methods $m --train-len {L} --layers {cfg.n_layers} --d-model {cfg.d_model} \\
        --heads {cfg.n_heads} --batch-size {batch} --passkey-rows 64 --answer-weight 10 --lr 2e-3 --warmup 1000 \\
        --max-steps {steps} --stage-steps 1000 --block-size 256 --runs-dir runs/passkey_base110m
  done
  (add `--set dtype=bfloat16` style overrides via fpa_jax.configs if you script it; multi-host: one process
   per host, fpa_jax.sharding.maybe_initialize_distributed)
"""


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Claims: this study's rows of the README's claims table (`experiments.report` collects them)
# ------------------------------------------------------------------------------------------------


def _passkey(doc) -> str:
  if doc is None:
    return "not run yet (`python -m experiments.passkey`)"
  ms = [m for m in U.result_methods(doc) if doc[m].get("8") is not None]
  mark = lambda m: "" if doc[m].get("text_rows") == "windows" else "*"  # noqa: E731
  ok = [
    f"{m}{mark(m)} {doc[m]['8']:.2f} (1x {doc[m]['1']:.2f}, {doc[m]['steps']} steps)"
    for m in ms
    if doc[m].get("competent_1x")
  ]
  no = [m + mark(m) for m in ms if not doc[m].get("competent_1x")]
  return (
    f"exact match at 8x L={doc['train_length']} of the models competent at 1x: "
    + ", ".join(ok)
    + (f"; not competent at 1x within their step budget (no retrieval to extrapolate): {', '.join(no)}" if no else "")
    + (f"; \\* {U.STALE_TEXT.strip(' *()')}" if any(mark(m) for m in ms) else "")
  )


SHARED_INIT = ", FPA's other weights drawn as FoX's (the read-outs' side stream)"


def _passkey_seed(doc, label: str = "") -> str:
  """Another seed's steps to competence (does the LM gate learn retrieval as fast as FoX?);
  `label` says what differs from the main study's runs besides the seed."""
  if doc is None or not U.result_methods(doc):
    return ""
  seed = doc["meta"].get("seeds", ["?"])[0]
  parts = []
  for m in (m for m in U.result_methods(doc) if "steps" in doc[m]):
    e = doc[m]
    hist = e.get("val_history") or {}
    last = hist[max(hist, key=int)]["exact"] if hist else None
    parts.append(
      f"{m} competent at {e['steps']} steps"
      if e.get("competent_1x")
      else f"{m} not competent in {e['steps']}" + ("" if last is None else f" ({last:.2f})")
    )
  return f". Seed {seed}{label} (competent: validation exact match >= 0.99): " + ", ".join(parts)


PACE_FOX = "fox_b5"  # FoX has no read-outs: its runs are the same model before and after the side stream


def _passkey_pace_docs(root: Path) -> list[tuple[int, bool, dict]]:
  """(seed, shared init, passkey.json) of every passkey run of the study's recipe: results/passkey
  and passkey_seed1 (FPA rows there predate the read-outs' side stream), passkey_shared_init*."""
  out = []
  for d in sorted((root / "results").glob("passkey*/passkey.json")) + [root / "results" / "passkey.json"]:
    doc = U.read_json(d)
    if doc and doc.get("recipe", {}).get("tag", "").startswith("L512_l2d128_b8p6_w100_pw1_lr0.002_m1_s"):
      out.append((int(doc["recipe"]["seed"]), "shared_init" in str(d.parent), doc))
  return out


def passkey_pace(root: Path = U.ROOT) -> dict | None:
  """Steps to passkey competence by seed (does the LM default learn retrieval as fast as FoX?): FoX
  from any of the study's runs, FPA methods from the shared-init runs only (their other weights are
  FoX's of the same seed). {method: {seed: (first competent stage step or None,
  [(step, validation exact match)])}}."""
  runs: dict[str, dict[int, tuple]] = {}
  for seed, shared, doc in _passkey_pace_docs(root):
    thr = doc["recipe"]["competence"]
    for m in U.result_methods(doc):
      if m != PACE_FOX and not (shared and m.startswith("fpa_lm5")):
        continue
      if "val_history" in doc[m]:
        hist = sorted((int(k), v["exact"]) for k, v in doc[m]["val_history"].items())
        runs.setdefault(m, {})[seed] = (next((s for s, x in hist if x >= thr), None), hist)
  return runs if PACE_FOX in runs and len(runs) > 1 else None


def passkey_pace_table(root: Path = U.ROOT) -> str | None:
  """results/passkey_pace.md: the steps each method took to passkey competence, per seed, beside
  FoX's on the same seed (the curves: `pace_plot`)."""
  runs = passkey_pace(root)
  if runs is None:
    return None
  seeds = sorted({s for r in runs.values() for s in r})
  fox = runs[PACE_FOX]

  def cell(r):
    if r is None:
      return "—"
    best = max(r[1], key=lambda h: h[1])
    return f"{r[0]}" if r[0] is not None else f"not in {r[1][-1][0]} (best {best[1]:.3f} at {best[0]})"

  horizon, means = pace_means(runs)
  rows = []
  for m in [PACE_FOX] + sorted(m for m in runs if m != PACE_FOX):
    paired = [s for s in runs[m] if s in fox]
    if m == PACE_FOX:
      verdict, mean_x = "—", f"{means[m][0]:.3f}"
    else:  # a seed counts when FPA is competent no later than FoX on it (FoX not competent: FPA competent)
      ok = [s for s in paired if runs[m][s][0] is not None and (fox[s][0] is None or runs[m][s][0] <= fox[s][0])]
      verdict = f"{len(ok)}/{len(paired)}"
      mean_x = f"{means[m][0]:.3f} ({means[m][1]:+.3f})"
    rows.append([f"`{m}`"] + [cell(runs[m].get(s)) for s in seeds] + [verdict, mean_x])
  head = (
    "Passkey (`python -m experiments.passkey`, L=512): the first stage (every 300 steps) whose 1x validation "
    "exact match (40 prompts) reaches the study's competence (0.99), per seed; not in N (best x at s): never "
    "within the N steps trained (its best validation x at step s). FPA rows come from the shared-init runs "
    "(`results/passkey_shared_init*`, FPA's other weights are FoX's of the same seed); fox_b5 from every run "
    "of the recipe. \"<= FoX's steps\" counts the seeds where the method was competent no later than FoX. "
    f"The last column is a measure less noisy than one crossing: the 1x validation exact match averaged over "
    f"the stages up to step {horizon} (a run that stopped at competence keeps its last value), mean over the "
    "method's seeds, and in brackets its mean difference from FoX's on the same seeds. "
    "Validation curves: `results/passkey_pace.png`.\n\n"
  )
  heads = ["method"] + [f"seed {s}" for s in seeds] + ["<= FoX's steps", f"mean val. 1x to {horizon} (vs FoX)"]
  return head + U.md_table(heads, rows)


def pace_means(runs: dict) -> tuple[int, dict[str, tuple[float, float]]]:
  """(horizon, {method: (mean over its seeds of `pace_area`, mean paired difference from FoX's)}) of
  `passkey_pace`'s runs; the horizon is FoX's longest run, the stage its first validation step."""
  fox = runs[PACE_FOX]
  horizon = max(r[1][-1][0] for r in fox.values())
  stage = min(r[1][0][0] for r in fox.values())
  out = {}
  for m, r in runs.items():
    area = {s: pace_area(h, horizon, stage) for s, (_, h) in r.items()}
    paired = [area[s] - pace_area(fox[s][1], horizon, stage) for s in area if s in fox]
    out[m] = (float(np.mean(list(area.values()))), float(np.mean(paired)) if paired else float("nan"))
  return horizon, out


def pace_area(hist: list[tuple[int, float]], horizon: int, stage: int) -> float:
  """Mean validation exact match over the stages stage, 2 stage, ..., horizon of one run's [(step, x)];
  a stage past the run's last keeps its last value (a run stops at competence), one before its first is 0."""
  d, last, xs = dict(hist), 0.0, []
  for s in range(stage, horizon + 1, stage):
    last = d.get(s, last)
    xs.append(last)
  return float(np.mean(xs))


def _pace_claim(root: Path) -> str:
  """The claim's part from `passkey_pace`: steps to 1x competence by seed, FoX beside each FPA recipe."""
  runs = passkey_pace(root)
  if runs is None:
    return ""
  seeds = sorted({s for r in runs.values() for s in r})
  step = lambda m, s: "—" if s not in runs[m] else str(runs[m][s][0] or "no")  # noqa: E731
  horizon, means = pace_means(runs)
  parts = []
  for m in [PACE_FOX] + sorted(set(runs) - {PACE_FOX}):
    gap = "" if m == PACE_FOX else f", {means[m][1]:+.3f} vs FoX"
    parts.append(f"{m} {'/'.join(step(m, s) for s in seeds)} ({means[m][0]:.3f}{gap})")
  return (
    f". Steps to 1x competence by seed {'/'.join(map(str, seeds))}{SHARED_INIT} (no: not within the steps trained; "
    f"in brackets the 1x validation exact match averaged over the stages to step {horizon} and seeds, and its "
    f"paired difference from FoX's; `results/passkey_pace.md`): " + ", ".join(parts)
  )


def pace_plot(path: Path, root: Path = U.ROOT) -> None:
  """results/passkey_pace.png: 1x validation exact match by stage, one panel per seed."""
  runs = passkey_pace(root)
  if runs is None:
    return
  seeds = sorted({s for r in runs.values() for s in r})
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(seeds), figsize=(3.2 * len(seeds) + 1.6, 2.8), sharey=True, squeeze=False)
  methods = [PACE_FOX] + sorted(m for m in runs if m != PACE_FOX)
  colors = {m: "k" if m == PACE_FOX else plt.cm.tab10(i % 10) for i, m in enumerate(methods)}  # one per method
  for ax, s in zip(axes[0], seeds):
    for m in (m for m in methods if s in runs[m]):
      hist = runs[m][s][1]
      lw = 2.2 if m == PACE_FOX else 1.2
      ax.plot([h[0] for h in hist], [h[1] for h in hist], marker=".", color=colors[m], lw=lw, label=m)
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.set_title(f"seed {s}", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
  axes[0][0].set_ylabel("1x validation exact match", fontsize=8)
  handles = [plt.Line2D([], [], color=colors[m], lw=2.2 if m == PACE_FOX else 1.2, marker=".") for m in methods]
  fig.legend(handles, methods, fontsize=7, loc="center right")
  fig.tight_layout(rect=(0, 0, 1 - 1.6 / (3.2 * len(seeds) + 1.6), 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def passkey_seeds(root: Path = U.ROOT, method: str | None = None) -> dict[int, bool]:
  """{seed: the LM default competent at 1x (validation >= the study's bar) no later than FoX of the
  same seed (or within FoX's steps where FoX never got there), and >= 0.99 at 8x on the test prompts}."""
  method = method or DEFAULT_METHOD
  runs = passkey_pace(root)
  if runs is None or method not in runs:
    return {}
  x8 = {s: doc[method].get("8") for s, shared, doc in _passkey_pace_docs(root) if shared and method in doc}
  fox, out = runs[PACE_FOX], {}
  for s, (first, _) in sorted(runs[method].items()):
    if s in fox:
      budget = fox[s][0] if fox[s][0] is not None else fox[s][1][-1][0]
      out[s] = first is not None and first <= budget and (x8.get(s) or 0) >= 0.99
  return out


def _passkey_row(root: Path) -> tuple[str, str]:
  method = DEFAULT_METHOD
  runs, ok = passkey_pace(root), passkey_seeds(root, method)
  if not ok:
    return "not run", "`python -m experiments.passkey`"
  step = lambda m, s: str(runs[m][s][0] or "no")  # noqa: E731
  seeds = sorted(ok)
  return U.seed_verdict(list(ok.values())), (
    f"steps to 1x competence by seed {'/'.join(map(str, seeds))}: `{method}` (the LM default) "
    f"{'/'.join(step(method, s) for s in seeds)}, FoX {'/'.join(step(PACE_FOX, s) for s in seeds)}"
  )


def claim_rows(root: Path = U.ROOT) -> list[U.ClaimRow]:
  """The passkey claim, judged seed by seed (`passkey_seeds`), with everything the runs measured for it."""
  detail = (
    _passkey(U.load_result(root, "passkey"))
    + _passkey_seed(U.load_result(root, "passkey_seed1/passkey"))
    + _pace_claim(root)
  )
  return [
    U.ClaimRow(
      "The LM default learns passkey retrieval as fast as FoX and keeps it at 8x the training length",
      *_passkey_row(root),
      "docs/results/passkey.md",
      ("A 110M model retrieves a passkey perfectly at 8x its training length, the only one of the methods", detail),
    )
  ]


def parse_args(argv=None):
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument(
    "--methods",
    nargs="+",
    default=list(METHODS),
    choices=list(METHODS),
    help="fox = FoX paper init (gate bias 0), fox_b5 = weak-decay init (bias 5), *_fox5 = fpa/stack started at fox_b5",
  )
  ap.add_argument(
    "--scale",
    choices=["cpu", "base110m"],
    default="cpu",
    help="base110m: print the accelerator recipe (mesh, batch, steps, time) and exit",
  )
  ap.add_argument("--train-len", type=int, default=512)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--block-size", type=int, default=64)
  ap.add_argument("--batch-size", type=int, default=8)
  ap.add_argument("--passkey-rows", type=int, default=6, help="passkey prompts per batch (the rest: fpa_text rows)")
  ap.add_argument("--answer-weight", type=float, default=100.0)
  ap.add_argument("--prompt-weight", type=float, default=1.0, help="loss weight of the prompt's own next tokens")
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--warmup", type=int, default=50)
  ap.add_argument(
    "--min-lr-ratio",
    type=float,
    default=1.0,
    help="cosine end lr / lr; 1 (default) = constant lr after warmup, so a run extends exactly",
  )
  ap.add_argument("--max-steps", type=int, default=1500, help="also the cosine horizon (moot at --min-lr-ratio 1)")
  ap.add_argument("--stage-steps", type=int, default=300)
  ap.add_argument(
    "--retrofit-steps", type=int, default=600, help=f"steps a retrofit ({', '.join(RETROFIT)}) continues its source run"
  )
  ap.add_argument("--ckpt-every", type=int, default=100)
  ap.add_argument("--competence", type=float, default=0.9, help="1x validation exact match that ends training")
  ap.add_argument(
    "--cooldown-steps",
    type=int,
    default=0,
    help="after the last stage, this many more steps with the lr decaying linearly to 0 (WSD)",
  )
  ap.add_argument("--n-val", type=int, default=40, help="validation prompts at 1x (spread over depths)")
  ap.add_argument("--n-eval", type=int, default=20, help="test prompts per (length, depth) cell")
  ap.add_argument("--multiples", type=int, nargs="+", default=list(MULTIPLES))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--data-dir", default="data")
  ap.add_argument("--small-data", action="store_true", help="small fpa_text build (smoke tests)")
  ap.add_argument("--runs-dir", default="runs/passkey")
  ap.add_argument("--tag", default="", help="workdir name under --runs-dir (default: from the recipe)")
  ap.add_argument("--out-dir", default="results")
  ap.add_argument("--report-only", action="store_true", help="re-render the .md/.png from the JSON, train nothing")
  return ap.parse_args(argv)


def main(argv=None) -> dict | None:
  args = parse_args(argv)
  if args.scale == "base110m":
    print(base110m_recipe())
    return None
  if args.report_only:
    res = U.read_json(Path(args.out_dir) / "passkey.json")
    if res is None:
      raise SystemExit(f"{args.out_dir}/passkey.json not found: run python -m {MODULE} first")
    for m in (m for m in METHODS if m in res):  # the config each run started with (see _common.init_config)
      res[m]["config"] = U.init_config(res[m]["workdir"], res[m].get("config"))
    write_outputs(res, Path(args.out_dir))
    return res
  log = lambda s: print(s, file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  out_dir = Path(args.out_dir)
  res = U.read_json(out_dir / "passkey.json", {})
  if res.get("train_length") != args.train_len or res.get("recipe", {}).get("tag") != run_tag(args):
    res = {}  # another study's results: start over rather than mix recipes
  res.update({"train_length": args.train_len, "recipe": {**recipe(args), "tag": run_tag(args)}, "n_eval": args.n_eval})
  for method in args.methods:
    tm = time.perf_counter()
    tr = train_to_competence(method, args, log)
    te = time.perf_counter()
    ev = evaluate(tr.pop("model"), args.train_len, n=args.n_eval, multiples=tuple(args.multiples), desc=method)
    for k in MULTIPLES:  # cells not evaluated (a --multiples subset) are recorded as None
      ev.setdefault(str(k), None)
      ev["by_depth"].setdefault(str(k), {str(d): None for d in DEPTHS})
    res[method] = {
      **ev,
      **tr,
      "max_steps": args.max_steps,
      "eval_wall_s": round(time.perf_counter() - te, 1),
      "wall_s": round(time.perf_counter() - tm, 1),
      "command": U.command(MODULE, argv),
      "commit": U.git_commit(),
      "text_rows": "windows",  # its fpa_text rows are windows shuffled over the train split; older entries lack this
    }
    log(f"[passkey] {method}: " + ", ".join(f"{k}x {ev[str(k)]}" for k in args.multiples))
    res["meta"] = U.run_meta(
      MODULE, argv, wall_s=time.perf_counter() - t0, seeds=[args.seed], methods_this_run=args.methods
    )
    disk = U.read_json(out_dir / "passkey.json", {})  # merge: another invocation may have added methods
    if disk.get("recipe", {}).get("tag") == run_tag(args):
      res = {**disk, **{k: v for k, v in res.items() if k not in METHODS or k in args.methods}}
    write_outputs(res, out_dir)  # after every method: a killed study keeps what it finished
  return res


if __name__ == "__main__":
  main()
