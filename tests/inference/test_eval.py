"""fpa_jax.eval: loss by position against the model's own forward, passkey scoring on hand-made
predictions, the Wilson interval, teacher-forced cached scoring against generation, and the CLI."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from _tol import assert_close
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import eval as ev
from fpa_jax.data.passkey import passkey_eval_examples
from fpa_jax.inference import generate, load_model

RANDOM_GATE = dict(step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)
VOCAB = 259  # bytes: the passkey prompts' tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A workdir holding one checkpoint of a randomly initialised `tiny` fpa model, in the trainer's
  layout (what `load_model` restores; tests/inference/test_decode.py checks it against a trained run).
  Large weights and random gates: losses and greedy continuations depend on the context."""
  from fpa_jax.checkpoint import Checkpointer
  from fpa_jax.models import DecoderLM
  from fpa_jax.train import abstract_state, make_optimizer

  cfg = C.get_config("tiny", attention="fpa", task="synthetic", vocab_size=VOCAB, init_std=0.5, **RANDOM_GATE)
  lm = DecoderLM(cfg.model, rngs=nnx.Rngs(params=cfg.seed))  # initialised as the trainer does it
  state = nnx.state((lm, nnx.Optimizer(lm, make_optimizer(cfg), wrt=nnx.Param)))
  layout = abstract_state(cfg)[1]  # what the trainer saves and `load_model` restores
  assert jax.tree.structure(state) == jax.tree.structure(layout)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(state)] == [(a.shape, a.dtype) for a in jax.tree.leaves(layout)]
  wd = tmp_path_factory.mktemp("run")
  ck = Checkpointer(wd / "checkpoints", async_save=False)
  ck.save(1, state, {}, cfg.to_dict())
  ck.close()
  return wd


@pytest.fixture(scope="module")
def model(run_dir):
  return load_model(run_dir)[0]


@nnx.jit
def _forward(model, tokens, segment_ids=None):
  return model(tokens, segment_ids)  # the reference forward: the model called directly (jitted: eager is slow)


def _nll_np(logits, targets) -> np.ndarray:
  """float64 cross entropy: logits [B, T, V], targets [B, T] -> [B, T]."""
  z = np.asarray(logits, np.float64)
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  return lse - np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0]


def _bucket_means(nll, pos, keep, edges) -> list:
  out = []
  for a, b in edges:
    sel = keep & (pos >= a) & (pos < b)
    out.append(float(nll[sel].mean()) if sel.any() else None)
  return out


# ------------------------------------------------------------------------------------------------ loss by position


def test_loss_by_position_is_the_bucketed_mean_of_the_forward_losses(model):
  rows = np.random.default_rng(0).integers(0, VOCAB, size=(5, 17))  # T = 16, buckets of 6: the last one 4 wide
  res = ev.loss_by_position(model, rows, bucket=6, batch_size=2, per_position=True)  # 3 batches, the last padded
  nll = _nll_np(_forward(model, rows[:, :-1]), rows[:, 1:])
  pos, keep = np.broadcast_to(np.arange(16), nll.shape), np.ones(nll.shape, bool)
  assert res["buckets"] == [[0, 6], [6, 12], [12, 16]] and res["bucket_tokens"] == [30, 30, 20]
  assert res["rows"] == 5 and res["seq_len"] == 16 and res["tokens"] == 80 and res["cache"]["policy"] == "full"
  n = model.cfg.d_model * model.cfg.n_layers
  assert_close(res["nll"], _bucket_means(nll, pos, keep, res["buckets"]), dtype=np.float32, n=n)
  assert_close(res["nll_by_position"], nll.mean(0), dtype=np.float32, n=n)
  assert_close(res["nll_mean"], nll.mean(), dtype=np.float32, n=n)
  # the same rows one at a time from an iterator, capped by max_rows
  again = ev.loss_by_position(model, iter(list(rows) + [rows[0]]), bucket=6, batch_size=2, max_rows=5)
  assert_close(again["nll"], res["nll"], dtype=np.float32, n=n)


