"""The retrieval-suite study on a tiny exported model: full cache, then the cache cells on the tasks it
can do (none for a random model: only multikey at k = 8, reported whatever it shows), the page and a
claims row that judges nothing unscored."""

import pytest

from experiments import _common as U
from experiments import retrieval_suite as S
from experiments import two_phase as T
from experiments.recipes import RECOMMENDED


@pytest.mark.slow  # a study's tiny run; run_suite's scoring and resume: tests/inference/test_retrieval_eval.py
def test_tiny_suite_scores_reports_and_judges(tmp_path):
  from flax import nnx

  from fpa_jax.configs import get_config
  from fpa_jax.inference import export_model
  from fpa_jax.models import DecoderLM

  cfg = get_config("small", n_layers=1, d_model=16, n_heads=2, d_ff=0, vocab_size=259, block_size=32)
  model = DecoderLM(cfg.model, rngs=nnx.Rngs(params=0))
  export_model(model, cfg, T.asset_dir(RECOMMENDED, "final", 0, tmp_path / "experiments" / "assets" / "two_phase"))
  argv = ["--root", str(tmp_path), "--recipes", "fpa_recipe", "--seeds", "0", "--n", "2", "--train-len", "256"]
  argv += ["--multiples", "4", "--cache-multiple", "4", "--rules", "fpa_global", "window"]
  md = S.main(argv)
  res = U.read_json(tmp_path / "results" / "retrieval_suite" / "fpa_recipe_s0.json")
  assert res["params"] == U.params_digest(model)
  keys = set(res["cells"])
  assert S.shortest("niah_single", 256, [2, 4]) == 2 and S.shortest("niah_multikey_k8", 256, [2, 4]) == 4
  assert {"niah_single/4x/full", "niah_multikey_k8/4x/full", "bindings/4x/full"} <= keys
  assert S.can_do(res, 0.5) == []  # a random model does nothing: only the always-reported task is cut
  assert {k for k in keys if not k.endswith("/full")} == {
    f"niah_multikey_k8/4x/{p}:{k:g}" for p in ("fpa_global", "window") for k in (0.125, 0.25, 0.5, 0.75)
  }
  assert "## `fpa_recipe` seed 0" in md and "Can do at the shortest length scored (full cache >= 0.5): none." in md
  (row,) = S.claim_rows(tmp_path, multiple=4)
  assert row.verdict == "not scored (seed 0)" and "FOX_BASELINE not scored" in row.evidence
  assert S.cache_specs(["fpa_global"], (0.5, 0.125)) == ["fpa_global:0.125", "fpa_global:0.5"]
