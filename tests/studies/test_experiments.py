"""Benchmark and README tooling: tiny real runs, so the scripts cannot rot silently."""

from __future__ import annotations

import json
import re

import pytest

from experiments import _common as U
from experiments import bench_attention, kv_compression, live_sets, passkey, perplexity, report, text_pareto


@pytest.mark.slow
def test_bench_attention_tiny_run_writes_results(tmp_path):
  bench_attention.main(
    [
      "--seq-lens",
      "32",
      "--repeats",
      "1",
      "--methods",
      "fpa_chunked,fox_chunked,xla_dense_softmax",
      "--out-dir",
      str(tmp_path),
    ]
  )
  res = json.loads((tmp_path / "bench_attention.json").read_text())
  assert {r["method"] for r in res["rows"]} == {"fpa_chunked", "fox_chunked", "xla_dense_softmax"}
  for r in res["rows"]:
    assert r["fwd_s"] > 0 and r["fwdbwd_s"] > 0 and r["fwdbwd_temp_bytes"] is not None
  assert res["matmul_gflops"] > 0
  md = (tmp_path / "bench_attention.md").read_text()
  assert "| fpa_chunked | 32 |" in md and (tmp_path / "bench_attention.png").stat().st_size > 0


def test_bench_targets_are_ratios_of_measured_rows():
  rows = [
    {"method": "fpa_chunked", "T": 4096, "fwdbwd_s": 2.0, "fwd_s": 1.0},
    {"method": "xla_dense_softmax", "T": 4096, "fwdbwd_s": 4.0, "fwd_s": 1.0},
    {"method": "fox_chunked", "T": 4096, "fwdbwd_s": 1.0},
    {"method": "fpa_chunked", "T": 16384, "fwdbwd_temp_bytes": 16384 * 16384 * 4 // 8},
  ]
  t = bench_attention.targets(rows)
  assert t["fpa_chunked_fwdbwd_over_xla_dense_T4096"] == {"measured": 0.5, "target_max": 1.0, "met": True}
  assert t["fpa_chunked_fwdbwd_over_fox_chunked_T4096"]["met"] is False  # 2.0 > 1.25
  assert t["fpa_chunked_fwdbwd_temp_over_dense_TxT_fp32_T16384"]["measured"] == 1 / 8


def test_report_claims_table_reads_results(tmp_path):
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "scopes.json").write_text(
    json.dumps({"fpa": {"seeds": 5, "successes": 5}, "fox": {"seeds": 5, "successes": 0}, "meta": {}})
  )
  ppl = {"fpa": {"bpb": [2.0, 2.2]}, "fox": {"bpb": [2.0, 2.0]}, "recipe": {"steps": 300}, "meta": {}}
  (tmp_path / "results" / "perplexity.json").write_text(json.dumps(ppl))
  md = report.claims_detail(tmp_path)
  assert "fpa 5/5, fox 0/5" in md and "after 300 steps" in md and "fpa / fox = 1.050" in md
  assert "trained longer" not in md and "not run yet (`python -m experiments.passkey`)" in md
  # the longer run, passkey (competent or not at 1x) and both kv prefills join the same rows
  long = {"fox": {"bpb": [2.0]}, "fpa_fox5": {"bpb": [2.2]}, "recipe": {"steps": 1200}, "meta": {}}
  (tmp_path / "results" / "perplexity_T3000.json").write_text(json.dumps(long))
  pk = {
    "train_length": 64,
    "meta": {},
    "fpa": {"1": 0.9, "8": 0.8, "steps": 30, "competent_1x": True, "text_rows": "windows"},
    "fox": {"1": 0.0, "8": 0.0, "steps": 30, "competent_1x": False},  # trained before the text fix
  }
  (tmp_path / "results" / "passkey.json").write_text(json.dumps(pk))
  cell = lambda a, f=0.25: {"accuracy": a, "cache_fraction": f}  # noqa: E731
  kv = {
    "multiple": 8,
    "prefill": "parallel",
    "tolerance": 1e-3,
    "n_prompts": 20,
    "model_steps": {"fpa": [30, "windows", "abc"]},  # (steps, text rows, commit): trained after the text fix
    "cells": {
      "fpa/fpa_budget": {"0.25": cell(0.5), "0.125": cell(0.4, 0.125)},
      "fpa/fpa": {"tol": cell(0.9, 0.6)},
      "fpa/snapkv": {"0.5": cell(1.0, 0.5), "0.25": cell(0.3)},
    },
  }
  (tmp_path / "results" / "kv_compression.json").write_text(json.dumps(kv))
  (tmp_path / "results" / "kv_compression_decode").mkdir()
  # a bare step count: a model trained before the text fix
  dec = {
    **kv,
    "prefill": "decode",
    "n_prompts": 5,
    "cells": {"fpa/h2o": {"0.25": cell(0.8)}},
    "model_steps": {"fpa": 30},
  }
  (tmp_path / "results" / "kv_compression_decode" / "kv_compression.json").write_text(json.dumps(dec))
  md = report.claims_detail(tmp_path)
  assert "trained longer: held-out bits per byte after 1200 steps" in md and "fpa_fox5 / fox = 1.100" in md
  assert "fpa 0.80 (1x 0.90, 30 steps)" in md and "not competent at 1x" in md and "fox 0.00" not in md
  assert (
    "step budget (no retrieval to extrapolate): fox*;" in md and "\\* models trained before the text-pipeline" in md
  )
  assert "**fpa**: fpa ε=0.001 0.90 at 0.60 of the cache, fpa_budget 0.50 / 0.40, snapkv 0.30 / —" in md
  assert "(5 prompts per cell): exact match at 8x (prefill decode; budgets 25% / 12.5%): **fpa**: h2o 0.80 / —" in md
  assert md.count("trained before the text-pipeline fix: their fpa_text") == 2  # passkey's fox, the decode study
  assert "with 100 prompts per cell" not in md
  (tmp_path / "results" / "kv_compression_n100").mkdir()
  more = {**kv, "n_prompts": 100, "cells": {"fpa/fpa_budget": {"0.25": {**cell(0.99), "ci95": [0.95, 1.0]}}}}
  (tmp_path / "results" / "kv_compression_n100" / "kv_compression.json").write_text(json.dumps(more))
  assert "not run yet (`python -m experiments.bindings_lm`)" in md
  summary = {"multiple": 4, "fpa_full": 0.9, "fpa_rule": 0.895, "fpa_window": 0.5, "fpa_h2o": 0.85, "fox_full": 0.7}
  summary |= {"fpa_seeds": 3, "fpa_evict_full": 0.8, "fpa_evict_rule": 0.7, "fpa_evict_window": 0.4}
  summary |= {"fpa_evict_h2o": 0.5, "fpa_evict_seeds": 1}
  blm = {"fpa": {"evals": [{}, {}, {}]}, "fox": {"evals": [{}]}, "summary": summary, "meta": {}}
  (tmp_path / "results" / "bindings_lm.json").write_text(json.dumps(blm))
  md = report.claims_detail(tmp_path)
  assert (
    "(seeds: fpa 3, fox 1): `fpa` (3 seeds): the learned rule at 12.5% of the cache, 4x: 89.5 vs its full cache 90.0"
    in md
  )
  assert (
    "(0.5 points below; target: at most 1 below, holds); window 50.0, 39.5 points below the rule (target >= 10: holds)"
    in md
  )
  assert (
    "h2o 85.0, 4.5 points below the rule (target >= 10: NOT met); full cache vs FoX 70.0: ahead by 20.0 points" in md
  )
  assert (
    "`fpa_evict` (1 seeds): the learned rule at 12.5% of the cache, 4x: 70.0 vs its full cache 80.0 (10.0 points below"
    in md
  )
  assert (
    "with 100 prompts per cell (95% intervals): exact match at 8x (prefill parallel; budgets 25% / 12.5%): **fpa**: fpa_budget 0.99 [0.95, 1.00] / —"
    in md
  )


