"""Studies 2 (passkey) and 4 (perplexity): tiny end-to-end runs of the scripts, the passkey data
mix, and teacher-forced greedy exact match against an explicit greedy decoding loop."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import passkey, perplexity
from fpa_jax.configs import get_config
from fpa_jax.models import build_model


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("attention", [pytest.param("fox", marks=pytest.mark.slow), "fpa"])
def test_teacher_forced_exact_match_is_greedy_decoding(attention):
  # A random model with large weights: its greedy continuations depend on the context.
  model = build_model(get_config("tiny", attention=attention, vocab_size=32, init_std=0.5), seed=1)
  predict = passkey.argmax_fn(model)
  rng = np.random.default_rng(0)
  exs, want, greedy = [], [], []
  for i in range(2):
    prompt = rng.integers(3, 32, size=12 + 3 * i).astype(np.int32)
    g = passkey.greedy_decode(model, prompt, 4, pad_to=40)  # [4]
    for k in (None, 0, 2):  # the greedy answer itself, and with answer token k changed
      ans = g.copy()
      if k is not None:
        ans[k] = (ans[k] + 1) % 32
      exs.append({"tokens": np.asarray([*prompt, *ans, 2], np.int32), "answer_start": len(prompt)})
      want.append(k is None)
      greedy.append((g, k))
  for length in (None, 40):  # right padding never changes the answer positions (causal model)
    ok, preds = passkey.teacher_forced_exact_match(predict, exs, length=length, batch_size=4)
    assert ok.tolist() == want
    for p, (g, k) in zip(preds, greedy):
      # Teacher forcing sees the true answer prefix: it follows greedy up to the first changed token.
      n = len(g) if k is None else k + 1
      np.testing.assert_array_equal(p[:n], g[:n])


def test_passkey_mix_weights_and_exact_resume(data_dir):
  kw = dict(data_dir=data_dir, seq_len=288, batch_size=3, n_passkey=2, answer_weight=7.0, prompt_weight=0.5, small=True)
  mix = passkey.PasskeyTextMix(**kw)
  b = next(mix)
  assert b["inputs"].shape == (3, 288) and b["loss_mask"].dtype == np.float32
  for r in range(2):  # passkey rows: the answer " ddddd" (6 tokens) weighted, the rest of the prompt at 0.5
    m = b["loss_mask"][r]
    assert (m == 7.0).sum() == 6 and set(np.unique(m)) <= {0.0, 0.5, 7.0}
    ans = b["targets"][r][m == 7.0]
    assert bytes((ans - 3).tolist()).decode()[0] == " " and bytes((ans - 3).tolist()).decode()[1:].isdigit()
  assert set(np.unique(b["loss_mask"][2])) <= {0.0, 1.0}  # text row
  state = json.loads(json.dumps(mix.get_state()))
  want = [next(mix) for _ in range(2)]
  again = passkey.PasskeyTextMix(**kw)
  again.set_state(state)
  for a, c in zip(want, (next(again) for _ in range(2))):
    for k in a:
      np.testing.assert_array_equal(a[k], c[k])


# batch 8: the suite simulates 8 CPU devices (conftest), and the trainer shards the batch over all.
# --warmup 1: a warmup longer than the 2-step schedule is a config error (configs.TrainConfig.validate)
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--block-size", "32", "--batch-size", "8", "--warmup", "1"]


def _tiny_passkey_argv(tmp_path, data_dir, methods):
  return [
    "--methods",
    *methods,
    "--train-len",
    "288",
    *TINY,
    "--passkey-rows",
    "4",
    "--max-steps",
    "2",
    "--stage-steps",
    "2",
    "--n-val",
    "5",
    "--n-eval",
    "5",
    "--multiples",
    "1",
    "--data-dir",
    data_dir,
    "--small-data",
    "--runs-dir",
    str(tmp_path / "runs"),
    "--out-dir",
    str(tmp_path / "out"),
  ]


@pytest.mark.slow
def test_passkey_script_tiny_run(tmp_path, data_dir):
  argv = _tiny_passkey_argv(tmp_path, data_dir, ["fox"])
  res = passkey.main(argv)
  saved = json.loads((tmp_path / "out" / "passkey.json").read_text())
  assert saved["train_length"] == 288 and saved["fox"]["steps"] == 2
  e = saved["fox"]
  assert (
    0 <= e["1"] <= 1 and e["2"] is None and e["8"] is None and set(e["by_depth"]["1"]) == {"0", "25", "50", "75", "100"}
  )
  assert e["workdir"].startswith(str(tmp_path / "runs")) and e["train_wall_s"] > 0 and "val_history" in e
  assert saved["meta"]["commit"] and saved["meta"]["command"].startswith("python -m experiments.passkey")
  assert "| fox | 2 |" in (tmp_path / "out" / "passkey.md").read_text()
  assert (tmp_path / "out" / "passkey_fox.png").stat().st_size > 0
  assert res["fox"]["1"] == e["1"]
  # Rerunning resumes from the checkpoints: no training, same numbers.
  again = passkey.main(argv)
  assert again["fox"]["1"] == e["1"] and again["fox"]["sessions"] == e["sessions"]
  # A cooldown stage continues the same run: 2 more steps with the lr decaying to 0, scored at 1x.
  cooled = passkey.main(argv + ["--cooldown-steps", "2"])["fox"]
  assert (
    cooled["steps"] == 4
    and cooled["cooldown_steps"] == 2
    and cooled["sessions"][-1] == {"from": 2, "to": 4, "wall_s": cooled["sessions"][-1]["wall_s"]}
  )
  assert cooled["val_history"][4]["cooldown"] == 2
  assert "4 (lr cooled to 0):" in (tmp_path / "out" / "passkey.md").read_text()


def test_passkey_retrofit_needs_its_trained_source(tmp_path, data_dir):
  with pytest.raises(SystemExit, match="fpa_fox5_evict continues fpa_fox5's trained run: train it first"):
    passkey.main(_tiny_passkey_argv(tmp_path, data_dir, ["fpa_fox5_evict"]))


@pytest.mark.slow
def test_passkey_retrofit_continues_the_source_run(tmp_path, data_dir):
  # --competence 0: the 2-step source counts as trained; the retrofit then continues it 2 steps with
  # the evictability objective, its target ramped from the source's last step.
  argv = _tiny_passkey_argv(tmp_path, data_dir, ["fpa_fox5", "fpa_fox5_evict"]) + ["--competence", "0"]
  res = passkey.main(argv + ["--retrofit-steps", "2"])
  src, ret = res["fpa_fox5"], res["fpa_fox5_evict"]
  assert src["steps"] == 2 and ret["steps"] == 4 and ret["retrofit_of"] == "fpa_fox5" and ret["retrofit_from_step"] == 2
  assert ret["sessions"] == [{"from": 2, "to": 4, "wall_s": ret["sessions"][0]["wall_s"]}]  # resumed, not restarted
  assert ret["config"]["evict_weight"] == 1.0 and ret["config"]["evict_ramp_start"] == 2
  # a rerun resumes the seeded continuation (no training, the same start), whatever the source has now
  again = passkey.main(argv + ["--retrofit-steps", "2"])["fpa_fox5_evict"]
  assert again["sessions"] == ret["sessions"] and again["retrofit_from_step"] == 2 and again["steps"] == 4
  logged = lambda e: [json.loads(line) for line in open(f"{e['workdir']}/metrics.jsonl")]
  assert any("evict_loss" in r for r in logged(ret)) and not any("evict_loss" in r for r in logged(src))
  # ... and the speed study reads both from that results file
  from experiments import forget_speed

  out = str(tmp_path / "out" / "forget_speed")
  fs = forget_speed.main(
    ["--passkey-results", str(tmp_path / "out" / "passkey.json"), "--multiple", "1", "--batch", "2"]
    + ["--models", "fpa_fox5_evict", "fpa_fox5"]
    + ["--tolerances", "0.5", "--repeats", "1", "--out", out]
  )
  cell = fs["rows"]["fpa_fox5_evict"]["tolerances"]["0.5"]
  assert 0 <= cell["tiles_dropped_all_heads"] <= cell["tiles_dropped_per_head"] <= 1 and cell["prefill_s_keys"] > 0
  assert 0 <= cell["keys_kept_per_head"] <= cell["keys_read"] <= 1 and cell["exact_match_keys"] >= 0
  assert "| fpa_fox5 | 0.5 |" in open(out + ".md").read()
  # ... and the text-cost study
  from experiments import evict_cost

  out = str(tmp_path / "out" / "evict_cost")
  ec = evict_cost.main(
    ["--passkey-results", str(tmp_path / "out" / "passkey.json"), "--models", "fpa_fox5", "fpa_fox5_evict"]
    + ["--multiples", "1", "--rows", "2", "--out", out]
  )
  assert set(ec["cells"]) == {"fpa_fox5/1x", "fpa_fox5_evict/1x"} and ec["cells"]["fpa_fox5_evict/1x"]["nll_mean"] > 0
  assert "| fpa_fox5_evict | 4 |" in open(out + ".md").read()


@pytest.mark.slow
def test_perplexity_script_tiny_run(tmp_path, data_dir, monkeypatch):
  argv = [
    "--methods",
    "fox",
    "--seeds",
    "0",
    "--train-len",
    "32",
    *TINY,
    "--steps",
    "2",
    "--heldout-windows",
    "6",
    "--eval-batch",
    "4",
    "--pos-docs",
    "2",
    "--pos-bucket",
    "32",
    "--data-dir",
    data_dir,
    "--small-data",
    "--runs-dir",
    str(tmp_path / "runs"),
    "--out-dir",
    str(tmp_path / "out"),
  ]
  res = perplexity.main(argv)
  e = res["fox"]
  assert len(e["bpb"]) == 1 and 0 < e["bpb"][0] < 10 and len(e["by_position"]) == 8  # 8L / bucket
  assert res["summary"]["fox"]["vs_fox"] == 0.0 and res["meta"]["machine"]["cpu_count"]
  cov = res["heldout"]  # the held-out set spans every validation document of the split
  assert cov["windows"] == 6 and cov["docs_covered"] == cov["docs_in_split"] and cov["bytes_scored"] > 0
  assert "| fox | 1 |" in (tmp_path / "out" / "perplexity.md").read_text()
  assert (tmp_path / "out" / "perplexity.png").stat().st_size > 0
  # another recipe in its own file, with curves and the FPA claim (LM gate) against FoX
  argv2 = [a if a != "fox" else "fpa_lm" for a in argv] + ["--eval-every", "1", "--out-name", "ppl_other"]
  argv2[argv2.index("--runs-dir") + 1] = str(tmp_path / "runs2")  # new runs: evals from their first step
  res2 = perplexity.main(argv2[:1] + ["fox"] + argv2[1:])
  assert [len(res2[m]["curves"][0]) for m in ("fox", "fpa_lm")] == [2, 2] and "fox" in res2 and "fpa_lm" in res2
  md = (tmp_path / "out" / "ppl_other.md").read_text()
  assert "are in ppl_other.json" in md and "(`fpa_lm`): mean bpb" in md and "logged steps" in md
  assert res["fox"]["bpb"] == perplexity.main(argv)["fox"]["bpb"]  # the first file is untouched
  # the text Pareto study on these models: full cache and each policy's budgets, resumable per cell
  from experiments import text_pareto

  targv = ["--models", str(tmp_path / "out" / "ppl_other.json"), "--methods", "fox", "fpa_lm", "--seeds", "0"]
  targv += ["--multiples", "1", "--budgets", "0.25", "--rows", "2", "--out-dir", str(tmp_path / "out")]
  tp = text_pareto.main(targv)
  cells = tp["runs"]["fpa_lm"]["0"]["1"]
  assert list(cells) == ["full", "fpa_budget 25%", "window 25%"] and all(0 < c["bpb"] < 10 for c in cells.values())
  assert cells["window 25%"]["cache_fraction"] <= 0.25 and cells["full"]["cache_fraction"] == 1.0
  fox = tp["runs"]["fox"]["0"]["1"]  # FoX's penalty grows with age: its own rule is a window
  assert fox["fpa_budget 25%"]["bpb"] == fox["window 25%"]["bpb"]
  assert "| FPA | window 25% | 1 |" in (tmp_path / "out" / "text_pareto.md").read_text()
  monkeypatch.setattr(text_pareto, "score", lambda *a, **k: pytest.fail("re-scored a cell"))
  assert text_pareto.main(targv)["runs"] == tp["runs"]


def test_base110m_recipes_only_print(capsys, tmp_path):
  assert passkey.main(["--scale", "base110m", "--out-dir", str(tmp_path)]) is None
  assert perplexity.main(["--scale", "base110m", "--out-dir", str(tmp_path)]) is None
  out = capsys.readouterr().out
  assert "mesh" in out and "expected" in out and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_lm_ablations_script_tiny_run(tmp_path, data_dir):
  """The lm_ablations study's rows: one change each against fpa_fox0; paired vs fox and fpa_fox0; the
  held-out curve from the trainer's periodic evals; a rerun resumes (no training, same numbers)."""
  from experiments import lm_ablations

  argv = ["--rows", "fox", "fpa_fox0", "fpa_fox0_glr0.1", "--train-len", "32", *TINY, "--steps", "2"]
  argv += ["--eval-every", "1", "--heldout-windows", "4", "--eval-batch", "4", "--data-dir", data_dir]
  argv += ["--small-data", "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")]
  res = lm_ablations.main(argv)
  s = res["summary"]
  assert s["fox"]["vs_fox"] == 0.0 and s["fpa_fox0"]["vs_fpa_fox0"] == 0.0 and s["fpa_fox0_glr0.1"]["vs_fox"] != 0
  assert set(res["fox"]["curves"][0]) == {"1", "2"} and res["heldout"]["docs_covered"] >= 1
  assert res["fpa_fox0_glr0.1"]["config"]["gate_lr_scale"] == 0.1
  assert "| fpa_fox0_glr0.1 |" in (tmp_path / "out" / "lm_ablations.md").read_text()
  again = lm_ablations.main(argv)
  assert again["fox"]["bpb"] == res["fox"]["bpb"] and again["fox"]["train_wall_s"] == res["fox"]["train_wall_s"]


