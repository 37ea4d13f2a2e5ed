"""Study 1 (`experiments.live_sets`): metrics on hand-made maps, the layer check, a tiny real run."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _tol import assert_close
from experiments import live_sets as L


def _target():
  # T=4: row 3 is a query whose live set is {0, 2}; row 1 a query with live set {0}; rows 0, 2 unscored.
  t = np.zeros((4, 4), bool)
  t[3, [0, 2]] = True
  t[1, 0] = True
  return jnp.asarray(t)


def _weights(row3, row1=(1.0, 0.0, 0.0, 0.0)):
  w = np.full((4, 4), 0.25)  # unscored rows: anything
  w[3], w[1] = row3, row1
  return jnp.asarray(w)


@pytest.mark.parametrize(
  "row3, mass, cov",
  [
    ((0.5, 0.0, 0.5, 0.0), 1.0, 1.0),  # exactly uniform over the live set
    ((1.0, 0.0, 0.0, 0.0), 1.0, 0.5),  # all mass on one sure-live key: mass wins, coverage does not
    ((0.25, 0.25, 0.25, 0.25), 0.5, 0.5),  # uniform over everything
    ((0.0, 1.0, 0.0, 0.0), 0.0, 0.0),  # all on a dead key
  ],
)
def test_mass_and_coverage_on_hand_made_maps(row3, mass, cov):
  t = _target()
  w = _weights(row3)
  # pooled over the two scored rows; row 1 is perfect on both metrics
  assert float(L.target_mass(w, t)) == pytest.approx((1.0 + mass) / 2)
  assert float(L.coverage(w, t)) == pytest.approx((1.0 + cov) / 2)
  # leading dims pool the same way
  assert float(L.coverage(jnp.stack([w, w]), jnp.stack([t, t]))) == pytest.approx((1.0 + cov) / 2)


def test_losses_vanish_at_the_targets():
  t = _target()
  logits = jnp.where(t, 0.0, -1e30)[None]  # uniform over each live set, nothing elsewhere
  lm, lc = L.losses(logits, t[None])
  # zero by cancellation of terms ~log 2 (4 keys): held at that scale
  assert_close(lm, 0.0, n=4, scale=1.0)
  assert_close(lc, 0.0, n=4, scale=1.0)
  one = jnp.where(jnp.arange(4) == 0, 0.0, -1e30)[None, None, :].repeat(4, 1)  # all on key 0
  lm, lc = L.losses(one, t[None])
  assert_close(lm, 0.0, n=4, scale=1.0)
  assert float(lc) > 1.0  # KL(uniform{0,2} || delta_0) is huge


@pytest.mark.parametrize("task", L.TASKS)
def test_examples_hold_each_querys_live_set(task):
  ex = L.make_examples(task, 3, 64, seed=0)
  mod, cfg = L.task_module(task), L.gen_config(task, 64)
  ref = mod.generate(np.random.default_rng(0), cfg)
  np.testing.assert_array_equal(ex["tokens"][0], ref["tokens"])
  rows = np.flatnonzero(ex["target"][0].any(-1))
  q = ref["query_pos"][ref["live_len"] > 0]
  np.testing.assert_array_equal(rows, q)
  assert np.all(ex["tokens"][0][rows] == mod.QUERY)
  assert ex["target"][0].sum() == ref["live_len"].sum()


@pytest.mark.parametrize(
  "method", ["fpa", pytest.param("fox", marks=pytest.mark.slow), pytest.param("softmax", marks=pytest.mark.slow)]
)  # stack is fpa with fewer read-outs
def test_quadratic_weights_match_the_layers_chunked_output(method):
  # A non-trivial gate (large random read-outs), so penalties are tens of nats.
  cfg = L.layer_config(
    "dips", attention=method, step_init_std=0.3, absolute_init_std=0.3, offset_init_std=0.3, gate_init_std=1.0
  )
  model = L.Head(cfg, rngs=nnx.Rngs(0))
  tok = jnp.asarray(L.make_examples("dips", 2, 64, seed=1)["tokens"])
  L.check_quadratic_matches_layer(model, tok)
  w = L._weights(model, tok)
  assert w.shape == (2, 1, 64, 64)
  assert_close(w.sum(-1), np.ones(w.shape[:-1]), dtype=np.float32, n=64)  # rows of 64 keys
  assert float(jnp.abs(jnp.triu(w[0, 0], 1)).max()) == 0.0  # causal
  # scoring a 1x example padded to 2x (one compile for both lengths) leaves its rows unchanged
  ex = L.pad_examples({"tokens": np.asarray(tok), "target": np.zeros((2, 64, 64), bool)}, 128)
  wp = L._weights(model, jnp.asarray(ex["tokens"]))
  assert_close(wp[..., :64, :64], w, n=128)  # another length, another tiling of the keys


def test_merge_seeds_appends_and_recounts():
  a = L.count_successes(
    {
      "seeds": 1,
      "seed_ids": [0],
      "coverage_1x": [0.99],
      "coverage_2x": [0.97],
      "train_s": 1.0,
      "max_abs_diff_vs_chunked": 0.0,
    },
    ("coverage",),
  )
  b = L.count_successes(
    {
      "seeds": 2,
      "seed_ids": [1, 2],
      "coverage_1x": [0.99, 0.99],
      "coverage_2x": [0.9, 0.96],
      "train_s": 2.0,
      "max_abs_diff_vs_chunked": 1e-7,
    },
    ("coverage",),
  )
  m = L.merge_seeds(a, b, ("coverage",))
  assert m["seed_ids"] == [0, 1, 2] and m["seeds"] == 3 and m["coverage_2x"] == [0.97, 0.9, 0.96]
  assert m["successes"] == m["successes_coverage"] == 2 and m["train_s"] == 3.0


@pytest.mark.slow
def test_run_smoke_writes_results_and_resumes(tmp_path):
  out = tmp_path / "scopes.json"
  kw = dict(seeds=1, steps=4, chunk=2, pool=16, n_eval=8, batch=4, methods=("fpa",), out=out)
  res = L.run("scopes", **kw)
  doc = json.loads(out.read_text())
  r = doc["fpa"]
  assert r["seeds"] == 1 and 0 <= r["successes"] <= 1
  for key in ("target_mass_1x", "target_mass_2x", "coverage_1x", "coverage_2x"):
    assert len(r[key]) == 1 and 0.0 <= r[key][0] <= 1.0
  assert doc["meta"]["commit"] and doc["meta"]["wall_s"] >= 0 and doc["meta"]["machine"]
  assert res["fpa"]["coverage_1x"] == r["coverage_1x"]
  assert "| fpa |" in (tmp_path / "scopes.md").read_text()
  assert (tmp_path / "scopes.png").stat().st_size > 0
  again = L.run("scopes", **kw)  # same settings: the method is skipped, numbers kept
  assert again["fpa"]["coverage_1x"] == r["coverage_1x"] and again["fpa"]["train_s"] == r["train_s"]