def test_update_readme_fills_marked_blocks(tmp_path):
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "x.md").write_text("| a | 1 |\n")
  text = (
    "head\n<!-- results/x.md -->\nstale\n<!-- end results/x.md -->\n<!-- results/y.md -->\n<!-- end results/y.md -->\n"
  )
  out = report.render(text, tmp_path)
  assert "| a | 1 |" in out and "stale" not in out and "not yet generated" in out
  assert report.render(out, tmp_path) == out  # idempotent


@pytest.mark.slow
def test_bench_decode_tiny_run_writes_results(tmp_path):
  from experiments import bench_decode

  out = bench_decode.main(["--config", "tiny", "--quick", "--batch", "2", "--out", str(tmp_path / "bench_decode")])
  rows = out["rows"]
  assert set(rows) == {f"{m}x/{p}" for m in (1, 2) for p in bench_decode.QUICK}
  assert rows["2x/fpa_budget"]["capacity"] == 20 and rows["2x/full"]["capacity"] == 80  # 25% of 64 + 16
  assert 0.2 < rows["2x/fpa_budget"]["cache_bytes_over_full"] < 0.3
  assert all(r["decode_ms_per_token"] > 0 for r in rows.values())
  assert "| 2x (64) | fpa_budget | 20 |" in (tmp_path / "bench_decode.md").read_text()


