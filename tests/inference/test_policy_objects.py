"""Policies as objects: one class per rule, resolved into the same class; a policy of your own by
subclassing `ScorePolicy` and writing `score()` (docs/inference.md's block, run here as written);
the cache, the decoder and the eval never branch on a policy's name; both CLIs take one set of
policy flags."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from fpa_jax import configs as C
from fpa_jax import eval as ev
from fpa_jax.inference import (
  POLICIES,
  POLICY_CLASSES,
  CachePolicy,
  FPABudget,
  FPAGlobal,
  PolicyRule,
  ScorePolicy,
  Window,
  as_policy,
  cached_logits,
  generate,
  make_policy,
)
from fpa_jax.inference.policies import policy_class, policy_from_args
from fpa_jax.models import build_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
  cfg = C.get_config(
    "tiny", attention="fpa", step_init_std=0.3, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3
  )
  return build_model(cfg, seed=0)


def _docs_block(heading: str) -> str:
  """The first python block after `heading` in docs/inference.md."""
  text = (ROOT / "docs" / "inference.md").read_text()
  after = text[text.index(heading) :]
  return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_one_class_per_policy_and_names_resolve_to_it():
  assert set(POLICY_CLASSES) == set(POLICIES) | {"score"}
  kw = {
    "fpa": dict(tolerance=1e-3),
    "fpa_threshold": dict(threshold=5.0),
    "full": {},
  }
  for name in POLICIES:
    args = kw.get(name, dict(budget=0.25))
    pol = make_policy(name, 64, **args)
    assert type(pol) is policy_class(name) and pol.name == name and pol.resolved
    assert policy_class(name)(**args).resolve(64) == pol  # the class itself = the name and its keywords
    assert as_policy(policy_class(name), **args).resolve(64) == pol
  assert FPABudget(budget=0.25).record() == CachePolicy("fpa_budget", budget=0.25).record()
  assert Window(compression_ratio=0.75).resolve(64) == make_policy("window", 64, budget=0.25)
  masked = FPAGlobal(budget=0.25, pool_impl="masked").resolve(64)
  assert masked == CachePolicy("fpa_global", budget=0.25, pool_impl="masked").resolve(64)
  assert masked == make_policy("fpa_global", 64, budget=0.25, pool_impl="masked") and masked.pool_impl == "masked"
  with pytest.raises(ValueError, match="needs a budget"):
    FPABudget()
  with pytest.raises(ValueError, match="pool_impl must be one of"):
    FPAGlobal(budget=0.25, pool_impl="paged")
  with pytest.raises(ValueError, match="pool_impl only applies"):
    CachePolicy("fpa_budget", budget=0.25, pool_impl="masked")
  with pytest.raises(ValueError, match="resolved"):
    as_policy(make_policy("window", 64, budget=8))
  with pytest.raises(ValueError, match="give its arguments in it"):
    as_policy(FPABudget(budget=4), budget=8)


class _NegPenalty(ScorePolicy):
  def score(self, q, k, field, level, penalty, positions):
    return -penalty  # fpa_budget's rule


def test_docs_policy_of_ones_own_runs_as_written(tiny):
  block = _docs_block("## Writing a policy")
  assert len(block.strip().splitlines()) <= 15, "the docs promise a policy in at most 15 lines"
  tok = np.asarray(np.random.default_rng(0).integers(0, tiny.cfg.vocab_size, (2, 12)))
  ns = {"model": tiny, "prompts": tok, "jnp": jnp}  # jnp: jax.numpy, as on the rest of the page
  exec(compile(block, "docs/inference.md", "exec"), ns)
  policy, tokens, stats = ns["policy"], ns["tokens"], ns["stats"]
  assert isinstance(policy, ScorePolicy) and not policy.resolved
  assert tokens.shape == (2, 32) and stats["policy"] == "score"
  assert stats["cache_fraction"] <= 0.25  # every query saw at most a quarter of the keys
  assert ns["logits"].shape == (2, 32, tiny.cfg.vocab_size)
  # the same rule as a function: the same tokens
  fn = lambda q, k, f, lv, p, pos: type(policy).score(policy, q, k, f, lv, p, pos)  # noqa: E731
  again, _ = generate(tiny, tok, 32, policy=CachePolicy(score=fn, budget=0.25))
  np.testing.assert_array_equal(again, tokens)


def test_subclassed_score_policy_is_the_built_in_rule(tiny):
  tok = np.asarray(np.random.default_rng(3).integers(0, tiny.cfg.vocab_size, (2, 24)))
  mine, _ = generate(tiny, tok[:, :14], 6, policy=_NegPenalty(budget=8))
  theirs, _ = generate(tiny, tok[:, :14], 6, policy=FPABudget(budget=8))
  np.testing.assert_array_equal(mine, theirs)
  np.testing.assert_array_equal(theirs, generate(tiny, tok[:, :14], 6, policy="fpa_budget", budget=8)[0])
  a, _ = cached_logits(tiny, tok, policy=_NegPenalty(budget=8))
  b, _ = cached_logits(tiny, tok, policy="fpa_budget", budget=8)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
  assert _NegPenalty(budget=8).resolve(24) == _NegPenalty(budget=8).resolve(24)  # one compile per class
  assert _NegPenalty(budget=8).resolve(24) != make_policy("fpa_budget", 24, budget=8)


def test_cache_decoder_and_eval_never_branch_on_a_policy_name():
  pkg = ROOT / "fpa_jax"
  files = [p for p in (pkg / "inference").glob("*.py") if p.name != "policies.py"]
  files += [pkg / "eval.py"] if (pkg / "eval.py").exists() else sorted((pkg / "eval").glob("*.py"))
  branch = re.compile(r"\.name (==|!=|in |not in )|\bname in \(")
  hits = [f"{p.name}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
  assert not hits, hits


def test_both_clis_take_the_same_policy_flags():
  from fpa_jax.inference.__main__ import parse_args as generate_args

  flags = ["--policy", "fpa_global", "--budget", "0.25", "--recent", "2", "--head-cap", "0.5", "--pool-impl", "masked"]
  g = generate_args(["--workdir", "w", "--prompt", "x", *flags])
  e = ev.parse_args(["--workdir", "w", "--task", "passkey", *flags])
  want = CachePolicy("fpa_global", budget=0.25, recent=2, head_cap=0.5, pool_impl="masked")
  assert policy_from_args(g) == policy_from_args(e) == want
  assert policy_from_args(generate_args(["--workdir", "w", "--prompt", "x"])) == CachePolicy("full")
  with pytest.raises(ValueError, match="given twice"):
    policy_from_args(e, recent=3)
  assert isinstance(want.resolve(64), FPAGlobal) and isinstance(want.resolve(64), PolicyRule)