@pytest.mark.slow  # a script's tiny run
def test_bindings_lm_script_tiny_run_resumes_and_reuses_its_scores(tmp_path, monkeypatch):
  """`experiments.bindings_lm` end to end: trains, decodes each length under every
  policy, writes the table and claims; a rerun resumes the run and reuses its scores (same step)."""
  from experiments import bindings_lm

  argv = [
    "--methods", "fpa", "--seeds", "0", "--steps", "2", "--d-model", "16", "--heads", "2", "--train-len", "64",
    "--multiples", "2", "--budgets", "0.125", "--n-eval", "2",
    "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"),
  ]  # fmt: skip
  res = bindings_lm.main(argv)
  cells = res["fpa"]["evals"][0]["2"]
  assert list(cells) == ["full", "fpa_budget 12.5%", "window 12.5%", "h2o 12.5%"]
  assert all(0 <= c["acc"] <= 1 and c["n"] > 0 for c in cells.values())
  assert cells["window 12.5%"]["cache_fraction"] <= 0.125 + 1 / 128
  md = (tmp_path / "out" / "bindings_lm.md").read_text()
  assert "| fpa | fpa_budget 12.5% | 1 |" in md and "`fpa` (1 seeds): the learned rule at 12.5%" in md
  monkeypatch.setattr(bindings_lm, "evaluate", lambda *a, **k: pytest.fail("re-scored an unchanged run"))
  again = bindings_lm.main(argv)
  assert again["fpa"]["evals"] == res["fpa"]["evals"] and again["fpa"]["steps"] == [2]