@pytest.mark.slow  # its library paths: test_prefix.py
def test_bench_prefix_tiny_run_writes_results(tmp_path):
  from experiments import bench_prefix

  res = bench_prefix.main(
    ["--config", "tiny", "--turns", "2", "--turn-tokens", "8", "--repeats", "1", "--out", str(tmp_path / "bp")]
  )
  assert len(res["reprefill"]["turn_ms"]) == 2 and res["methods"]["chunked_full"]["cache_bytes"] > 0
  from _tol import rtol

  # the same logits up to fp32 reduction order (tiny: d_model 32 x 2 layers; untrained logits are < 1)
  assert res["methods"]["chunked_full"]["last_turn_max_abs_diff_vs_reprefill"] <= rtol("float32", 64)
  assert "python -m experiments.bench_prefix --config tiny" in (tmp_path / "bp.md").read_text()


@pytest.mark.slow
def test_kv_compression_tiny_run(tmp_path, monkeypatch):
  """Train-free smoke run on a 1-step model: every requested cell written, reruns skip them."""
  from experiments import kv_compression
  from fpa_jax import configs as C
  from fpa_jax.train import train

  cfg = C.get_config("tiny", attention="fpa", task="synthetic", steps=1, warmup_steps=1, ckpt_every=1, vocab_size=259)
  train(cfg, workdir=str(tmp_path / "run"), progress=False, log=lambda s: None)
  (tmp_path / "passkey.json").write_text(json.dumps({"train_length": 40, "fpa": {"workdir": str(tmp_path / "run")}}))
  args = [
    "--passkey-results",
    str(tmp_path / "passkey.json"),
    "--depths",
    "50",
    "--n",
    "2",
    "--policies",
    "full",
    "fpa",
    "window",
    "fpa_global",
    "snapkv",  # parallel prefill only: skipped under the default decode prefill
    "--budgets",
    "0.25",
    "--out-dir",
    str(tmp_path),
  ]
  res = kv_compression.main(args)
  assert set(res["cells"]) == {"fpa/full", "fpa/fpa", "fpa/window", "fpa/fpa_global"}
  assert res["cells"]["fpa/window"]["0.25"]["cache_fraction"] <= 0.26
  assert res["cells"]["fpa/full"]["1"]["n"] == 2
  assert "| fpa |" in (tmp_path / "kv_compression.md").read_text()
  calls = []
  real = kv_compression.passkey_accuracy
  monkeypatch.setattr(kv_compression, "passkey_accuracy", lambda *a, **k: calls.append(k["policy"]) or real(*a, **k))
  again = kv_compression.main(args)  # nothing left to do: same cells, same numbers
  assert again["cells"] == res["cells"] and calls == []
  (tmp_path / "passkey.json").write_text(
    json.dumps({"train_length": 40, "fpa": {"workdir": str(tmp_path / "run"), "steps": 7}})
  )
  retrained = kv_compression.main(args)  # the model has more steps now: its cells are recomputed
  assert sorted(calls) == ["fpa", "fpa_global", "full", "window"] and retrained["model_steps"] == {
    "fpa": [7, None, None]
  }
  assert "base110m" in kv_compression.base110m_recipe()


@pytest.mark.slow  # a script's tiny run, with its retrofit run
def test_forget_speed_records_every_layer_and_rebuilds_with_skipping():
  import jax

  import numpy as np

  from experiments import forget_speed as F
  from fpa_jax import configs as C
  from fpa_jax.layers import FirstPassageAttention, with_gates
  from fpa_jax.models import build_model

  from _fwd import forward
  from _tol import assert_close

  gate = dict(step_init_std=0.3, absolute_init_std=0.3, offset_init_std=0.3)
  m = build_model(C.get_config("tiny", attention="fpa", block_size=8, n_layers=1, **gate), seed=0)
  tok = jax.random.randint(jax.random.key(0), (2, 24), 0, m.cfg.vocab_size)
  rec = F.record_attention_inputs(m, tok)
  assert len(rec) == m.cfg.n_layers and rec[0][0].shape == (2, 24, m.cfg.n_heads, m.cfg.head_dim)
  _, (field, level) = with_gates(m, tok)  # what the layers sow: the gates the kernel read
  assert_close(rec[0][3][0], field[0])
  assert_close(rec[0][3][1], level[0])
  per, every = F.tiles_dropped(rec, 0.9)
  assert 0.0 <= every <= per <= 1.0
  exact, skipping = F.with_skip(m, None), F.with_skip(m, 1e-3)
  assert skipping.cfg.skip_tolerance == 1e-3 and exact.cfg.skip_tolerance is None
  assert_close(forward(exact, tok), forward(m, tok), n=m.cfg.d_model * m.cfg.n_layers)  # the same parameters
  # the prefill without attention runs on a copy: the model keeps its layers
  bare = F.without_attention(exact)(tok)
  assert type(exact.blocks[0].attn) is FirstPassageAttention and not np.allclose(bare, forward(exact, tok))


