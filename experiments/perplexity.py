"""Study 4: held-out bits per byte and loss by position out to 8x the training length.

    python -m experiments.perplexity                              # fpa, stack, fox, softmax x 3 seeds
    python -m experiments.perplexity --methods fox softmax        # a subset (results merge)
    python -m experiments.perplexity --scale base110m             # print the accelerator recipe only

Byte LMs trained identically on `fpa_text` (`small` with 2 layers, d_model 128, 4 heads, L=256,
AdamW warmup + cosine) with the library trainer (rerunning resumes from `runs/perplexity/...`).
Held-out bits per byte: the fixed held-out set of `--heldout-windows` windows of length L spread
over every `fpa_text` validation document (`fpa_jax.data.make_heldout`: one window inside each
document, the rest by length; EOS targets excluded), the same bytes for every run; its coverage
(documents, bytes) is in the results file. Training rows are windows shuffled over the whole train
split; results trained before that (each batch from one file, correlated batches) are kept under
`results/correlated_batches/`. Loss by position: held-out validation documents of at least 8L + 1 bytes,
each read from its start in one parallel (chunked) forward pass of 8L tokens, NLL averaged over
documents in position buckets. Writes results/perplexity.{json,md,png}.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments import recipes

MODULE = "experiments.perplexity"
# method -> config overrides (on top of the study's model/training settings; `experiments.recipes`)
METHODS = recipes.PERPLEXITY
# the row trained with the LM gate of its time (`recipes.LM_FOX_HEAD`, the LM default before the one-recipe study)
DEFAULT_ROW = "fpa_lm_warmc10_fh1"
LN2 = math.log(2.0)


def study_config(method: str, args, seed: int, overrides: dict | None = None):
  """The study's run config of `method` (or of explicit `overrides` of the same recipe)."""
  run = U.study_run(args, task="text", steps=args.steps, seed=seed, min_lr_ratio=0.1)
  return U.study_config(U.study_model(args), run, METHODS[method] if overrides is None else overrides)


def recipe_of(args, tag: str) -> dict:
  """The recipe fields a results file records (`add_recipe_args`' model and training settings)."""
  return {
    "tag": tag,
    "train_length": args.train_len,
    "layers": args.layers,
    "d_model": args.d_model,
    "heads": args.heads,
    "batch_size": args.batch_size,
    "steps": args.steps,
    "lr": args.lr,
    "warmup": args.warmup,
  }


def run_tag(args) -> str:
  return args.tag or (f"L{args.train_len}_l{args.layers}d{args.d_model}_b{args.batch_size}_lr{args.lr:g}_T{args.steps}")


# ------------------------------------------------------------------------------------------------
# Held-out evaluation
# ------------------------------------------------------------------------------------------------


def heldout_batches(args) -> tuple[list[dict], dict]:
  """The fixed held-out set: `--heldout-windows` windows of L spread over every `fpa_text`
  validation document (`fpa_jax.data.make_heldout`, the trainer's eval set), the same for every run.
  -> (batches, coverage): inputs/targets/segment_ids int32 [B, L], mask bool [B, L] (bytes only:
  EOS targets and the pairs between documents excluded); coverage as `windows.coverage`."""
  from fpa_jax.data import ByteTokenizer, make_heldout

  eos = ByteTokenizer().eos_id
  h = make_heldout(
    "validation",
    data_dir=args.data_dir,
    seq_len=args.train_len,
    batch_size=args.eval_batch,
    n_windows=args.heldout_windows,
    small=args.small_data,
    process_index=0,
    process_count=1,
  )
  out = []
  for b in h:
    mask = (b["loss_mask"] > 0) & (b["targets"] != eos)  # bits per *byte*
    out.append({"inputs": b["inputs"], "targets": b["targets"], "segment_ids": b["segment_ids"], "mask": mask})
  cov = dict(h.info["coverage"], bytes_scored=int(sum(b["mask"].sum() for b in out)))
  return out, cov