def test_loss_by_position_on_packed_batches_counts_masked_tokens_by_segment_position(model):
  rng = np.random.default_rng(1)
  x, y = rng.integers(0, VOCAB, size=(2, 2, 16)).astype(np.int32)
  seg = np.array([[1] * 5 + [2] * 8 + [0] * 3, [1] * 16], np.int32)  # row 0: two documents, then padding
  mask = np.ones((2, 16), np.float32)
  mask[1, 12:] = 0.0  # e.g. targets past the end
  batch = {"inputs": x, "targets": y, "segment_ids": seg, "loss_mask": mask}
  res = ev.loss_by_position(model, batch, bucket=4, batch_size=2)
  nll = _nll_np(_forward(model, x, seg), y)
  pos = np.array([[*range(5), *range(8), *range(3)], list(range(16))])  # tokens since the document began
  keep = (mask > 0) & (seg > 0)
  assert res["bucket_tokens"] == [int((keep & (pos >= a) & (pos < a + 4)).sum()) for a in range(0, 16, 4)]
  n = model.cfg.d_model * model.cfg.n_layers
  assert_close(
    [v for v in res["nll"] if v is not None],
    [v for v in _bucket_means(nll, pos, keep, res["buckets"]) if v],
    dtype=np.float32,
    n=n,
  )
  assert res["nll"][-1] is None  # positions 12-15: only row 1's masked tail reaches there


def test_loss_by_position_under_a_window_cache(model):
  rows = np.random.default_rng(2).integers(0, VOCAB, size=(2, 17))
  full = ev.loss_by_position(model, rows, bucket=1, batch_size=2)
  win = ev.loss_by_position(model, rows, bucket=1, batch_size=2, policy="window", budget=6)
  assert win["cache"]["policy"] == "window" and win["cache"]["budget"] == 6
  assert win["cache"]["cache_fraction"] == 6 / 16 and win["cache"]["lost_mass_max"] > 0 and not win["cache"]["overflow"]
  n = model.cfg.d_model * model.cfg.n_layers * 16
  assert_close(win["nll"][:6], full["nll"][:6], dtype=np.float32, n=n)  # the first 6 queries see every key
  assert not np.allclose(win["nll"][6:], full["nll"][6:])  # later ones do not


def test_loss_by_position_bad_arguments(model):
  rows = np.zeros((2, 9), np.int32)
  with pytest.raises(ValueError, match="bucket must be a positive int"):
    ev.loss_by_position(model, rows, bucket=0)
  with pytest.raises(ValueError, match="same length"):
    ev.loss_by_position(model, [np.zeros(9, np.int32), np.zeros(7, np.int32)])
  with pytest.raises(ValueError, match="must be integers"):
    ev.loss_by_position(model, rows.astype(np.float32))
  with pytest.raises(ValueError, match=r"vocab_size=259"):
    ev.loss_by_position(model, rows + VOCAB)  # token ids from another vocabulary
  with pytest.raises(ValueError, match="empty"):
    ev.loss_by_position(model, iter([]))
  with pytest.raises(ValueError, match="needs a budget"):
    ev.loss_by_position(model, rows, policy="window")
  with pytest.raises(ValueError, match=r"\[N, T \+ 1\]"):
    ev.loss_by_position(model, np.zeros((2, 3, 4), np.int32))


# ------------------------------------------------------------------------------------------------ Wilson


def test_wilson_interval_known_values():
  # 8 of 10 at 95%: (0.4902, 0.9433) (Wilson 1927; e.g. Newcombe 1998, Table I's method 3 form)
  z = 1.959963984540054
  p, n = 0.8, 10
  centre, half = (
    (p + z * z / (2 * n)) / (1 + z * z / n),
    z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)),
  )
  assert ev.wilson_interval(8, 10) == pytest.approx((centre - half, centre + half), rel=1e-12)
  assert ev.wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), rel=2e-4)
  lo, hi = ev.wilson_interval(0, 10)
  assert lo == 0.0 and hi == pytest.approx(z * z / (10 + z * z), rel=1e-12)  # 0.2775
  lo, hi = ev.wilson_interval(20, 20)
  assert hi == 1.0 and lo == pytest.approx(20 / (20 + z * z), rel=1e-12)  # 0.8389
  for bad in [(1, 0), (3, 2), (-1, 5), (0.5, 4)]:
    with pytest.raises(ValueError):
      ev.wilson_interval(*bad)


# ------------------------------------------------------------------------------------------------ passkey


SEVEN, EIGHT = ord("7") + 3, ord("8") + 3  # byte ids


