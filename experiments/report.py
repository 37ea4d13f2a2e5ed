"""Regenerate the README's and docs' results from the files the studies wrote: no hand-typed numbers.

    python -m experiments.report

1. Writes results/claims.md, the README's claims table: one line per claim, its verdict and a link
   to the evidence. From results/one_recipe/claims.json (`experiments.one_recipe`: every claim on
   the same checkpoints) when it exists and has judged a claim, else from the separate studies' results
   (results/{scopes,dips,passkey*,kv_compression*,perplexity*,bindings_lm,text_pareto,forget_speed}.json):
   a study that exports its rows (`claim_rows`: passkey, perplexity, bindings_lm, forget_speed,
   forget_train) is collected, the live-set, KV-cache and text-cache rows are read here.
   A verdict holds only when it holds on every seed (paired with FoX of the same seed where the
   claim compares with FoX), else it says on how many: "k of n seeds", or "not met".
2. Writes results/claims_studies.md (the separate studies' table, for docs/results.md) and
   results/claims_detail.md (everything each study measured for each claim) and the tables collected
   across runs (dips_limits, passkey_pace from `experiments.passkey`, kv_lengths).
3. Copies tables into README.md and every docs/**/*.md, which mark each one as

    <!-- results/NAME.md -->
    ...replaced...
    <!-- end results/NAME.md -->

   replacing what lies between with the current contents of results/NAME.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from experiments import _common as U
from experiments import bindings_lm, forget_screen, forget_speed, forget_train, passkey, perplexity

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- (results/[\w./-]+\.md) -->\n)(.*?)(<!-- end \2 -->)", re.S)
FAMILIES = ("fpa", "stack", "fox", "softmax")


def render(readme: str, root: Path = ROOT) -> str:
  def fill(m):
    src = root / m.group(2)
    body = src.read_text() if src.exists() else f"(not yet generated: run the script that writes {m.group(2)})\n"
    return m.group(1) + body + m.group(4)

  return BLOCK.sub(fill, readme)


def _live_sets(doc, task: str) -> str:
  if doc is None:
    return f"not run yet (`python -m experiments.live_sets --task {task}`)"
  parts = [f"{m} {doc[m]['successes']}/{doc[m]['seeds']}" for m in U.result_methods(doc) if "successes" in doc[m]]
  return "seeds succeeding (mass and coverage >= 0.95 at 1x and 2x): " + ", ".join(parts)


def _kv(doc, decode=None, more=None, decode_more=None) -> str:
  if doc is None:
    return "not run yet (`python -m experiments.kv_compression`)"
  text = _kv_cells(doc) + _kv_stale(doc)
  if more is not None and more.get("cells"):
    text += (
      f"; with {more['n_prompts']} prompts per cell (95% intervals): " + _kv_cells(more, ci=True) + _kv_stale(more)
    )
  if decode is not None and decode.get("cells"):
    text += f"; with every prompt token decoded under the policy ({decode['n_prompts']} prompts per cell): "
    text += _kv_cells(decode) + _kv_stale(decode)
  if decode_more is not None and decode_more.get("cells"):
    text += f"; decoded so, with {decode_more['n_prompts']} prompts per cell (95% intervals): "
    text += _kv_cells(decode_more, ci=True) + _kv_stale(decode_more)
  return text


def _kv_stale(doc) -> str:
  """The pre-fix label for a KV study whose models' text rows predate the text-pipeline fix
  (rows drawn one file at a time): its `model_steps`
  entries are (steps, text_rows, commit) since the fix, a bare step count before it."""
  steps = doc.get("model_steps", {}).values()
  return "" if steps and all(isinstance(s, list) and "windows" in s for s in steps) else U.STALE_TEXT


KV_POLICIES = ("fpa_budget", "fpa_global", "window", "sink_window", "h2o", "snapkv")
KV_BUDGETS = ("0.25", "0.125")


def _kv_cells(doc, policies=KV_POLICIES, ci=False) -> str:
  """Per model: the tolerance policy, then each budgeted policy at 25% / 12.5% of the cache."""
  fmt = lambda c: (
    f"{c['accuracy']:.2f}"
    + (  # noqa: E731
      f" [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if ci and c.get("ci95") else ""
    )
  )
  models = {}
  for key, cell in sorted(doc["cells"].items()):
    model, policy = key.split("/")
    out = models.setdefault(model, [])
    if policy == "fpa" and "tol" in cell:
      out.insert(
        0, f"fpa ε={doc['tolerance']:g} {fmt(cell['tol'])} at {cell['tol']['cache_fraction']:.2f} of the cache"
      )
    if policy in policies and any(b in cell for b in KV_BUDGETS):
      out.append(f"{policy} " + " / ".join(fmt(cell[b]) if b in cell else "—" for b in KV_BUDGETS))
  parts = [f"**{m}**: " + ", ".join(cells) for m, cells in models.items() if cells]
  return f"exact match at {doc['multiple']}x (prefill {doc['prefill']}; budgets 25% / 12.5%): " + "; ".join(parts)


def _text_pareto(doc, ppl) -> str:
  cost = perplexity.evict_cost_claim(ppl).strip() if ppl is not None else ""
  if doc is None:
    return (cost + " " if cost else "") + "Pareto curves not run yet (`python -m experiments.text_pareto`)"
  from experiments.text_pareto import claims

  return (cost + " " if cost else "") + (
    "Held-out bits per byte of those byte LMs under each cache (`text_pareto`): " + " ".join(claims(doc["summary"]))
  )


KV_LENGTHS = (1, 2, 4, 8)


def _kv_length_docs(root: Path) -> list[tuple[int, str, dict]]:
  """(multiple, prefill, doc) of the 100-prompt passkey cache studies: results/kv_compression_n100 (8x)
  and its _x<m> siblings, parallel and decode prefill."""
  out = []
  for m in KV_LENGTHS:
    tail = "" if m == 8 else f"_x{m}"
    for prefill, name in (("parallel", "kv_compression_n100"), ("decode", "kv_compression_decode_n100")):
      doc = U.load_result(root, f"{name}{tail}/kv_compression")
      if doc is not None and doc.get("cells"):
        out.append((m, prefill, doc))
  return out


def kv_lengths_table(root: Path = ROOT) -> str | None:
  """Passkey exact match [95% interval] by length (columns) for every (model, policy, budget) of the
  100-prompt cache studies, both prefill modes (decode rows say so): results/kv_lengths.md."""
  docs = _kv_length_docs(root)
  if not docs:
    return None
  lengths = sorted({m for m, _, _ in docs})
  cells: dict[tuple, dict] = {}
  for m, prefill, doc in docs:
    for key, cell in doc["cells"].items():
      model, policy = key.split("/")
      for budget, c in cell.items():
        if policy == "full" or budget in KV_BUDGETS:
          name = policy if policy == "full" else f"{policy} {float(budget):.1%}".replace(".0%", "%")
          if prefill == "decode":
            name += " (decode)"
          cells.setdefault((model, name, policy, budget, prefill), {})[m] = c
  fmt = lambda c: f"{c['accuracy']:.2f} [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]" if c else "—"
  rank = {p: i for i, p in enumerate(("full",) + KV_POLICIES)}
  order = lambda k: (k[0], -float(k[3]), rank.get(k[2], len(rank)), k[4] == "decode")  # model, budget, policy
  rows = [[k[0], k[1]] + [fmt(cells[k].get(m)) for m in lengths] for k in sorted(cells, key=order)]
  cmds = sorted({f"`{d['meta']['command']}`" for _, _, d in docs})
  head = (
    "Passkey exact match by length (training length 512), 100 prompts per cell (depths 0-100%), with the "
    "cache cut to 25% / 12.5% of the sequence by each policy at equal cache bytes [95% Wilson interval]; "
    "parallel prefill unless marked decode (every prompt token decoded under the policy). Commands: "
    + ", ".join(cmds)
    + ".\n\n"
  )
  return head + U.md_table(["model", "cache"] + [f"{m}x" for m in lengths], rows)


def _kv_by_length(root: Path, model: str = "fpa_fox5_evict") -> str:
  """The claim's part from the shorter lengths: `model`'s learned rule (parallel prefill) at 25% / 12.5%."""
  parts = []
  for m, prefill, doc in _kv_length_docs(root):
    cell = doc["cells"].get(f"{model}/fpa_budget", {})
    if m != 8 and prefill == "parallel" and all(b in cell for b in KV_BUDGETS):
      parts.append(f"{m}x " + " / ".join(f"{cell[b]['accuracy']:.2f}" for b in KV_BUDGETS))
  if not parts:
    return ""
  return f"; shorter prompts (100 per cell, `results/kv_lengths.md`): {model} fpa_budget 25% / 12.5% at " + ", ".join(
    parts
  )


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
  """The `dips` variants run with every method (results/dips_limits/<variant>), as the claim's row."""
  out = []
  for name, doc in _dips_variant_runs(root):
    ms = [m for m in FAMILIES if m in doc]
    if len(ms) < 2:
      continue
    hd, steps = _head_dim_steps(doc, "fpa")
    out.append(
      f"with head dim {hd} and {steps} steps (`{name}`): "
      + ", ".join(f"{m} {doc[m]['successes']}/{doc[m]['seeds']}" for m in ms)
    )
  return "".join(f"; {o}" for o in out)


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
    for m in ["fpa"] + [m for m in FAMILIES if m != "fpa" and m in doc and doc is not default]:
      e = doc[m]
      cov = lambda k: f"{np.mean(e[k]):.3f} ± {np.std(e[k]):.3f}"  # noqa: E731  (as live_sets reports it)
      hd, steps = _head_dim_steps(doc, m)
      rows.append(
        f"| {name} | {m} | `{cmd}` | {hd} | {steps} | {cov('coverage_1x')} | {cov('coverage_2x')} | "
        f"{e['successes_coverage']}/{e['seeds']} |"
      )
  head = (
    "FPA's coverage head on `dips` (1 - TV to uniform over the live set; a seed succeeds at >= 0.95 at both "
    "1x and 2x), single head, d_model = head dim:\n\n"
    "| variant | method | command | head dim | steps | coverage 1x | coverage 2x | seeds >= 0.95 |\n"
    "|---|---|---|---:|---:|---:|---:|---:|\n"
  )
  return head + "\n".join(rows) + "\n"


