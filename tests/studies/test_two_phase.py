"""The two-phase study: its recipes, its verdicts (one rule per cell, nothing judged unscored), the
committed assets its results cite, and (slow) a tiny run of every phase that resumes."""

import json

import pytest

from experiments import _common as U
from experiments import two_phase as T
from experiments.recipes import FOX_BASELINE, RECOMMENDED, TwoPhase

TINY = [
  "--layers", "2", "--d-model", "16", "--heads", "2", "--block-size", "32", "--batch-size", "8", "--warmup", "1",
  "--train-len", "288", "--passkey-rows", "4", "--small-data",
]  # fmt: skip


def test_recipes_are_two_phases_of_the_same_retrofit():
  assert RECOMMENDED.pretrain == "recipe_fh0_no_objective" and FOX_BASELINE.pretrain == "fox"
  assert RECOMMENDED.retrofit == FOX_BASELINE.retrofit and RECOMMENDED.control == FOX_BASELINE.control == "control"
  with pytest.raises(ValueError, match="not a ONE_RECIPE method"):
    TwoPhase("x", "nope", "control")
  with pytest.raises(ValueError, match="not a SCREEN row"):
    TwoPhase("x", "fox", "nope")
  args = T.parse_args(["--data-dir", "d"])
  fs = T.screen_args(FOX_BASELINE, args)  # FoX's retrofit: its own screen dirs, FoX's source
  assert fs.source_method == "fox" and fs.runs_dir.endswith("runs/forget_screen_fox")
  assert T.screen_args(RECOMMENDED, args).runs_dir.endswith("runs/forget_screen")


def test_fox_retrofit_presses_fox_penalties():
  """The same retrofit settings on FoX's config (FoX is a case of the gate)."""
  from experiments import forget_screen as F

  fs = T.screen_args(FOX_BASELINE, T.parse_args(TINY))
  cfg = F.config(FOX_BASELINE.retrofit, fs, 0)
  assert cfg.attention == "fox" and cfg.evict_shared and cfg.distill_weight == 1.0 and cfg.evict_target == 0.25
  assert cfg.steps == fs.source_step + 600 and cfg.evict_ramp_start == fs.source_step


def _row(cache=None, bpb=2.0, full=1.0):
  return {"params": "p", "text": {"bpb": bpb}, "passkey": {"8": {"accuracy": full}}, "cache": cache or {}}


def _write(tmp_path, rows):
  for (name, role, seed), r in rows.items():
    U.write_json(
      tmp_path / "results" / "two_phase" / "eval" / f"{name}_{role}_s{seed}.json",
      r | {"recipe": name, "role": role, "seed": seed},
    )


def test_verdicts_need_every_comparison_scored_and_quote_one_rule_per_cell(tmp_path):
  F, X = RECOMMENDED.name, FOX_BASELINE.name
  fpa = {
    "fpa_budget/0.25": {"accuracy": 0.5},
    "fpa_global/0.25": {"accuracy": 1.0},
    "fpa_budget/0.125": {"accuracy": 0.97},
  }
  fpa |= {"fpa_global/0.125": {"accuracy": 0.9}, "fpa/tol": {"accuracy": 1.0, "kept_fraction_mean": 0.4}}
  _write(tmp_path, {(F, "final", 0): _row(fpa, 2.0), (F, "control", 0): _row(bpb=1.98), (X, "final", 0): _row({}, 2.1)})
  rows = T.claim_rows(tmp_path)
  claims = lambda words: next(r for r in rows if words in r.claim)  # noqa: E731
  assert claims("perplexity on par with FoX").verdict.startswith("holds")
  assert claims("perfect passkey at 8x (fu").verdict.startswith("holds")
  # the 25% cell quotes fpa_global's 1.00; the 12.5% one fpa_budget's 0.97, each a single rule's cell
  assert "fpa_global 1.00" in claims("passkey at 8x kept with th").evidence
  lead = claims("12.5% of the cache (>= 0.9")
  assert lead.verdict.startswith("not scored") and "heuristic" in lead.evidence  # FoX's rules, heuristics missing
  assert claims("the only compared method").verdict.startswith("not scored")
  assert claims("the retrofit's text cost").verdict == "not met (0 of 1 seeds); seeds 1, 2 not scored"
  assert "+1.01%" in claims("the retrofit's text cost").evidence
  assert "not met" in claims("the tolerance policy >= 0").verdict
  # scored: FoX's best rule and every heuristic 0.1 below fpa_budget's 0.97 -> the lead holds
  heur = {f"{h}/0.125": {"accuracy": 0.8} for h in ("window", "sink_window", "h2o", "snapkv")}
  _write(
    tmp_path,
    {(F, "final", 0): _row(fpa | heur, 2.0), (X, "final", 0): _row({"fpa_global/0.125": {"accuracy": 0.87}}, 2.1)},
  )
  lead = {r.claim[:60]: r for r in T.claim_rows(tmp_path)}
  lead = next(r for c, r in lead.items() if "12.5%" in c)
  assert lead.verdict.startswith("holds") and "fpa_budget 0.97" in lead.evidence and "fpa_global 0.87" in lead.evidence
  assert all(len(r.evidence) <= 400 for r in T.claim_rows(tmp_path))