def test_passkey_scoring_on_a_stub_that_gets_every_seven_wrong(monkeypatch):
  """A perfect teacher-forced predictor, except that it says 8 wherever the next token is a 7: a
  prompt is retrieved iff its key has no 7, and its digit accuracy is the share of non-7 digits."""

  def stub(tokens):
    nxt = np.roll(np.asarray(tokens), -1, axis=1)  # position t predicts token t + 1
    return np.where(nxt == SEVEN, EIGHT, nxt)

  monkeypatch.setattr(ev, "argmax_fn", lambda model: stub)
  fake = SimpleNamespace(cfg=SimpleNamespace(vocab_size=259))
  res = ev.passkey_eval(fake, 300, multiples=(1, 2), depths=(0, 100), n=4, show_progress=False)
  total = 0
  for m in (1, 2):
    for d in (0, 100):
      keys = [str(e["key"]) for e in passkey_eval_examples(300, m, d, n=4, seed=0)]
      want = sum("7" not in k for k in keys)
      c = res["cells"][str(m)][str(d)]
      assert (c["n"], c["correct"], c["accuracy"]) == (4, want, want / 4)
      assert c["ci95"] == list(ev.wilson_interval(want, 4))
      assert c["digit_accuracy"] == pytest.approx(np.mean([np.mean([ch != "7" for ch in k]) for k in keys]))
      total += want
  assert 0 < total < 16  # the case discriminates
  assert res["overall"]["correct"] == total and res["overall"]["ci95"] == list(ev.wilson_interval(total, 16))
  assert res["by_length"]["1"]["n"] == 8 and res["by_depth"]["0"]["n"] == 8
  md = ev.markdown(res)
  assert "| depth | 1x (300) | 2x (600) |" in md and f"({total}/16)" in md


def test_teacher_forced_cached_scoring_is_greedy_generation_under_the_policy(model):
  """The teacher-forced exact match through the cache equals generating with prompt-by-token prefill."""
  rng = np.random.default_rng(0)
  policy = dict(policy="window", budget=6)
  exs, want = [], []
  prompts = rng.integers(3, VOCAB, size=(2, 12)).astype(np.int32)
  answers = generate(model, prompts, 4, prefill="decode", **policy)[0]  # greedy answers under the window
  for prompt, g in zip(prompts, answers):
    for k in (None, 2):
      ans = g.copy()
      if k is not None:
        ans[k] = (ans[k] + 1) % VOCAB
      exs.append({"tokens": np.asarray([*prompt, *ans, 2], np.int32), "answer_start": len(prompt)})
      want.append(k is None)
  tf = ev.passkey_cell(model, exs, batch_size=2, **policy)  # rows of 16, as above: the same compiles
  gen = ev.passkey_cell(model, exs, batch_size=2, prefill="decode", **policy)
  assert tf["correct"] == gen["correct"] == sum(want) and tf["n"] == 4
  assert tf["cache_fraction"] == gen["cache_fraction"] == 6 / 16
  assert gen["kept_fraction_mean"] == pytest.approx(6 / 15)  # the mean share: 6 held of the 15 keys the last step saw
  # a window: every layer keeps alike
  assert gen["kept_fraction_per_layer"] == pytest.approx([6 / 15] * model.cfg.n_layers)
  with pytest.raises(ValueError, match="prefill='decode'"):
    ev.passkey_cell(model, exs, policy="h2o", budget=6, prefill="parallel")


def test_passkey_eval_bad_arguments():
  with pytest.raises(ValueError, match=r"tokenizer's vocabulary \(259\) is larger than the model's \(32\)"):
    ev.passkey_eval(SimpleNamespace(cfg=SimpleNamespace(vocab_size=32)), 300)
  fake = SimpleNamespace(cfg=SimpleNamespace(vocab_size=259))  # every check runs before the model does
  with pytest.raises(ValueError, match="depths"):
    ev.passkey_eval(fake, 300, depths=(150,))
  with pytest.raises(ValueError, match="cannot be built"):
    ev.passkey_eval(fake, 10, multiples=(1,), n=1)
  with pytest.raises(ValueError, match="prefill"):
    ev.passkey_eval(fake, 300, prefill="chunked")
  with pytest.raises(ValueError, match="tolerance"):
    ev.passkey_eval(fake, 300, policy="fpa")
  with pytest.raises(ValueError, match="prefill='decode'"):
    ev.passkey_eval(fake, 300, policy="h2o", budget=0.5, prefill="parallel")


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_loss_by_position_end_to_end(run_dir, tmp_path, capsys):
  rows = np.random.default_rng(3).integers(0, VOCAB, size=(3, 17))  # the library tests' shapes: no new compile
  np.save(tmp_path / "rows.npy", rows)
  base = ["--workdir", str(run_dir), "--task", "loss_by_position", "--rows-npy", str(tmp_path / "rows.npy")]
  out = tmp_path / "lbp.json"
  assert ev.main(base + ["--bucket", "8", "--batch-size", "2", "--out", str(out)]) == 0
  res = json.loads(out.read_text())
  assert res["rows"] == 3 and res["seq_len"] == 16 and res["train_length"] == 32 and len(res["nll"]) == 2
  assert res["meta"]["command"].startswith("python -m fpa_jax.eval --workdir") and res["meta"]["step"] == 1
  lib = ev.loss_by_position(load_model(run_dir)[0], rows, bucket=8, batch_size=2)
  assert res["nll"] == lib["nll"]  # the same program on the same rows
  assert "| 0-8 | 0.25 | 24 |" in out.with_suffix(".md").read_text()
  argv = base + ["--policy", "window", "--budget", "0.375", "--batch-size", "2", "--no-progress"]
  assert ev.main(argv) == 0  # the default results path
  win = json.loads((run_dir / "eval" / "loss_by_position_window_b0.375.json").read_text())
  assert win["cache"]["policy"] == "window" and win["cache"]["cache_fraction"] == 0.375
  assert "window 0.375" in capsys.readouterr().out


