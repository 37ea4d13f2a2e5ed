"""fpa_jax.eval.retrieval: the retrieval suite's scoring on oracle predictors (teacher-forced, through
the cache and generated), the cached path on a tiny random model, resuming cell by cell, the tables
and the plot, the command line, and the checks that run before anything is traced."""

from __future__ import annotations

import json
import runpy
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import eval as ev
from fpa_jax.eval import passkey as pk
from fpa_jax.eval import retrieval as R

VOCAB = 259  # bytes
FAKE = SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB))  # enough for every check but the digest
STATS = {"cache_fraction": 0.5, "kept_fraction_mean": 0.4, "lost_mass_max": 0.0, "overflow": False}


def _cfg():
  return C.get_config("tiny", attention="fpa", task="synthetic", vocab_size=VOCAB, init_std=0.5)


@pytest.fixture(scope="module")
def model():
  from fpa_jax.models import DecoderLM

  return DecoderLM(_cfg().model, rngs=nnx.Rngs(params=0))


def _oracle(tokens):
  return np.roll(np.asarray(tokens), -1, axis=1)  # position t predicts token t + 1: every answer right


def _oracle_logits(model, tokens, **policy):
  return np.eye(VOCAB, dtype=np.float32)[_oracle(tokens)], dict(STATS)


@pytest.fixture
def oracle(monkeypatch):
  """The parallel and the cached argmax both perfect (no model runs); -> the list of calls of either."""
  calls = []
  monkeypatch.setattr(ev, "argmax_fn", lambda m: lambda t: calls.append("full") or _oracle(t))
  monkeypatch.setattr(pk, "cached_logits", lambda m, t, **p: calls.append("cached") or _oracle_logits(m, t, **p))
  return calls


# ------------------------------------------------------------------------------------------------ one cell


def test_oracle_scores_every_answer_and_a_wrong_byte_costs_its_answer(monkeypatch):
  mv = R.suite_examples("niah_multivalue", 640, 2)  # 4 answers each
  exs = mv + R.suite_examples("passkey", 256, 1) + R.suite_examples("bindings", 160, 1)
  monkeypatch.setattr(ev, "argmax_fn", lambda m: _oracle)
  cell = R.retrieval_cell(FAKE, exs, batch_size=4)
  assert (cell["n"], cell["score"], cell["exact"], cell["correct"]) == (4, 1.0, 1.0, 4)
  assert cell["scores"] == [1.0] * 4 and cell["scoring"] == "teacher_forced"
  assert set(cell["by_task"]) == {"niah_multivalue", "passkey", "bindings"} and cell["by_task"]["passkey"]["n"] == 1

  s = mv[0].answer_starts[1] + 2  # a byte inside example 0's second answer

  def one_wrong(tokens):
    am = _oracle(tokens)
    am[0, s - 1] = (am[0, s - 1] + 1) % VOCAB  # row 0 is example 0 (one batch of 4)
    return am

  monkeypatch.setattr(ev, "argmax_fn", lambda m: one_wrong)
  cell = R.retrieval_cell(FAKE, exs, batch_size=4)
  assert cell["scores"] == [0.75, 1.0, 1.0, 1.0]  # 3 of 4 answers right: partial credit
  assert cell["score"] == pytest.approx(3.75 / 4) and cell["exact"] == 0.75 and cell["correct"] == 3
  assert cell["answers"] == 4 + 4 + 1 + len(exs[-1].answers) and cell["answers_correct"] == cell["answers"] - 1
  assert cell["ci95"] == list(ev.wilson_interval(3, 4))
  assert cell["by_task"]["niah_multivalue"]["score"] == pytest.approx(0.875)