# ---- the README's claims table: one line per claim, a verdict judged seed by seed ----------------


LIVE_KEYS = ("target_mass_1x", "target_mass_2x", "coverage_1x", "coverage_2x")


def live_set_seeds(doc: dict, method: str, thr: float = 0.95) -> dict[int, bool]:
  """{seed: the method's heads reach mass and coverage >= thr at 1x and 2x} of a live-set study."""
  e = doc[method]
  ids = e.get("seed_ids", list(range(e["seeds"])))
  return {s: all(e[k][i] >= thr for k in LIVE_KEYS if k in e) for i, s in enumerate(ids)}


def _live_row(doc, task: str, variants: str = "") -> tuple[str, str]:
  if doc is None or "fpa" not in doc:
    return "not run", f"`python -m experiments.live_sets --task {task}`"
  fpa = live_set_seeds(doc, "fpa")
  rivals = [live_set_seeds(doc, m) for m in ("fox", "softmax") if m in doc]
  ok = [fpa[s] and not any(r.get(s) for r in rivals) for s in fpa]
  counts = ", ".join(f"{m} {sum(live_set_seeds(doc, m).values())}/{doc[m]['seeds']}" for m in FAMILIES if m in doc)
  return U.seed_verdict(ok), f"seeds succeeding: {counts}{variants}"