def long_documents(args) -> np.ndarray:
  """Validation documents with at least 8L + 1 byte tokens (BOS + bytes), first 8L + 1 tokens each,
  at most `pos_docs` of them in split order. -> int32 [n_docs, 8L + 1]."""
  from fpa_jax.data import ByteTokenizer
  from fpa_jax.data.builders import text_data_source

  tok = ByteTokenizer()
  src = text_data_source(args.data_dir, "validation", small=args.small_data)
  n_tok = args.pos_multiple * args.train_len + 1
  docs = []
  for i in range(len(src)):
    t = src[i]["text"]
    toks = [tok.bos_id, *tok.encode(t.decode("utf-8") if isinstance(t, bytes) else t)]
    if len(toks) >= n_tok:
      docs.append(np.asarray(toks[:n_tok], np.int32))
    if len(docs) == args.pos_docs:
      break
  if not docs:
    raise ValueError(f"no validation document has {n_tok} tokens; lower --pos-multiple or --train-len")
  return np.stack(docs)


def nll_fn(model):
  """Jitted (inputs, targets, segment_ids int [B, T]) -> per-token NLL in nats fp32 [B, T]."""
  import jax
  import optax
  from flax import nnx

  graphdef, state = nnx.split(model)

  @jax.jit
  def f(state, inputs, targets, segment_ids):
    logits = nnx.merge(graphdef, state)(inputs, segment_ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

  return lambda inputs, targets, segment_ids=None: f(state, inputs, targets, segment_ids)


def bits_per_byte(nll, batches: list[dict]) -> float:
  tot, n = 0.0, 0
  for b in batches:
    ce = np.asarray(nll(b["inputs"], b["targets"], b["segment_ids"]), np.float64)
    tot += float(ce[b["mask"]].sum())
    n += int(b["mask"].sum())
  return tot / n / LN2


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


def summarise(res: dict) -> dict:
  """Per-method means, and each method's mean bpb relative to FoX's."""
  out = {}
  for m in (m for m in METHODS if m in res):
    out[m] = {
      "bpb_mean": float(np.mean(res[m]["bpb"])),
      "bpb_std": float(np.std(res[m]["bpb"], ddof=1)) if len(res[m]["bpb"]) > 1 else 0.0,
    }
  if "fox" in out:
    for m in out:
      out[m]["vs_fox"] = out[m]["bpb_mean"] / out["fox"]["bpb_mean"] - 1.0
      # Paired by seed (a seed fixes the data order for every method): per-seed relative differences.
      fox = dict(zip(res["fox"]["seeds"], res["fox"]["bpb"]))
      out[m]["vs_fox_paired"] = [b / fox[sd] - 1.0 for sd, b in zip(res[m]["seeds"], res[m]["bpb"]) if sd in fox]
  return out


def _heldout_words(res: dict) -> str:
  cov = res.get("heldout")
  if cov is None:  # results written before the fixed held-out set existed
    return f"the first {res['eval_tokens']} `fpa_text` validation bytes (about 8 of its documents)"
  return (
    f"{cov['bytes_scored']} bytes of {cov['windows']} windows spread over {cov['docs_covered']} of the "
    f"{cov['docs_in_split']} `fpa_text` validation documents"
  )


def markdown(res: dict) -> str:
  s, L, r = res["summary"], res["train_length"], res["recipe"]
  buckets = res["position_buckets"]
  # Position columns: within L, then the last bucket before 2L, 4L, 8L.
  cols = [i for i, (a, b) in enumerate(buckets) if b in (L, 2 * L, 4 * L, 8 * L)]
  head = (
    f"`python -m {MODULE}` (each method's exact command and commit are in {res.get('out_name', 'perplexity')}.json): byte LMs ({r['layers']} layers, d_model {r['d_model']}, {r['heads']} heads), "
    f"L={L}, batch {r['batch_size']}, {r['steps']} steps, lr {r['lr']} (cosine), seeds {r['seeds']}; held-out "
    f"bits per byte on {_heldout_words(res)}; loss by position on "
    f"{res['pos_docs']} validation documents read from their start to {res['pos_multiple']}L. \"train min\" is "
    f"wall time on a shared {res['meta']['machine']['cpu_count']}-core machine (load average "
    f"{res['meta'].get('load_avg_1_5_15min', ['?'])[-1]} at the end).\n\n"
  )
  rows = []
  for m in (m for m in METHODS if m in res):
    e = res[m]
    rows.append(
      [
        m,
        len(e["bpb"]),
        U.mean_std(e["bpb"]),
        f"{100 * s[m].get('vs_fox', float('nan')):+.2f}%",
        " / ".join(f"{100 * d:+.1f}%" for d in s[m].get("vs_fox_paired", [])),
        " / ".join(f"{x:.4f}" for x in e["bpb"]),
        f"{np.mean(e['train_wall_s']) / 60:.1f}",
        *[f"{e['by_position'][i] / LN2:.3f}" for i in cols],
      ]
    )
  table = U.md_table(
    [
      "method",
      "seeds",
      "bpb (mean ± std)",
      "vs FoX",
      "vs FoX per seed (paired)",
      "bpb per seed",
      "train min / run",
      *[f"bits/byte @ {buckets[i][0]}-{buckets[i][1]}" for i in cols],
    ],
    rows,
  )
  claim = "".join(_claim(res, m) for m in (DEFAULT_ROW, "fpa_lm_warmc10", "fpa_lm", "fpa") if m in s and "fox" in s)
  return head + table + claim + evict_cost_claim(res)


def evict_cost_claim(res: dict) -> str:
  """The evictability objective's target text cost: fpa_lm_evict vs fpa_lm, paired by seed, <= +1%."""
  if "fpa_lm_evict" not in res or "fpa_lm" not in res:
    return ""
  base = dict(zip(res["fpa_lm"]["seeds"], res["fpa_lm"]["bpb"]))
  pair = [b / base[sd] - 1.0 for sd, b in zip(res["fpa_lm_evict"]["seeds"], res["fpa_lm_evict"]["bpb"]) if sd in base]
  if not pair:
    return ""
  d = float(np.mean(pair))
  return (
    f"\nClaim \"the evictability objective costs <= 1% bits per byte\" (`fpa_lm_evict` vs `fpa_lm`, paired per seed): "
    f"{100 * d:+.2f}% ({', '.join(f'{100 * x:+.2f}%' for x in pair)}; {'holds' if d <= 0.01 else 'NOT met'}).\n"
  )


def _claim(res: dict, m: str) -> str:
  """The LM targets for FPA row m against FoX: mean bpb within 2%, by position out to 8L,
  and (with --eval-every curves) the largest paired gap at any logged step."""
  s, steps = res["summary"], res["recipe"]["steps"]
  d, pair = s[m]["vs_fox"], s[m].get("vs_fox_paired", [])
  out = (
    f"\nClaim \"FPA within 2% of FoX\" (`{m}`): mean bpb {100 * d:+.2f}% vs FoX "
    f"({'within' if d <= 0.02 else 'NOT within'} 2%; seed std {m} {s[m]['bpb_std']:.4f}, "
    f"FoX {s['fox']['bpb_std']:.4f}; paired per seed " + ", ".join(f"{100 * x:+.1f}%" for x in pair) + ")."
  )
  fpa, fox = np.asarray(res[m]["by_position"]), np.asarray(res["fox"]["by_position"])
  rel = fpa / fox - 1.0
  worst = int(np.argmax(rel))
  a, b = res["position_buckets"][worst]
  out += f" By position out to {res['pos_multiple']}L: worst bucket {a}-{b} at {100 * rel[worst]:+.2f}% vs FoX."
  if res[m].get("curves") and res["fox"].get("curves"):
    fox_c = dict(zip(res["fox"]["seeds"], res["fox"]["curves"]))
    pairs = [(c, fox_c[sd]) for sd, c in zip(res[m]["seeds"], res[m]["curves"]) if sd in fox_c]
    common = sorted(set.intersection(*[set(c) & set(f) for c, f in pairs]), key=int) if pairs else []
    if common:
      gaps = np.asarray([[c[t] / f[t] - 1.0 for t in common] for c, f in pairs])  # [seeds, steps]
      mean = gaps.mean(0)
      se = gaps.std(0, ddof=1) / np.sqrt(len(gaps)) if len(gaps) > 1 else np.zeros_like(mean)
      k = int(np.argmax(mean))
      out += (
        f" Held-out loss at each of {len(common)} logged steps: largest paired gap {100 * mean[k]:+.2f}% "
        f"(± {100 * se[k]:.2f}% s.e. over {len(gaps)} seeds) at step {common[k]}; "
        f"{int((mean - 2 * se > 0).sum())} logged steps worse than FoX beyond 2 s.e."
      )
  if steps < 1000:
    out += f" At {steps} steps these models are far from converged: this compares early training."
  return out + "\n"


def plot(res: dict, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  L = res["train_length"]
  mid = [(a + b) / 2 for a, b in res["position_buckets"]]
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for m in (m for m in METHODS if m in res):
    per = np.asarray(res[m]["by_position_seeds"]) / LN2  # [seeds, buckets]
    ax.plot(mid, per.mean(0), label=f"{m} ({len(per)} seeds)")
    ax.fill_between(mid, per.min(0), per.max(0), alpha=0.2)
  for k in (1, 2, 4):
    ax.axvline(k * L, color="gray", lw=0.6, ls=":")
  ax.set_xscale("log", base=2)
  ax.set_xlabel(f"position (train length L = {L})")
  ax.set_ylabel("bits per byte")
  ax.set_title("held-out loss by position", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(res: dict, out_dir: Path, name: str = "perplexity") -> None:
  res["summary"] = summarise(res)
  U.write_json(out_dir / f"{name}.json", res)
  (out_dir / f"{name}.md").write_text(markdown(res))
  plot(res, out_dir / f"{name}.png")


def base110m_recipe() -> str:
  from fpa_jax.configs import get_config
  from fpa_jax.models import abstract_model, count_params

  cfg = get_config("base110m")
  n = count_params(abstract_model(cfg))
  L, batch, steps, devices, peak, mfu = cfg.seq_len, cfg.batch_size, cfg.steps, 8, 989e12, 0.35
  tokens = batch * L * steps
  flops = 6 * n * tokens + 6 * cfg.n_layers * cfg.d_model * L * tokens
  hours = flops / (devices * peak * mfu) / 3600
  return f"""perplexity study at the paper's scale (NOT run here: it needs accelerators)

model    : base110m ({n / 1e6:.0f}M params, SentencePiece vocab {cfg.vocab_size} trained offline on fpa_text),
           bf16 compute, fp32 params, L = {L}; loss by position to 8L = {8 * L} tokens
mesh     : --mesh data={devices},model=1 (8 x H100/H200-class; or data=4,model=2 to halve activation memory)
batch    : {batch} x {L} = {batch * L / 1e6:.2f}M tokens/step;  steps {steps} (lr {cfg.lr}, warmup {cfg.warmup_steps}, cosine)
tokens   : {tokens / 1e9:.1f}B (the stdlib corpus is ~28M bytes: use `--text-dir` / `tfds:pg19` for a corpus that big)
expected : ~{hours:.1f} h per run at {mfu:.0%} MFU of {peak / 1e12:.0f} TFLOP/s bf16 x {devices} devices; 4 methods x 3 seeds
           = ~{12 * hours:.0f} h
command  : python -m fpa_jax.train --config base110m --attention {{fpa,stack,fox,softmax}} --task text \\
               --mesh data={devices},model=1 --set seed={{0,1,2}} --workdir runs/ppl110m_<method>_s<seed>
"""


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Claims: this study's rows of the README's claims table (`experiments.report` collects them)
# ------------------------------------------------------------------------------------------------


def _ppl(doc, long=None, old=(None, None)) -> str:
  """The perplexity claim; `old` = the (short, long) runs trained on correlated batches (each batch
  from one file, before the text-pipeline fix), kept beside the current runs and labelled."""
  text = "not run yet on the fixed pipeline (`python -m experiments.perplexity`)" if doc is None else _ppl_one(doc)
  if long is not None:
    text += "; trained longer: " + _ppl_one(long)
  stale = [_ppl_one(d) for d in old if d is not None]
  if stale:
    text += "; *trained on correlated batches (before the text-pipeline fix)*: " + "; ".join(stale)
  return text


def _ppl_one(doc) -> str:
  bpb = {m: float(np.mean(doc[m]["bpb"])) for m in U.result_methods(doc) if "bpb" in doc[m]}
  n = {m: len(doc[m]["bpb"]) for m in bpb}
  parts = [f"{m} {v:.3f} ({n[m]} seed{'s' * (n[m] != 1)})" for m, v in bpb.items()]
  ratios = [f"{m} / fox = {bpb[m] / bpb['fox']:.3f}" for m in bpb if m.startswith("fpa") and "fox" in bpb]
  return (
    f"held-out bits per byte after {doc['recipe']['steps']} steps: "
    + ", ".join(parts)
    + (f" ({', '.join(ratios)})" if ratios else "")
  )


PPL_DEFAULT = ("fpa_lm_warmc10_fh1", "fpa_lm", "fpa")  # the LM default's row, else the earliest FPA row


def _paired(doc: dict, m: str, base: str) -> list[float]:
  """bpb(m) / bpb(base) - 1 per seed both ran."""
  b = dict(zip(doc[base].get("seeds", range(len(doc[base]["bpb"]))), doc[base]["bpb"]))
  mine = zip(doc[m].get("seeds", range(len(doc[m]["bpb"]))), doc[m]["bpb"])
  return [x / b[s] - 1 for s, x in mine if s in b]


def _ppl_row(root: Path) -> tuple[str, str]:
  doc = U.load_result(root, "perplexity_T3000") or U.load_result(root, "perplexity")
  m = next((m for m in PPL_DEFAULT if doc is not None and "bpb" in doc.get(m, {})), None)
  if doc is None or m is None or "fox" not in doc:
    return "not run", "`python -m experiments.perplexity`"
  pair = _paired(doc, m, "fox")
  return U.seed_verdict([x <= 0.02 for x in pair]), (
    f"`{m}` / FoX bits per byte after {doc['recipe']['steps']} steps, by seed: "
    + ", ".join(f"{100 * x:+.1f}%" for x in pair)
  )


def _evict_cost_row(root: Path) -> tuple[str, str]:
  doc = U.load_result(root, "perplexity_T3000")
  if doc is None or not all("bpb" in doc.get(m, {}) for m in ("fpa_lm", "fpa_lm_evict")):
    return "not run", "`python -m experiments.perplexity --methods fpa_lm fpa_lm_evict --steps 3000`"
  pair = _paired(doc, "fpa_lm_evict", "fpa_lm")
  return U.seed_verdict([x <= 0.01 for x in pair]), (
    "`fpa_lm_evict` / `fpa_lm` bits per byte, by seed: " + ", ".join(f"{100 * x:+.2f}%" for x in pair)
  )


def claim_rows(root: Path = U.ROOT) -> list[U.ClaimRow]:
  """The perplexity claim (the LM default against FoX) and the objective's text cost, judged seed by seed;
  the first with everything the runs measured (the longer run, the runs on correlated batches)."""
  detail = _ppl(
    U.load_result(root, "perplexity"),
    U.load_result(root, "perplexity_T3000"),
    (
      U.load_result(root, "correlated_batches/perplexity"),
      U.load_result(root, "correlated_batches/perplexity_long/perplexity"),
    ),
  )
  par = "Perplexity on par with FoX (within 2%)"
  return [
    U.ClaimRow(par, *_ppl_row(root), "docs/results/perplexity.md", (par, detail)),
    U.ClaimRow(
      "Training to forget costs <= 1% bits per byte on text", *_evict_cost_row(root), "docs/results/perplexity.md"
    ),
  ]


def parse_args(argv=None):
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument(
    "--scale",
    choices=["cpu", "base110m"],
    default="cpu",
    help="base110m: print the accelerator recipe (mesh, batch, steps, time) and exit",
  )
  add_recipe_args(ap, steps=300, runs_dir="runs/perplexity")
  ap.add_argument("--pos-multiple", type=int, default=8, help="loss by position out to this multiple of L")
  ap.add_argument("--pos-docs", type=int, default=32)
  ap.add_argument("--pos-bucket", type=int, default=64)
  ap.add_argument("--report-only", action="store_true", help="re-render the .md/.png from the JSON, train nothing")
  ap.add_argument(
    "--out-name", default="perplexity", help="results file stem: another recipe (e.g. --steps 3000) keeps its own file"
  )
  ap.add_argument(
    "--eval-every", type=int, default=0, help="> 0: held-out loss every N steps during training (curves per seed)"
  )
  return ap.parse_args(argv)


def add_recipe_args(ap: argparse.ArgumentParser, *, steps: int, runs_dir: str) -> None:
  """The study recipe's flags (`study_config`, `heldout_batches`), shared with `experiments.lm_ablations`."""
  ap.add_argument("--train-len", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--block-size", type=int, default=64)
  ap.add_argument("--batch-size", type=int, default=8)
  ap.add_argument("--steps", type=int, default=steps)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--warmup", type=int, default=30)
  ap.add_argument("--ckpt-every", type=int, default=100)
  ap.add_argument("--heldout-windows", type=int, default=512, help="held-out windows of L for bits per byte")
  ap.add_argument("--eval-batch", type=int, default=16)
  ap.add_argument("--data-dir", default="data")
  ap.add_argument("--small-data", action="store_true", help="small fpa_text build (smoke tests)")
  ap.add_argument("--runs-dir", default=runs_dir)
  ap.add_argument("--tag", default="")
  ap.add_argument("--out-dir", default="results")


def curve(history: list[dict]) -> dict[str, float]:
  """step -> held-out loss (nats per token) from the trainer's periodic evals (`--eval-every`)."""
  return {str(r["step"]): float(r["eval_loss"]) for r in history if r.get("eval_loss") is not None}


def main(argv=None) -> dict | None:
  from fpa_jax import eval as ev
  from fpa_jax.inference import read_metrics

  args = parse_args(argv)
  if args.scale == "base110m":
    print(base110m_recipe())
    return None
  if args.report_only:
    res = U.read_json(Path(args.out_dir) / f"{args.out_name}.json")
    if res is None:
      raise SystemExit(f"{args.out_dir}/{args.out_name}.json not found: run python -m {MODULE} first")
    for m in (m for m in METHODS if m in res):  # the config each run started with (see _common.init_config)
      res[m]["config"] = U.init_config(res[m]["workdirs"][-1], res[m].get("config"))
    res["out_name"] = args.out_name
    write_outputs(res, Path(args.out_dir), args.out_name)
    return res
  log = lambda s: print(s, file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  out_dir = Path(args.out_dir)
  tag = run_tag(args)
  held, coverage = heldout_batches(args)
  docs = long_documents(args)
  T = docs.shape[1] - 1
  buckets = [(a, min(a + args.pos_bucket, T)) for a in range(0, T, args.pos_bucket)]
  recipe = {**recipe_of(args, tag), "seeds": args.seeds}
  for method in args.methods:
    entry = {"bpb": [], "by_position_seeds": [], "train_wall_s": [], "workdirs": [], "final_train_loss": []}
    extra = {"eval_every": args.eval_every, "heldout_windows": args.heldout_windows} if args.eval_every else {}
    for seed in args.seeds:
      workdir = os.path.join(args.runs_dir, tag, f"{method}_s{seed}")
      tr = U.train_lm(study_config(method, args, seed, overrides={**METHODS[method], **extra}), workdir, None)
      if args.eval_every:  # every session's evals, not only this one's
        entry.setdefault("curves", []).append(curve(read_metrics(workdir)))
      nll = nll_fn(tr["model"])
      entry["bpb"].append(bits_per_byte(nll, held))
      by_pos = ev.loss_by_position(tr["model"], docs, bucket=args.pos_bucket, batch_size=4, show_progress=False)
      entry["by_position_seeds"].append(by_pos["nll"])
      entry["train_wall_s"].append(tr["train_wall_s"])
      entry["workdirs"].append(workdir)
      entry["final_train_loss"].append(tr["history"][-1]["loss"] if tr["history"] else None)
      log(f"[perplexity] {method} seed {seed}: bpb {entry['bpb'][-1]:.4f}, train wall {tr['train_wall_s']:.0f} s")
    entry["by_position"] = np.mean(entry["by_position_seeds"], axis=0).tolist()
    entry.update(seeds=args.seeds, config=tr["init_config"], command=U.command(MODULE, argv), commit=U.git_commit())
    res = U.read_json(out_dir / f"{args.out_name}.json", {})  # merge with methods other invocations wrote
    if res.get("recipe", {}).get("tag") != tag:
      res = {}
    res.update(
      {
        method: entry,
        "recipe": recipe,
        "out_name": args.out_name,
        "train_length": args.train_len,
        "heldout": coverage,
        "pos_docs": len(docs),
        "pos_multiple": args.pos_multiple,
        "position_buckets": buckets,
        "by_position_unit": "nats per byte, mean over documents in each bucket [start, end)",
        "meta": U.run_meta(
          MODULE, argv, wall_s=time.perf_counter() - t0, seeds=args.seeds, methods_this_run=args.methods
        ),
      }
    )
    write_outputs(res, out_dir, args.out_name)
  return U.read_json(out_dir / f"{args.out_name}.json")


if __name__ == "__main__":
  main()