def test_oracle_through_the_cache_and_generated(monkeypatch, oracle):
  exs = R.suite_examples("niah_multiquery", 800, 2)
  cell = R.retrieval_cell(FAKE, exs, policy="window", budget=0.5, batch_size=2)
  assert oracle == ["cached"] and cell["score"] == 1.0 and "by_task" not in cell
  assert {k: cell[k] for k in STATS} == STATS  # the cache's stats, merged over batches

  # generated: the answer text (here with example 1's third answer wrong) parsed per answer
  wrong = exs[1].answer_starts[2]
  by_prompt = {}
  for i, ex in enumerate(exs):
    ans = ex.tokens[ex.answer_start : -1].copy()
    if i == 1:
      ans[wrong - ex.answer_start] += 1
    by_prompt[tuple(ex.tokens[: ex.answer_start])] = ans

  def generate(model, prompts, n_new, prefill, **policy):
    out = np.stack(
      [np.pad(by_prompt[tuple(p)], (0, n_new - len(by_prompt[tuple(p)])), constant_values=2) for p in prompts]
    )
    return out, {"cache_fraction": 1.0, "overflow": False, "kept_fraction_per_head": [[1.0]]}

  monkeypatch.setattr(pk, "generate", generate)
  cell = R.retrieval_cell(FAKE, exs, prefill="decode", batch_size=2)
  assert cell["scores"] == [1.0, 0.75] and cell["scoring"] == "generate (prefill decode)"
  with pytest.raises(ValueError, match="interleaved"):
    R.retrieval_cell(FAKE, R.suite_examples("bindings", 160, 1), prefill="decode")


def test_the_cache_path_on_a_random_model_keeps_all_at_budget_one(model):
  exs = R.suite_examples("passkey", 256, 2)
  full = R.retrieval_cell(model, exs, length=256, batch_size=2)
  win = R.retrieval_cell(model, exs, policy="window", budget=1.0, length=256, batch_size=2)
  assert full["scores"] == win["scores"] and full["n"] == win["n"] == 2
  assert "cache_fraction" not in full  # the parallel model: no cache
  assert win["cache_fraction"] == 1.0 and win["kept_fraction_mean"] == 1.0 and win["lost_mass_max"] == 0.0
  assert not win["overflow"]
  # the cells' two predictors agree on (nearly) every position, not only on the scores
  from fpa_jax.inference import as_policy

  rows = np.zeros((2, 256), np.int32)
  for r, ex in enumerate(exs):
    rows[r, : len(ex.tokens) - 1] = ex.tokens[:-1]
  am = [
    np.asarray(pk.teacher_forced_predictor(model, as_policy(**p))[0](rows))
    for p in [{"policy": "full"}, {"policy": "window", "budget": 1.0}]
  ]
  assert (am[0] == am[1]).mean() > 0.99


# ------------------------------------------------------------------------------------------------ the suite


def test_run_suite_resumes_cell_by_cell(tmp_path, monkeypatch, capsys, oracle, model):
  scored = []
  cell = R.retrieval_cell
  monkeypatch.setattr(R, "retrieval_cell", lambda m, exs, **kw: scored.append(kw["policy"]) or cell(m, exs, **kw))
  out = tmp_path / "suite.json"
  args = dict(train_len=256, tasks=["passkey", "bindings"], multiples=[1, 2], n=2, out_path=out, show_progress=False)
  res = R.run_suite(model, policies=["full"], write_plot=False, **args)
  assert len(scored) == 4 and len(res["cells"]) == 4 and res["params"] == R.params_digest(model)
  assert json.loads(out.read_text())["cells"] == res["cells"]
  c = res["cells"]["bindings/2x/full"]
  assert (c["task"], c["multiple"], c["length"], c["score"], c["cache"]) == (
    "bindings",
    2,
    512,
    1.0,
    {"policy": "full"},
  )

  scored.clear()
  R.run_suite(model, policies=["full"], write_plot=False, **args)
  assert scored == []  # nothing new
  res = R.run_suite(model, policies=["full", "window:0.5"], **args)
  assert len(scored) == 4 and all(p.name == "window" for p in scored) and len(res["cells"]) == 8
  assert res["cells"]["passkey/1x/window:0.5"]["cache_fraction"] == 0.5
  assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 1000

  scored.clear()  # the same label with other arguments: its cells again
  R.run_suite(model, policies=[("window:0.5", {"policy": "window", "budget": 0.25})], write_plot=False, **args)
  assert len(scored) == 4

  other = nnx.clone(model)
  other.embed[...] = other.embed[...] + 1.0
  scored.clear()
  res = R.run_suite(other, policies=["full"], write_plot=False, **args)
  assert (
    len(scored) == 4 and len(res["cells"]) == 4 and res["params"] == R.params_digest(other) != R.params_digest(model)
  )
  assert "starting afresh" in capsys.readouterr().err