def _dips_variant_short(root: Path) -> str:
  out = []
  for name, doc in _dips_variant_runs(root):
    if "fox" in doc:
      hd, steps = _head_dim_steps(doc, "fpa")
      out.append(f"; head dim {hd}, {steps} steps: fpa {doc['fpa']['successes']}/{doc['fpa']['seeds']}")
  return "".join(out)


def _kv_row(root: Path) -> tuple[str, str]:
  doc = U.load_result(root, "kv_compression_n100/kv_compression") or U.load_result(root, "kv_compression")
  if doc is None or not doc.get("cells"):
    return "not run", "`python -m experiments.kv_compression`"
  acc = lambda m, p, b: doc["cells"].get(f"{m}/{p}", {}).get(b, {}).get("accuracy")  # noqa: E731
  models = sorted({k.split("/")[0] for k in doc["cells"]})
  fpa = [m for m in models if not m.startswith("fox") and acc(m, "fpa_budget", "0.25") is not None]
  if not fpa:
    return "not run", "no FPA model under `fpa_budget` yet"
  best = max(fpa, key=lambda m: (acc(m, "fpa_budget", "0.25"), acc(m, "fpa_budget", "0.125") or 0))
  a25, a12 = acc(best, "fpa_budget", "0.25"), acc(best, "fpa_budget", "0.125")
  fox = [acc(m, p, "0.25") for m in models if m.startswith("fox") for p in KV_POLICIES]
  fox = [x for x in fox if x is not None]
  return U.seed_verdict([a25 >= 0.99]), (
    f"`{best}` (one seed) at {doc['multiple']}x, {doc['n_prompts']} prompts: {a25:.2f} at 25% of the cache, "
    + (f"{a12:.2f} at 12.5%" if a12 is not None else "12.5% not run")
    + (f"; FoX's best policy at 25%: {max(fox):.2f}" if fox else "")
  )