def test_dips_limits_table_collects_the_variant_runs(tmp_path):
  """`live_sets.dips_limits_table`: the study's default FPA row, then one row per results/dips_limits/<variant>."""
  run = lambda cmd, d, steps, cov: {  # noqa: E731
    "fpa": {"coverage_1x": cov, "coverage_2x": cov, "successes_coverage": 1, "seeds": 2, "config": {"d_model": d, "n_heads": 1}},
    "meta": {"command": f"python -m experiments.live_sets {cmd}", "settings": {"steps": steps}},
  }  # fmt: skip
  (tmp_path / "results" / "dips_limits" / "d64").mkdir(parents=True)
  assert live_sets.dips_limits_table(tmp_path) is None  # nothing to compare yet
  (tmp_path / "results" / "dips.json").write_text(json.dumps(run("--task all", 16, 1500, [0.9, 0.92])))
  d64 = run("--set d_model=64", 64, 1500, [0.96, 0.94])
  d64["fox"] = {**d64["fpa"], "coverage_1x": [0.7, 0.7], "successes_coverage": 0}  # a variant's other heads
  (tmp_path / "results" / "dips_limits" / "d64" / "dips.json").write_text(json.dumps(d64))
  md = live_sets.dips_limits_table(tmp_path)
  assert "| default (study 1) | fpa | `--task all` | 16 | 1500 | 0.910 ± 0.010 | 0.910 ± 0.010 | 1/2 |" in md
  assert "| d64 | fpa | `--set d_model=64` | 64 | 1500 | 0.950 ± 0.010 |" in md
  assert "| d64 | fox | `--set d_model=64` | 64 | 1500 | 0.700 ± 0.000 | 0.950 ± 0.010 | 0/2 |" in md
  for m in ("fpa", "fox"):
    d64[m]["successes"] = d64[m]["successes_coverage"]
  (tmp_path / "results" / "dips_limits" / "d64" / "dips.json").write_text(json.dumps(d64))
  assert "; with head dim 64 and 1500 steps (`d64`): fpa 1/2, fox 0/2 |" in report.claims_detail(tmp_path)


def test_perplexity_evict_cost_claim_is_paired_by_seed():
  res = {"fpa_lm": {"seeds": [0, 1, 2], "bpb": [2.0, 2.0, 1.0]}, "fpa_lm_evict": {"seeds": [2, 0], "bpb": [1.01, 2.0]}}
  assert "+0.50% (+1.00%, +0.00%; holds)" in perplexity.evict_cost_claim(
    res
  )  # seed 2 against seed 2, seed 0 against seed 0
  res["fpa_lm_evict"]["bpb"] = [1.03, 2.02]
  assert "+2.00% (+3.00%, +1.00%; NOT met)" in perplexity.evict_cost_claim(res)
  assert perplexity.evict_cost_claim({"fpa_lm": res["fpa_lm"]}) == ""


@pytest.mark.parametrize("att", ["fpa", pytest.param("fox", marks=pytest.mark.slow)])
def test_needle_penalty_reads_every_layer_and_head(att):
  from experiments import needle_penalty as N
  from fpa_jax import configs as C
  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.models import build_model

  m = build_model(C.get_config("tiny", attention=att, block_size=16, vocab_size=259), seed=0)
  exs = passkey_eval_examples(320, 1, 50, n=1, seed=0)
  stats = N.needle_stats(m, exs)
  assert [(s["layer"], s["head"]) for s in stats] == [
    (li, h) for li in range(m.cfg.n_layers) for h in range(m.cfg.kv_heads)
  ]
  assert all(0.0 <= s["needle_penalty"] and 0.0 <= s["needle_mass"] <= 1.0 for s in stats)
  assert all(0.0 < s["passkey_rank"] <= 1.0 for s in stats)


@pytest.mark.slow  # its column: test_forget_screen.py (split_words)
def test_global_split_accounts_for_fpa_global_budget_per_head():
  """Where fpa_global's budget goes after the prefill: every (layer, kv head), shares that sum to at
  most the budget over the heads, and a budget of the whole prompt keeps every head's copy."""
  from experiments import needle_penalty as N
  from fpa_jax import configs as C
  from fpa_jax.data import passkey_eval_examples
  from fpa_jax.models import build_model

  m = build_model(C.get_config("tiny", block_size=16, vocab_size=259), seed=0)
  exs = passkey_eval_examples(320, 1, 50, n=2, seed=0)
  heads = m.cfg.n_layers * m.cfg.kv_heads
  small = N.global_split(m, exs, 0.25)
  assert [(r["layer"], r["head"]) for r in small] == [
    (li, h) for li in range(m.cfg.n_layers) for h in range(m.cfg.kv_heads)
  ]
  assert 0 < sum(r["held"] for r in small) <= 0.25 * heads + 1e-6
  whole = N.global_split(m, exs, 1.0)
  assert all(r["copy_held"] == 1.0 for r in whole) and sum(r["held"] for r in whole) > sum(r["held"] for r in small)


