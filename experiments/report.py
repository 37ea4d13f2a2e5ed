"""Regenerate the README's and docs' results from the files the studies wrote: no hand-typed numbers.

    python -m experiments.report

1. Writes results/claims.md, the README's claims table: one line per claim, its verdict and a link
   to the evidence. From the two-phase study (`experiments.two_phase.claim_rows`: the final recipe
   against FOX_BASELINE on committed models) once it has scored a final model, else from
   results/one_recipe/claims.json (`experiments.one_recipe`: every claim on
   the same checkpoints) when it exists and has judged a claim, else from the separate studies' results
   (results/{scopes,dips,passkey*,kv_compression*,perplexity*,bindings_lm,text_pareto,forget_speed}.json):
   every study exports its rows (`claim_rows`: live_sets, passkey, kv_compression, perplexity,
   bindings_lm, text_pareto, forget_speed, forget_train) and this script collects them, in the
   README's order; it reads no study's results schema of its own.
   A verdict holds only when it holds on every seed (paired with FoX of the same seed where the
   claim compares with FoX), else it says on how many: "k of n seeds", or "not met".
2. Writes results/claims_studies.md (the separate studies' table, for docs/results.md) and
   results/claims_detail.md (everything each study measured for each claim) and the tables collected
   across runs (dips_limits from `experiments.live_sets`, passkey_pace from `experiments.passkey`,
   kv_lengths from `experiments.kv_compression`).
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

from experiments import _common as U
from experiments import (
  bindings_lm,
  forget_screen,
  forget_speed,
  forget_train,
  kv_compression,
  live_sets,
  passkey,
  perplexity,
  retrieval_suite,
  text_pareto,
  two_phase,
)

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- (results/[\w./-]+\.md) -->\n)(.*?)(<!-- end \2 -->)", re.S)


def render(readme: str, root: Path = ROOT) -> str:
  def fill(m):
    src = root / m.group(2)
    body = src.read_text() if src.exists() else f"(not yet generated: run the script that writes {m.group(2)})\n"
    return m.group(1) + body + m.group(4)

  return BLOCK.sub(fill, readme)


# ---- the README's claims table: one line per claim, a verdict judged seed by seed ----------------


def claims_rows(root: Path = ROOT) -> list[U.ClaimRow]:
  """Every claim, in the README's order, as the studies export them (each study's `claim_rows`)."""
  ppl, evict_cost = perplexity.claim_rows(root)
  return [
    *live_sets.claim_rows(root),
    *passkey.claim_rows(root),
    *kv_compression.claim_rows(root),
    ppl,
    *bindings_lm.claim_rows(root),
    evict_cost,
    *text_pareto.claim_rows(root),
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
  final = [] if studies else two_phase.claim_rows(root)
  if final:  # the two-phase recipe against FoX with the same phases, on committed models
    lines = [
      "The live-set claims are single attention heads (`experiments.live_sets`); the LM claims are judged on the "
      "two-phase recipe's committed models against FoX with the same two phases, paired by seed "
      "(`python -m experiments.two_phase`); the nested bindings are their own study's models:",
      "",
      "| claim | verdict | evidence |",
      "|---|---|---|",
    ]
    rows = [*claims_rows(root)[:2], *final, *retrieval_suite.claim_rows(root), *bindings_lm.claim_rows(root)]
    rows += forget_screen.claim_rows(root)
    lines += [f"| {r.claim} | {r.verdict} | [{_cell(r.evidence)}]({rel(r.link)}) |" for r in rows]
    return "\n".join(lines) + "\n"
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
  dips = live_sets.dips_limits_table()
  if dips is not None:
    (ROOT / "results" / "dips_limits.md").write_text(dips)
  pace = passkey.passkey_pace_table()
  if pace is not None:
    (ROOT / "results" / "passkey_pace.md").write_text(pace)
    passkey.pace_plot(ROOT / "results" / "passkey_pace.png")
  lengths = kv_compression.kv_lengths_table()
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