def _text_cache_row(root: Path, meth: str = "fpa_lm_evict") -> tuple[str, str]:
  doc = U.load_result(root, "text_pareto")
  if doc is None or meth not in doc.get("runs", {}):
    return "not run", "`python -m experiments.text_pareto`"
  from experiments.text_pareto import smallest_within

  budgets, ok, parts = doc["recipe"]["budgets"], [], []
  for seed, run in sorted(doc["runs"][meth].items()):
    s = {"budgets": budgets} | {f"{meth}/{k}/{p}": c["bpb"] for k, cells in run.items() for p, c in cells.items()}
    pair = [(smallest_within(s, meth, k, "fpa_budget"), smallest_within(s, meth, k, "window")) for k in run]
    ok.append(all(r is not None and (w is None or r < w) for r, w in pair))
    pct = lambda xs: "/".join(f"{100 * x:g}%" if x else "none" for x in xs)  # noqa: E731
    parts.append(f"{pct(r for r, _ in pair)} (window {pct(w for _, w in pair)})")
  return U.seed_verdict(ok), (
    f"`{meth}`: smallest cache within 1% of the full cache's bits per byte at {'x / '.join(run)}x, by seed: "
    + ", ".join(parts)
  )


def _live_rows(root: Path) -> list[U.ClaimRow]:
  """The live-set claims (`experiments.live_sets`: scopes, then dips with its variant runs)."""
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


def _kv_claim(root: Path) -> U.ClaimRow:
  """The cache claim (`experiments.kv_compression`: every prompt count, both prefills, every length)."""
  detail = _kv(
    U.load_result(root, "kv_compression"),
    U.load_result(root, "kv_compression_decode/kv_compression"),
    U.load_result(root, "kv_compression_n100/kv_compression"),
    U.load_result(root, "kv_compression_decode_n100/kv_compression"),
  ) + _kv_by_length(root)
  return U.ClaimRow(
    "... and keeps it with the KV cache cut to 25% by the learned rule",
    *_kv_row(root),
    "docs/results/kv_compression.md",
    ("... and keeps that with the KV cache compressed to ~25%", detail),
  )


def _text_claim(root: Path) -> U.ClaimRow:
  """The text-cache claim (`experiments.text_pareto`), its detail led by the objective's text cost."""
  return U.ClaimRow(
    "On text the learned rule needs a smaller cache than a window",
    *_text_cache_row(root),
    "docs/results/text_pareto.md",
    (
      "On text, a model trained to forget gives up little for it, and its rule cuts the cache",
      _text_pareto(U.load_result(root, "text_pareto"), U.load_result(root, "perplexity_T3000")),
    ),
  )


def claims_rows(root: Path = ROOT) -> list[U.ClaimRow]:
  """Every claim, in the README's order, as the studies export them (each study's `claim_rows`)."""
  ppl, evict_cost = perplexity.claim_rows(root)
  return [
    *_live_rows(root),
    *passkey.claim_rows(root),
    _kv_claim(root),
    ppl,
    *bindings_lm.claim_rows(root),
    evict_cost,
    _text_claim(root),
    *forget_speed.claim_rows(root),
    *forget_train.claim_rows(root),
  ]


