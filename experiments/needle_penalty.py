"""Where retrieval stands in a passkey model's gates: per layer and head, the penalty the
gate puts on the needle at the question, the median penalty over the prompt, and the attention mass
the question gives the needle.

    python -m experiments.needle_penalty       # seed 1: fox_b5 and the FPA gates on FoX's other weights

--passkey-results takes several passkey results files; each model comes from the first that has it.

Each model is loaded from its workdir's last checkpoint (the step is in the table) and reads
`--prompts` validation-style prompts at 1x (needle depths spread over 0-75%). Query: the position
that predicts the answer's first digit; needle: the 60 tokens from the needle sentence's start.
Cells are means over the prompts. FoX models' penalties are their summed decays (field = level =
cumsum of the log forget gate). Writes <out>.{json,md}.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from experiments import _common as U

MODULE = "experiments.needle_penalty"
NEEDLE_SPAN = 60  # tokens from the needle sentence's start: its digits and the sentence around them


def kept_rank(pen: np.ndarray, copies: list[np.ndarray]) -> float:
  """The smallest share of the keys (penalties pen [T] at one query) that `fpa_budget` keeps with
  every token of at least one of `copies` (index arrays): it keeps the smallest penalties first, the
  newer of equal ones (it evicts the largest, ties the oldest)."""
  pos = np.arange(len(pen))
  before = lambda j: np.sum((pen < pen[j]) | ((pen == pen[j]) & (pos > j))) + 1
  return float(min(max(before(j) for j in c) for c in copies) / len(pen))


def passkey_copies(e: dict, qpos: int) -> list[np.ndarray]:
  """Token positions of each copy of the answer (the passkey, as the prompt's answer spells it)
  inside the needle sentence; the sentence's first token if none (a tokenizer that splits it)."""
  toks = np.asarray(e["tokens"])
  a0 = int(e["answer_start"])
  ans = toks[a0 : len(toks) - 1]  # the answer tokens (the row ends with EOS)
  lo, hi = int(e["needle_start"]), min(int(e["needle_start"]) + NEEDLE_SPAN, qpos)
  n = len(ans)
  hits = [lo + i + np.arange(n) for i in range(hi - lo - n + 1) if np.array_equal(toks[lo + i : lo + i + n], ans)]
  return hits or [np.asarray([lo])]


def needle_stats(model, examples) -> list[dict]:
  """[{layer, head, needle_penalty, median_penalty, needle_mass, passkey_rank}] averaged over `examples`.

  passkey_rank: the smallest share of the prompt's keys that `fpa_budget`, cutting this head's
  cache at the question, keeps with a whole copy of the passkey (`kept_rank`): a per-head budget
  below it loses every copy of some digit in this head (the parallel prefill's cut)."""
  import jax.numpy as jnp

  from experiments.forget_speed import record_attention_inputs
  from fpa_jax.ops.penalty import first_passage_penalty

  acc: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
  for e in examples:
    tokens = jnp.asarray(np.asarray(e["tokens"])[None].astype(np.int32))
    qpos = e["answer_start"] - 1
    needle = np.arange(e["needle_start"], min(e["needle_start"] + NEEDLE_SPAN, qpos))
    for li, (q, k, _, gates, cfg) in enumerate(record_attention_inputs(model, tokens)):
      field, level = gates if len(gates) == 2 else (jnp.cumsum(gates[0], axis=1),) * 2
      for h in range(field.shape[-1]):  # kv heads; the first query head of each group reads it
        pen = np.asarray(first_passage_penalty(field[0, : qpos + 1, h], level[0, : qpos + 1, h]))[qpos]
        grp = q.shape[2] // k.shape[2]
        s = np.asarray(q[0, qpos, h * grp] @ k[0, : qpos + 1, h].T) * cfg.head_dim**-0.5 - pen
        p = np.exp(s - s.max())
        p /= p.sum()
        rank = kept_rank(pen, passkey_copies(e, qpos))
        acc.setdefault((li, h), []).append(
          (float(pen[needle].min()), float(np.median(pen)), float(p[needle].sum()), rank)
        )
  names = ("needle_penalty", "median_penalty", "needle_mass", "passkey_rank")
  return [{"layer": li, "head": h, **dict(zip(names, np.mean(v, 0).tolist()))} for (li, h), v in sorted(acc.items())]


def global_split(model, examples, budget: float) -> list[dict]:
  """Where `fpa_global`'s one budget goes after the parallel prefill of each prompt (up to the
  question), per layer and kv head: [{layer, head, held, copy_held}], held the mean share of the
  prompt's keys the head keeps, copy_held the share of prompts in which it keeps every token of at
  least one copy of the passkey (`passkey_copies`). A head that reads the needle but keeps no copy
  loses a digit of the answer whatever the others keep."""
  import jax.numpy as jnp

  from fpa_jax.inference import Decoder

  prompts = [np.asarray(e["tokens"][: e["answer_start"]], np.int32) for e in examples]
  width = max(len(p) for p in prompts)
  dec = Decoder(model, "fpa_global", max_len=width, budget=budget)
  held, copy = [], []
  for e, p in zip(examples, prompts):  # one row at a time: one compile (every prompt padded to the widest)
    tokens = jnp.asarray(np.pad(p, (0, width - len(p)))[None])
    _, state = dec.prefill(tokens, jnp.asarray([len(p)], jnp.int32))
    pool = state.pool  # fpa_global's state: one slot pool per row, each slot's owner (layer * KVH + head)
    owner, pos = np.asarray(pool.owner[0]), np.asarray(pool.pos[0])
    kept = [set(pos[owner == o].tolist()) for o in range(state.n_layers * state.kv_heads)]
    held.append([len(k) / len(p) for k in kept])
    copies = passkey_copies(e, int(e["answer_start"]) - 1)
    copy.append([any(set(c.tolist()) <= k for c in copies) for k in kept])
  kvh = state.kv_heads
  h, c = np.mean(held, 0), np.mean(copy, 0)
  return [{"layer": o // kvh, "head": o % kvh, "held": float(h[o]), "copy_held": float(c[o])} for o in range(len(h))]


def oracle_split(model, examples, budget: float, *, batch_size: int = 8) -> list[dict]:
  """Passkey accuracy of `fpa_global` at `budget` with the whole budget given by hand: to one head of
  the upper layers at a time, then to the upper layers together, every other head streaming (its
  protected window only; `FPAGlobal.head_offset` +inf) -> [{layer, head (None: every upper head),
  accuracy, n (prompts)}]. Where no head alone and not the upper layers together hold the passkey, moving the
  budget onto one head or off the lowest layer does not help: the rank inside the heads fails."""
  import math

  from fpa_jax import eval as ev
  from fpa_jax.inference import FPAGlobal
  from fpa_jax.inference.graph import layer_configs

  kvh = [c.kv_heads for c in layer_configs(model)]
  owners = [(i, h) for i, n in enumerate(kvh) for h in range(n)]
  sets = [[(i, h)] for i, h in owners if i > 0] + [[o for o in owners if o[0] > 0]]
  out = []
  for s in sets:
    off = tuple(0.0 if o in s else math.inf for o in owners)
    pol = FPAGlobal(budget=budget, head_offset=off)
    c = ev.passkey_cell(model, examples, policy=pol, prefill="parallel", batch_size=batch_size)
    layer, head = s[0] if len(s) == 1 else (None, None)
    out.append({"layer": layer, "head": head, "accuracy": c["accuracy"], "n": c["n"]})
  return out


def main(argv=None) -> dict:
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument(
    "--passkey-results",
    nargs="+",
    default=["results/passkey_shared_init_seed1/passkey.json", "results/passkey_seed1/passkey.json"],
  )
  ap.add_argument("--models", nargs="+", default=["fox_b5", "fpa_lm5", "fpa_lm5_init0", "fpa_lm5_warm"])
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--out", default=str(U.ROOT / "results" / "needle_penalty"))
  a = ap.parse_args(argv)
  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.inference import load_model

  t0 = time.perf_counter()
  files = [U.read_json(U.ROOT / p, {}) for p in a.passkey_results]
  src = {m: next((p for p, f in zip(a.passkey_results, files) if m in f), None) for m in a.models}
  pk = {m: files[a.passkey_results.index(p)][m] if p else None for m, p in src.items()}
  missing = [m for m, e in pk.items() if e is None]
  if missing:
    raise SystemExit(f"{missing} not in {a.passkey_results}: train them first (python -m experiments.passkey)")
  lengths = {f["train_length"] for f in files if any(m in f for m in a.models)}
  if len(lengths) != 1:
    raise SystemExit(f"the models were trained at different lengths {sorted(lengths)}: compare one length at a time")
  pk["train_length"] = lengths.pop()
  depths = np.linspace(0, 75, a.prompts).round().astype(int).tolist()
  exs = [passkey_eval_examples(pk["train_length"], 1, d, n=1, seed=i)[0] for i, d in enumerate(depths)]
  rows = {}
  for m in a.models:
    model, cfg = load_model(U.ROOT / pk[m]["workdir"])
    rows[m] = {
      "steps": pk[m].get("steps"),
      "competent_1x": pk[m].get("competent_1x"),
      "source": src[m],
      "heads": needle_stats(model, exs),
    }
    print(f"[needle_penalty] {m}: done", file=sys.stderr)
  meta = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0, prompts=a.prompts)
  res = {"rows": rows, "meta": meta, "passkey_results": a.passkey_results}
  md = (
    f"`{meta['command']}`: per layer and kv head, at the position predicting the answer's first digit of "
    f"{a.prompts} prompts at 1x: the smallest penalty over the needle's {NEEDLE_SPAN} tokens, the median "
    "penalty over the prompt, and the attention mass on the needle (means over prompts). Models from: "
    + ", ".join(f"{m} `{r['source']}`" for m, r in rows.items())
    + ".\n\n"
  )
  md += U.md_table(
    ["model", "steps (competent)", "layer", "head", "needle penalty", "median penalty", "needle mass"],
    [
      [m, f"{r['steps']} ({'yes' if r['competent_1x'] else 'no'})", x["layer"], x["head"]]
      + [f"{x['needle_penalty']:.2f}", f"{x['median_penalty']:.2f}", f"{x['needle_mass']:.3f}"]
      for m, r in rows.items()
      for x in r["heads"]
    ],
  )
  U.write_prefixed(a.out, res, md)
  return res


if __name__ == "__main__":
  main()