def test_table_plot_and_removed_fraction(tmp_path):
  cell = lambda t, m, p, rec, s, **kw: {
    "task": t,
    "multiple": m,
    "length": 100 * m,
    "policy": p,
    "cache": rec,
    "score": s,
    **kw,
  }  # noqa: E731
  pols = {
    "full": {"policy": "full"},
    "w:0.5": {"policy": "window", "budget": 0.5},
    "w:25": {"policy": "window", "budget": 25},
  }
  cells = [
    cell(t, m, p, pols[p], s, **({} if p == "full" else {"kept_fraction_mean": 0.5}))
    for t in ("niah_multikey_k8", "niah_single", "niah_multikey_k2")
    for m, p, s in [(1, "full", 1.0), (2, "full", 0.9), (2, "w:0.5", 0.5), (2, "w:25", 0.25)]
  ]
  res = {
    "train_len": 100,
    "n": 4,
    "seed": 0,
    "vocab": "train",
    "scoring": "teacher_forced",
    "params": "x",
    "policies": pols,
  }
  res["cells"] = {R.cell_key(c["task"], c["multiple"], c["policy"]): c for c in cells}
  md = R.suite_table(res)
  assert md.count("### `") == 3 and "| task | 1x (100) | 2x (200) |" in md
  rows = [ln.split(" |")[0][2:] for ln in md.splitlines() if ln.startswith("| niah")]
  assert rows[:3] == ["niah_single", "niah_multikey_k2", "niah_multikey_k8"]  # one row per k, the suite's order
  assert (
    "| mean | — | 0.500 |" in md
    and "| kept / seen (mean over steps) | — | 0.500 |" in md
    and "| niah_single | 1.000 | 0.900 |" in md
  )
  assert [R.removed_fraction(res["cells"][f"niah_single/2x/{p}"]) for p in pols] == [0.0, 0.5, 0.875]
  assert (
    R.removed_fraction({"cache": {"policy": "fpa", "tolerance": 1e-3}, "length": 9, "kept_fraction_mean": 0.3}) == 0.7
  )
  path = R.removal_plot(res, tmp_path / "p.png")
  assert path.stat().st_size > 1000


def test_task_labels_multikey_rows_and_policy_specs():
  assert R.expand_tasks("niah_multikey") == ["niah_multikey_k2", "niah_multikey_k4", "niah_multikey_k8"]
  assert R.suite_task("niah_multikey_k8") == ("niah_multikey", {"k": 8}) and R.suite_task("passkey") == ("passkey", {})
  assert len(R.suite_examples("niah_multikey_k8", 1024, 1)[0].needles) == 8
  assert R.parse_policy("snapkv:128:recent=8") == {"policy": "snapkv", "budget": 128, "recent": 8}
  assert R.parse_policy("fpa:tolerance=0.001") == {"policy": "fpa", "tolerance": 0.001}
  pols = R.suite_policies(["full", ("w", {"policy": "window", "budget": 0.125}), ("window", {"budget": 8})])
  assert [p.record() for p in pols.values()] == [
    {"policy": "full"},
    {"policy": "window", "budget": 0.125},
    {"policy": "window", "budget": 8},
  ]
  assert R.suite_cells(["a", "b"], [1, 2], ["full"]) == [
    ("a", 1, "full"),
    ("a", 2, "full"),
    ("b", 1, "full"),
    ("b", 2, "full"),
  ]