@pytest.mark.slow  # the clip itself: test_train.py's clip_apart test
def test_clip_coupling_tiny_run(tmp_path, data_dir):
  """experiments.clip_coupling on a tiny passkey recipe: FPA with still read-outs, clipped apart, takes
  FoX's steps (the same loss at every step); under one clip it does not."""
  from experiments import clip_coupling

  argv = ["--steps", "3", "--train-len", "288", *TINY, "--passkey-rows", "4", "--data-dir", data_dir, "--small-data"]
  res = clip_coupling.main(argv + ["--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")])
  runs = res["runs"]
  assert set(runs) == {"fox_b5", "fpa_still_one_clip", "fpa_still_clip_apart"} and res["steps"] == 3
  assert runs["fpa_still_one_clip"]["grad_norm_step1"] > runs["fox_b5"]["grad_norm_step1"]
  apart, one = runs["fpa_still_clip_apart"], runs["fpa_still_one_clip"]
  assert apart["max_abs_loss_gap"] < 1e-4 and apart["max_rel_weight_diff"] < 1e-4
  assert one["max_rel_weight_diff"] > 10 * apart["max_rel_weight_diff"]
  assert "| `fpa_still_clip_apart` |" in (tmp_path / "out" / "clip_coupling.md").read_text()
  assert (tmp_path / "out" / "clip_coupling.png").stat().st_size > 0