def claims_detail(root: Path = ROOT) -> str:
  """results/claims_detail.md: each claim beside everything the studies measured for it (long cells;
  docs/results.md shows it, the README's table has one short line per claim)."""
  lines = ["| claim (paper) | measured here (CPU scale; see each study's table) |", "|---|---|"]
  lines += [f"| {r.detail[0]} | {r.detail[1]} |" for r in claims_rows(root) if r.detail]
  return "\n".join(lines) + "\n"


ONE_RECIPE_CLAIMS = "results/one_recipe/claims.json"


def _cell(text: str) -> str:
  return " ".join(str(text).split()).replace("|", "\\|")


def claims_table(root: Path = ROOT, studies: bool = False, base: str = "") -> str:
  """results/claims.md, the README's claims table: one line per claim, its verdict and a link to the
  evidence. From `experiments.one_recipe`'s claims.json (one recipe, every claim on the same
  checkpoints) when it exists and judges at least one claim, else (or with `studies`) from the separate studies' results files, its
  links relative to `base` (the folder of the page that shows it; the repository root by default)."""
  path = root / ONE_RECIPE_CLAIMS
  recipe = json.loads(path.read_text()) if path.exists() and not studies else []
  rel = lambda link: os.path.relpath(link, base or ".")  # noqa: E731  (links from the page that shows it)
  if any(not str(c.get("verdict", "not run")).startswith("not run") for c in recipe):
    lines = [
      "The live-set claims are single attention heads (`experiments.live_sets`); every other claim is judged on the "
      "same checkpoints of one LM recipe, paired with FoX by seed (`python -m experiments.one_recipe`):",
      "",
      "| claim | verdict | evidence |",
      "|---|---|---|",
    ]
    lines += [f"| {r.claim} | {r.verdict} | [{_cell(r.evidence)}]({rel(r.link)}) |" for r in claims_rows(root)[:2]]
    for c in recipe:
      text = _cell(c.get("evidence") or "evidence")
      link = f"[{text}]({rel(c['link'])})" if c.get("link") else text
      lines.append(f"| LM recipe: {_cell(c['claim'])} | {_cell(c['verdict'])} | {link} |")
    for r in forget_screen.claim_rows(root):  # the recipe's checkpoint retrofitted to forget by content
      lines.append(f"| LM recipe, retrofit: {r.claim} | {r.verdict} | [{_cell(r.evidence)}]({rel(r.link)}) |")
    return "\n".join(lines) + "\n"
  lines = [
    "Each claim judged on every seed its study ran (paired with FoX of the same seed where it compares with FoX):",
    "",
    "| claim | verdict | evidence |",
    "|---|---|---|",
  ]
  lines += [f"| {r.claim} | {r.verdict} | [{_cell(r.evidence)}]({rel(r.link)}) |" for r in claims_rows(root)]
  return "\n".join(lines) + "\n"


def pages(root: Path = ROOT) -> list[Path]:
  """The markdown files whose results blocks `render` fills: README.md and every docs/**/*.md."""
  return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def main(argv=None) -> int:
  (ROOT / "results").mkdir(exist_ok=True)
  (ROOT / "results" / "claims.md").write_text(claims_table())
  (ROOT / "results" / "claims_studies.md").write_text(claims_table(studies=True, base="docs"))
  (ROOT / "results" / "claims_detail.md").write_text(claims_detail())
  dips = dips_limits_table()
  if dips is not None:
    (ROOT / "results" / "dips_limits.md").write_text(dips)
  pace = passkey.passkey_pace_table()
  if pace is not None:
    (ROOT / "results" / "passkey_pace.md").write_text(pace)
    passkey.pace_plot(ROOT / "results" / "passkey_pace.png")
  lengths = kv_lengths_table()
  if lengths is not None:
    (ROOT / "results" / "kv_lengths.md").write_text(lengths + "\n")
  for path in pages():
    if not path.exists():
      continue
    old = path.read_text()
    new = render(old)
    if new != old:
      path.write_text(new)
    name = path.relative_to(ROOT)
    print(f"{name}: {len(BLOCK.findall(new))} results blocks, {'updated' if new != old else 'unchanged'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