def test_cli_passkey_end_to_end(run_dir):
  argv = ["--workdir", str(run_dir), "--task", "passkey", "--train-len", "300", "--multiples", "1"]
  assert ev.main(argv + ["--depths", "0", "100", "--n", "2", "--no-progress"]) == 0
  res = json.loads((run_dir / "eval" / "passkey_full.json").read_text())
  assert set(res["cells"]["1"]) == {"0", "100"} and res["scoring"] == "teacher_forced"
  for c in res["cells"]["1"].values():
    assert c["n"] == 2 and c["ci95"] == list(ev.wilson_interval(c["correct"], 2))
  assert "| all depths |" in (run_dir / "eval" / "passkey_full.md").read_text()


@pytest.mark.parametrize(
  "extra,message",
  [
    (["--task", "passkey", "--train-len", "10", "--multiples", "1"], "cannot be built"),
    (["--task", "loss_by_position", "--policy", "window"], "needs a budget"),
    (["--task", "loss_by_position", "--prefill", "decode"], "--prefill applies to --task passkey"),
    (["--task", "passkey", "--bucket", "4"], "apply to --task loss_by_position"),
    (["--task", "loss_by_position", "--rows", "0"], "--rows must be >= 1"),
    (["--task", "passkey", "--policy", "fpa_budget", "--budget", "1.5"], "must be <= 1"),
    (["--task", "passkey", "--policy", "window", "--budget", "0.5", "--policy-arg", "recent"], "KEY=VALUE"),
  ],
)
def test_cli_bad_arguments_say_what_to_change(run_dir, capsys, extra, message):
  assert ev.main(["--workdir", str(run_dir), *extra]) == 2
  assert message in capsys.readouterr().err


def test_cli_bad_rows_and_workdir(run_dir, tmp_path, capsys):
  np.save(tmp_path / "bad.npy", np.full((2, 9), 300))
  argv = ["--workdir", str(run_dir), "--task", "loss_by_position", "--rows-npy", str(tmp_path / "bad.npy")]
  assert ev.main(argv) == 2 and "vocab_size=259" in capsys.readouterr().err
  assert ev.main(["--workdir", str(tmp_path / "nope"), "--task", "passkey"]) == 2
  assert "no checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_loss_by_position_on_the_text_pipeline(run_dir, tmp_path):
  """The default rows: fpa_text validation (small build) through make_pipeline."""
  argv = ["--workdir", str(run_dir), "--task", "loss_by_position", "--multiple", "2", "--rows", "3"]
  assert ev.main(argv + ["--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "t.json")]) == 0
  res = json.loads((tmp_path / "t.json").read_text())
  assert res["seq_len"] == 64 and res["rows"] == 3 and res["data"].startswith("fpa_text validation")
  assert 0 < res["nll_mean"] < 10


def test_cli_text_rows_are_the_heldout_windows_over_every_document(tmp_path):
  """The CLI's text rows are the trainer's held-out windows (spread over every validation document,
  coverage recorded), not the first rows of the stream."""
  from fpa_jax.data import make_heldout

  cfg = C.get_config("tiny", task="text", tokenizer="bytes", vocab_size=259, small_data=True, data_dir=str(tmp_path))
  a = SimpleNamespace(data_dir=None, rows=6, text_source="stdlib")
  rows, cov = ev._text_rows(cfg, a, 40, 4)
  want = make_heldout("validation", data_dir=str(tmp_path), seq_len=40, batch_size=4, n_windows=6, small=True)
  got, ref = list(rows), list(want)
  assert len(got) == len(ref) == 2  # 6 windows in batches of 4, the last padded with masked rows
  for g, r in zip(got, ref):
    np.testing.assert_array_equal(g["inputs"], r["inputs"])
  assert cov == want.info["coverage"] and cov["windows"] == 6
  assert cov["docs_covered"] == min(6, cov["docs_in_split"])  # one window per document first