def test_kept_rank_keeps_a_whole_copy_smallest_penalty_first():
  import numpy as np

  from experiments.needle_penalty import kept_rank, passkey_copies

  pen = np.asarray([0.0, 0.0, 1.0, 0.0, 2.0])
  c = lambda *js: np.asarray(js)
  assert kept_rank(pen, [c(3)]) == 0.2 and kept_rank(pen, [c(1)]) == 0.4  # key 3, the newer tie, comes first
  assert kept_rank(pen, [c(2)]) == 0.8  # after the three live keys
  assert kept_rank(pen, [c(1, 2)]) == 0.8 and kept_rank(pen, [c(1, 2), c(0, 3)]) == 0.6  # a whole copy
  assert kept_rank(pen, [c(4)]) == 1.0
  toks = [5, 7, 1, 2, 9, 1, 2, 8, 1, 2, 0]  # the answer [1, 2] twice in the needle (from 1), once more after
  e = {"tokens": toks, "needle_start": 1, "answer_start": 8}
  assert [list(x) for x in passkey_copies(e, qpos=7)] == [[2, 3], [5, 6]]


def test_passkey_pace_pairs_fpa_with_fox_by_seed(tmp_path):
  """results/passkey_pace.md: each method's first competent stage per seed; FPA rows only from the
  shared-init runs, FoX from any run of the recipe; a seed counts when FPA is no later than FoX."""
  tag = lambda s: {"tag": f"L512_l2d128_b8p6_w100_pw1_lr0.002_m1_s{s}", "seed": s, "competence": 0.99}  # noqa: E731
  hist = lambda *xs: {str(300 * (i + 1)): {"exact": x, "digits": x} for i, x in enumerate(xs)}  # noqa: E731
  docs = {
    "passkey": {"recipe": tag(0), "fox_b5": {"val_history": hist(0.5, 1.0)}, "fpa_lm5": {"val_history": hist(1.0)}},
    "passkey_shared_init/passkey": {"recipe": tag(0), "fpa_lm5": {"val_history": hist(0.2, 0.99)}},
    "passkey_shared_init_seed1/passkey": {
      "recipe": tag(1),
      "fox_b5": {"val_history": hist(0.1, 0.5, 0.98)},
      "fpa_lm5": {"val_history": hist(0.9, 0.95, 0.9)},
    },
    "passkey_other/passkey": {"recipe": {**tag(0), "tag": "L64_other_s0"}, "fox_b5": {"val_history": hist(1.0)}},
  }
  (tmp_path / "results").mkdir()
  assert passkey.passkey_pace_table(tmp_path) is None
  for name, doc in docs.items():
    (tmp_path / "results" / f"{name}.json").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "results" / f"{name}.json").write_text(json.dumps(doc))
  md = passkey.passkey_pace_table(tmp_path)
  # fpa_lm5 of results/passkey (before the side stream) is left out; the other recipe's run too
  # the last column: stages 300..900 (FoX's longest run), a run stopped at competence keeps its last
  # value: FoX (.5, 1, 1) and (.1, .5, .98); fpa_lm5 (.2, .99, .99) and (.9, .95, .9)
  fox0, fox1, fpa0, fpa1 = 2.5 / 3, 1.58 / 3, 2.18 / 3, 2.75 / 3
  assert f"| `fox_b5` | 600 | not in 900 (best 0.980 at 900) | — | {(fox0 + fox1) / 2:.3f} |" in md
  # seed 0: 600 <= 600; seed 1: FoX never competent, FPA neither: not counted
  gap = (fpa0 - fox0 + fpa1 - fox1) / 2
  assert f"| `fpa_lm5` | 600 | not in 900 (best 0.950 at 600) | 1/2 | {(fpa0 + fpa1) / 2:.3f} ({gap:+.3f}) |" in md
  # the verdict, seed by seed: competent no later than FoX of the same seed (within FoX's steps where
  # FoX never was) and >= 0.99 at 8x; no best seed against best seed
  assert passkey.passkey_seeds(tmp_path, "fpa_lm5") == {0: False, 1: False}  # no 8x score yet

  def write(**changes):
    for name, kw in changes.items():
      for m, fields in kw.items():
        docs[name][m] |= fields
      (tmp_path / "results" / f"{name}.json").write_text(json.dumps(docs[name]))

  shared0, seed1 = "passkey_shared_init/passkey", "passkey_shared_init_seed1/passkey"
  write(**{shared0: {"fpa_lm5": {"8": 1.0}}})
  assert passkey.passkey_seeds(tmp_path, "fpa_lm5") == {0: True, 1: False}
  assert U.seed_verdict(list(passkey.passkey_seeds(tmp_path, "fpa_lm5").values())) == "1 of 2 seeds"
  write(**{seed1: {"fpa_lm5": {"val_history": hist(0.9, 0.95, 0.99), "8": 1.0}}})  # at 900: FoX's 900 steps
  assert passkey.passkey_seeds(tmp_path, "fpa_lm5") == {0: True, 1: True}
  write(**{shared0: {"fpa_lm5": {"8": 0.95}}})  # competent in time, but not at 8x
  assert passkey.passkey_seeds(tmp_path, "fpa_lm5") == {0: False, 1: True}
  passkey.pace_plot(tmp_path / "results" / "passkey_pace.png", tmp_path)
  assert (tmp_path / "results" / "passkey_pace.png").stat().st_size > 0