# ------------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
  "kw,message",
  [
    (dict(tasks=["niah_singel"]), r"unknown retrieval task 'niah_singel': use any of \('niah_single'"),
    (dict(tasks=["passkey", "passkey"]), "given twice"),
    (dict(multiples=[0, 1]), "each multiple"),
    (dict(multiples=[]), "multiples is empty"),
    (dict(n=0), r"n \(examples per cell\) must be an int >= 1"),
    (dict(vocab="test"), "vocab must be one of"),
    (dict(max_len=300), "drop the multiples above 1"),
    (dict(policies=["window"]), "needs a budget"),
    (dict(policies=["sink_window:4"]), r"policy 'sink_window:4' at 1x \(256 tokens\)"),
    (dict(policies=["window:0.5:oops"]), "NAME"),
    (dict(policies=["wind:0.5"]), "unknown policy 'wind'"),
    (dict(policies=[("w", {"policy": "window", "budgte": 0.5})]), "policy 'w'"),
    (dict(tasks=["bindings"], prefill="decode"), "teacher-forced only"),
    (dict(policies=["h2o:0.5"], prefill="parallel"), "prefill='decode'"),
    (dict(train_len=64), "raise train_len or the multiples"),
  ],
)
def test_run_suite_bad_inputs_say_what_to_change(tmp_path, monkeypatch, model, kw, message):
  monkeypatch.setattr(ev, "argmax_fn", lambda m: pytest.fail("traced before the inputs were checked"))
  args = dict(train_len=256, tasks=["passkey"], multiples=[1, 2], n=2, out_path=tmp_path / "x.json") | kw
  with pytest.raises(ValueError, match=message):
    R.run_suite(model, **args)
  assert not (tmp_path / "x.json").exists()


def test_retrieval_cell_bad_inputs():
  exs = R.suite_examples("passkey", 256, 1)
  with pytest.raises(ValueError, match="empty"):
    R.retrieval_cell(FAKE, [])
  with pytest.raises(ValueError, match="RetrievalExample"):
    R.retrieval_cell(FAKE, [exs[0].as_passkey_dict()])
  with pytest.raises(ValueError, match="does not fit length=128"):
    R.retrieval_cell(FAKE, exs, length=128)
  with pytest.raises(ValueError, match="byte-level"):
    R.retrieval_cell(SimpleNamespace(cfg=SimpleNamespace(vocab_size=32)), exs)
  with pytest.raises(ValueError, match="prefill must be"):
    R.retrieval_cell(FAKE, exs, prefill="chunked")
  with pytest.raises(ValueError, match="batch_size"):
    R.retrieval_cell(FAKE, exs, batch_size=0)


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_on_an_exported_model(tmp_path, monkeypatch, capsys, oracle, model):
  from fpa_jax.inference import export_model

  export_model(model, _cfg(), tmp_path / "m")
  out = tmp_path / "r" / "x.json"
  argv = ["--exported", str(tmp_path / "m"), "--tasks", "passkey", "--multiples", "1", "--train-len", "256"]
  assert R.main(argv + ["--n", "2", "--out", str(out), "--no-progress", "--no-plot"]) == 0
  res = json.loads(out.read_text())
  assert list(res["cells"]) == ["passkey/1x/full"] and res["params"] == R.params_digest(model)
  assert res["meta"]["command"].startswith("python -m fpa_jax.eval retrieval --exported") and res["meta"]["wall_s"] >= 0
  assert "### `full`" in out.with_suffix(".md").read_text() and "### `full`" in capsys.readouterr().out
  monkeypatch.setattr(sys, "argv", ["fpa_jax.eval", "retrieval", "--exported", str(tmp_path / "m")])
  with pytest.raises(SystemExit) as e:  # `python -m fpa_jax.eval retrieval ...`
    runpy.run_module("fpa_jax.eval", run_name="__main__")
  assert e.value.code == 2 and "give --out with --exported" in capsys.readouterr().err


def test_cli_flags_are_dashed(monkeypatch):
  from fpa_jax import cli

  seen = []
  monkeypatch.setattr(cli, "parse", lambda ap, argv=None: seen.append(ap) or (_ for _ in ()).throw(SystemExit(0)))
  with pytest.raises(SystemExit):
    R.parse_args([])
  flags = [s for act in seen[0]._actions for s in act.option_strings if s.startswith("--")]
  assert "--no-plot" in flags and not [f for f in flags if "_" in f]