def test_cells_score_the_strict_cell_first():
  args = T.parse_args([])
  keys = [k for k, _, _ in T.cells("final", args)]
  assert keys[: len(T.RULES)] == [f"{p}/0.125" for p in T.RULES] and keys[len(T.RULES)] == "fpa/tol"
  assert {f"{p}/{k:g}" for p in T.RULES for k in (0.125, 0.25, 0.5, 0.75)} | {"fpa/tol"} == set(keys)
  assert T.cells("control", args) == [] and T.cells("pretrained", args) == []


def test_every_result_cites_a_committed_asset_from_a_clean_tree():
  """Each eval file of the study scored a model a fresh clone has (its digest in digests.json, the folder
  committed with those parameters) from a committed tree."""
  from fpa_jax.inference import load_exported

  digests = T.committed_digests()
  rows = T.load(U.ROOT / "results" / "two_phase")
  for (name, role, seed), r in rows.items():
    key = f"{name}/{role}_s{seed}"
    assert digests.get(key) == r["params"], f"{key}: scored {r['params']}, committed {digests.get(key)}"
    assert not r["commit"].endswith("+dirty"), f"{key} was scored from an uncommitted tree"
  for key, digest in digests.items():
    name, role_seed = key.split("/")
    folder = U.ROOT / "experiments" / "assets" / "two_phase" / name / role_seed
    meta = json.loads((folder / "config.json").read_text())["meta"]
    assert meta["params"] == digest
  if digests:  # one load, not all: the digest of what the folder holds is the one recorded
    key, digest = sorted(digests.items())[0]
    model, _, _ = load_exported(U.ROOT / "experiments" / "assets" / "two_phase" / key)
    assert U.params_digest(model) == digest


@pytest.mark.slow
def test_tiny_two_phase_trains_exports_scores_and_resumes(tmp_path):
  argv = TINY + [
    "--root", str(tmp_path), "--data-dir", str(tmp_path / "data"), "--pretrain-steps", "2", "--retrofit-steps", "2",
    "--seeds", "0", "--n", "5", "--cache-multiple", "2", "--multiples", "1", "2", "--heldout-windows", "8",
    "--pos-docs", "2", "--cache-batch", "5", "--rules", "fpa_budget", "fpa_global", "window", "--calibration", "5",
  ]  # fmt: skip
  md = T.main(argv)
  digests = T.committed_digests(tmp_path)
  assert set(digests) == {f"{n}/{r}_s0" for n in ("fpa_recipe", "fox_recipe") for r in T.ROLES}
  assert (tmp_path / "experiments" / "assets" / "one_recipe" / "fox_s0" / "checkpoints" / "2").is_dir()
  final = json.loads((tmp_path / "results" / "two_phase" / "eval" / "fox_recipe_final_s0.json").read_text())
  assert final["params"] == digests["fox_recipe/final_s0"] and "fpa_global/0.125" in final["cache"]
  assert final["passkey"]["2"]["generated"]["prefill"] == "parallel"  # both scorers at the cache multiple
  assert {"fpa_heads/0.25", "fpa_heads/0.125"} <= set(final["cache"])  # the calibrated head budget
  split = tmp_path / final["cache"]["fpa_heads/0.125"]["split"]
  assert split.exists() and split.parent.name == "final_s0"  # saved with the model
  assert "`fox_recipe` final | 0 |" in md and "fpa (tolerance)" in md
  before = {p.name: p.read_text() for p in (tmp_path / "results" / "two_phase" / "eval").glob("*.json")}
  T.main(argv)  # all done: nothing retrained, re-exported or rescored
  assert {p.name: p.read_text() for p in (tmp_path / "results" / "two_phase" / "eval").glob("*.json")} == before