def test_write_prefixed_and_write_study_write_every_file(tmp_path, capsys):
  """`--out results/x` studies write x.json and x.md (one trailing newline) and print the markdown;
  `write_study` writes name.json, name.md and name.png under a folder."""
  U.write_prefixed(tmp_path / "x", {"a": 1.5}, "| t |")
  assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1.5}
  assert (tmp_path / "x.md").read_text() == "| t |\n" and "| t |" in capsys.readouterr().out
  U.write_prefixed(str(tmp_path / "y"), {}, "done\n")
  assert (tmp_path / "y.md").read_text() == "done\n"
  U.write_study(tmp_path, "s", {"v": [1]}, lambda r: f"v={r['v']}\n", lambda r, p: p.write_bytes(b"png"))
  assert json.loads((tmp_path / "s.json").read_text()) == {"v": [1]}
  assert (tmp_path / "s.md").read_text() == "v=[1]\n" and (tmp_path / "s.png").read_bytes() == b"png"


def test_seed_verdicts_count_seeds():
  """The one wording of a verdict, which report.py and one_recipe.py both call."""
  assert U.seed_verdict([True, True, True]) == "holds (3 of 3 seeds)"
  assert U.seed_verdict([True]) == "holds (1 of 1 seed)"
  assert U.seed_verdict([True, False, True]) == "2 of 3 seeds"
  assert U.seed_verdict([False, False]) == "not met (0 of 2 seeds)"
  assert U.seed_verdict([]) == "not run"


def test_report_claims_table_one_line_per_claim(tmp_path):
  """The README's table: one row per claim (claim | verdict | evidence link), from one_recipe's
  claims.json when it has judged a claim, else from the studies' files; no tracker numbers in it."""
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "scopes.json").write_text(
    json.dumps({
      "fpa": {"seeds": 2, "seed_ids": [0, 1], **{k: [0.99, 0.99] for k in live_sets.LIVE_KEYS}},
      "fox": {"seeds": 2, "seed_ids": [0, 1], **{k: [0.99, 0.5] for k in live_sets.LIVE_KEYS}},
      "meta": {},
    })
  )  # fmt: skip
  md = report.claims_table(tmp_path)
  rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| claim")]
  assert len(rows) == len(report.claims_rows(tmp_path)) and all(ln.count(" | ") == 2 for ln in rows)
  assert (
    "| 1 of 2 seeds | [seeds succeeding: fpa 2/2, fox 1/2](docs/results/live_sets.md) |" in rows[0]
  )  # seed 0: FoX too
  assert "| not run | [`python -m experiments.passkey`](docs/results/passkey.md) |" in md
  assert "](results/live_sets.md)" in report.claims_table(tmp_path, studies=True, base="docs")  # links from docs/
  out = tmp_path / "results" / "one_recipe"
  out.mkdir()
  claims = [
    {"claim": "passkey at 8x", "target": ">= 0.99", "verdict": "not run", "evidence": "", "link": "results/one_recipe/one_recipe.md"},
  ]  # fmt: skip
  (out / "claims.json").write_text(json.dumps(claims))
  assert report.claims_table(tmp_path) == md  # nothing judged yet: the studies' table stays
  claims += [
    {"claim": "perplexity | on par", "target": "<= 2%", "verdict": "2 of 3 seeds", "evidence": "seed 0: +0.1%", "link": "results/one_recipe/one_recipe.md"},
  ]  # fmt: skip
  (out / "claims.json").write_text(json.dumps(claims))
  md = report.claims_table(tmp_path)
  assert "| LM recipe: passkey at 8x | not run | [evidence](results/one_recipe/one_recipe.md) |" in md
  assert "| LM recipe: perplexity \\| on par | 2 of 3 seeds | [seed 0: +0.1%](results/one_recipe/one_recipe.md) |" in md
  rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
  assert len(rows) == 1 + 2 + len(claims) and "fpa 2/2, fox 1/2" in rows[1]  # the live-set claims stay, first
  assert report.claims_table(tmp_path, studies=True) != md
  for text in (md, report.claims_table(tmp_path, studies=True), report.claims_detail(tmp_path)):
    assert not re.search(r"\bissues?[\s_-]*#?\d+", text, re.I), text
  # once the two-phase study scored a final model, its rows replace the one-recipe study's
  U.write_json(
    tmp_path / "results" / "two_phase" / "eval" / "fpa_recipe_final_s0.json",
    {"recipe": "fpa_recipe", "role": "final", "seed": 0, "params": "p", "passkey": {"8": {"accuracy": 1.0}}},
  )
  md = report.claims_table(tmp_path)
  assert (
    "LM recipe:" not in md
    and "| two-phase recipe: perfect passkey at 8x (full cache >= 0.99) | holds (1 of 1 seed); seeds 1, 2 not scored |"
    in md
  )
  assert (
    "| two-phase recipe: perplexity on par with FoX (bits per byte <= FOX_BASELINE's) | not scored (seeds 0, 1, 2) |"
    in md
  )


def test_report_collects_the_claim_rows_each_study_exports(tmp_path):
  """report.py reads no study's results schema of its own: every study exports its rows
  (`claim_rows`) and report.py collects them, in the README's order; with nothing run every row says so."""
  from experiments import bindings_lm, forget_speed, forget_train

  rows = report.claims_rows(tmp_path)
  ppl, evict_cost = perplexity.claim_rows(tmp_path)
  exported = [
    *live_sets.claim_rows(tmp_path),
    *passkey.claim_rows(tmp_path),
    *kv_compression.claim_rows(tmp_path),
    ppl,
    *bindings_lm.claim_rows(tmp_path),
    evict_cost,
    *text_pareto.claim_rows(tmp_path),
    *forget_speed.claim_rows(tmp_path),
    *forget_train.claim_rows(tmp_path),
  ]
  assert len(rows) == 10 and rows == exported
  report_src = (U.ROOT / "experiments" / "report.py").read_text()
  assert "load_result" not in report_src  # no results file read but through a study's claim_rows
  assert all(r.verdict == "not run" for r in rows) and all(r.link.startswith("docs/results/") for r in rows)
  detail = report.claims_detail(tmp_path).splitlines()[2:]
  assert [ln.split(" | ")[0][2:] for ln in detail] == [r.detail[0] for r in rows if r.detail]


def test_report_renders_readme_and_docs(tmp_path):
  """`python -m experiments.report` fills the results blocks of README.md and every docs/**/*.md."""
  (tmp_path / "docs" / "results").mkdir(parents=True)
  (tmp_path / "README.md").touch()
  (tmp_path / "docs" / "results" / "study.md").touch()
  assert report.pages(tmp_path) == [tmp_path / "README.md", tmp_path / "docs" / "results" / "study.md"]


@pytest.mark.slow  # its tables: the summary test
def test_forget_train_tiny_run_resumes_and_reports(tmp_path):
  """Two paired trainings (exact, keys) from one init on the same batches: the same losses up to the
  key-sparse bound, probes and step times logged, a rerun with more steps resumes both."""
  from experiments import forget_train as FT

  args = [
    "--seq-len", "64", "--batch-size", "8", "--layers", "1", "--d-model", "32", "--heads", "2",
    "--block-size", "16", "--warmup", "1", "--ramp-start", "1", "--ramp-steps", "2", "--probe-every", "2",
    "--ckpt-every", "2", "--repeats", "1", "--skip-first", "0", "--window", "2", "--small-data",
    "--data-dir", str(tmp_path / "data"), "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "ft"),
  ]  # fmt: skip
  res = FT.main(["--steps", "2", *args])
  assert [s["step"] for s in res["steps"]] == [1, 2] and [p["step"] for p in res["probes"]] == [2]
  assert res["steps"][0]["loss_exact"] == res["steps"][0]["loss_keys"]  # one init, one batch
  res = FT.main(["--steps", "4", *args])  # resumes both from step 2
  assert [s["step"] for s in res["steps"]] == [1, 2, 3, 4] and len(res["sessions"]) == 2
  s = res["summary"]
  assert s["loss_gap_max_abs"] < 1e-2 and len(s["windows"]) == 2
  p = s["probes"][-1]
  assert 0 <= p["keys_kept"] <= p["keys_read"] <= 1 and p["attention_speedup"] > 0
  md = (tmp_path / "ft.md").read_text()
  assert "python -m experiments.forget_train --steps 4" in md and (tmp_path / "ft.png").exists()


def test_forget_train_summary_pairs_steps_and_probes():
  """Step-time windows (exact / keys medians), the paired loss gap against the loss's own noise, probes."""
  from experiments import forget_train as FT

  steps = [
    {"step": i, "step_s_exact": 1.0, "step_s_keys": 0.5 if i > 3 else 1.0, "loss_exact": 3.0 - 0.1 * i,
     "loss_keys": 3.0 - 0.1 * i + (0.01 if i == 5 else 0.0)}
    for i in range(1, 8)
  ]  # fmt: skip
  log = {
    "steps": steps,
    "probes": [{"step": 7, "keys_kept": 0.1, "keys_read": 0.2, "attention_fwd_bwd_s": {"exact": 1.0, "keys": 0.25}}],
  }
  s = FT.summarise(log, skip_first=1, window=3)
  assert [w["steps"] for w in s["windows"]] == ["2-4", "5-7"]
  assert [w["step_speedup"] for w in s["windows"]] == [1.0, 2.0]  # medians: the compile step left out
  assert abs(s["loss_gap_max_abs"] - 0.01) < 1e-9 and s["loss_step_noise"] < 0.01
  assert s["probes"][0]["attention_speedup"] == 4.0


@pytest.mark.slow
def test_forget_speed_workdirs_schedules_and_profile(tmp_path):
  """Trainer workdirs: the key-sparse schedules side by side, and the prefill's profile (without
  attention, the bound alone, half-block chunks) with its Amdahl cap."""
  from experiments import forget_speed as F
  from fpa_jax import configs as C
  from fpa_jax.train import train

  gate = dict(step_init_std=0.3, absolute_init_std=0.3, offset_init_std=0.3)
  cfg = C.get_config(
    "tiny",
    attention="fpa",
    task="synthetic",
    steps=1,
    warmup_steps=1,
    ckpt_every=1,
    vocab_size=259,
    block_size=16,
    **gate,
  )
  train(cfg, workdir=str(tmp_path / "run"), progress=False, log=lambda s: None)
  out = str(tmp_path / "fs")
  res = F.main(["--workdirs", f"tiny={tmp_path / 'run'}", "--train-length", "256", "--multiple", "1", "--batch", "2",
                "--tolerances", "0.5", "--repeats", "1", "--out", out])  # fmt: skip
  v = res["reads_rows"]["tiny"]["0.5"]
  assert 0 <= v["keys_kept_per_head"] <= v["keys_read_per_head"] <= 1
  assert v["keys_kept_per_head"] <= v["keys_read_per_head_half_chunk"] <= v["keys_read_per_head"]
  for n in ("attention_s_bound", "attention_s_keys_per_head_half", "prefill_s_no_attention"):
    assert v[n] > 0
  assert F._cap(v) >= 1.0
  md = open(out + ".md").read()
  assert "Where the key-sparse prefill's time goes" in md and "| tiny | 0.5 |" in md
  assert "- `tiny`: `python -m experiments.forget_speed --workdirs" in md  # each row names its run


def test_bench_compile_measures_the_suites_own_flags():
  """The benchmark's "tests" flag set is what conftest.py compiles the suite with, and its verdict
  reads the loss and every gradient leaf at one scale (a leaf of rounding noise cannot dominate)."""
  import conftest
  from experiments import bench_compile as B

  ours = {f for f in conftest.TEST_XLA_FLAGS.split() if "device_count" not in f}
  assert set(B.FLAG_SETS["level 0, no fusion emitters (tests)"].split()) == ours
  base = {"loss": 2.0, "grads": [[1.0, -0.5], [1e-9]]}
  noisy = {"loss": 2.0, "grads": [[1.0, -0.5], [3e-9]]}  # the tiny leaf off by 200% of itself
  assert B.largest_difference(noisy, base) == pytest.approx(2e-9)
  worse = {"loss": 2.2, "grads": [[1.0, -0.3], [1e-9]]}
  assert B.largest_difference(worse, base) == pytest.approx(0.2)
  timing = {"grad_compile_s": 4.0, "forward_compile_s": 1.0, "grad_run_s": 0.01, "forward_run_s": 0.005}
  runs = {name: [{**base, **timing}] for name in B.FLAG_SETS}
  runs["default"] = [{**base, **timing, "grad_compile_s": 16.0}, {**base, **timing, "grad_compile_s": 20.0}]
  out = B.summarise(runs)
  assert out["default"]["grad_compile_s"] == 16.0  # best of the repeats
  assert out["level 0"]["grad_compile_vs_default"] == pytest.approx(0.25)


@pytest.mark.slow  # its functions: test_bench_compile_measures_the_suites_own_flags
def test_bench_compile_tiny_run_writes_results(tmp_path):
  from experiments import bench_compile

  res = bench_compile.main(["--repeats", "1", "--seq-len", "12", "--out", str(tmp_path / "bc")])
  assert set(res["flag_sets"]) == set(bench_compile.FLAG_SETS)
  for row in res["flag_sets"].values():
    assert row["grad_compile_s"] > 0 and row["max_rel_difference"] < 1e-4  # other machine code, same program
  assert "python -m experiments.bench_compile --repeats 1" in (tmp_path / "bc.md").read_text()
