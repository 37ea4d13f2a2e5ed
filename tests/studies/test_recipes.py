"""The studies' recipes (`experiments.recipes`): every method's config overrides are frozen, so every
study's committed numbers stay reproducible from its command; the gate presets the studies spread.
CPU, seconds (no training)."""

from __future__ import annotations

import hashlib
import json

import pytest

from experiments import bindings_lm, clip_coupling, live_sets, lm_ablations, one_recipe, passkey, perplexity, recipes
from fpa_jax import configs as C


def _methods() -> dict[tuple[str, str], dict]:
  """(study, method) -> its config overrides, read where each study reads them."""
  out = {("passkey", m): o for m, o in passkey.METHODS.items()}
  out |= {("perplexity", m): o for m, o in perplexity.METHODS.items()}
  out |= {("lm_ablations", m): o for m, (o, _) in lm_ablations.ROWS.items()}
  out |= {("bindings_lm", m): o for m, o in bindings_lm.METHODS.items()}
  out |= {("clip_coupling", m): o for m, o in clip_coupling.RUNS.items()}
  out |= {("one_recipe", m): o for m, o in one_recipe.METHODS.items()}
  out |= {("live_sets", m): o for m, o in live_sets.ABLATIONS.items()}
  return out


def _digest(over: dict) -> str:
  return hashlib.sha256(json.dumps(over, sort_keys=True).encode()).hexdigest()[:12]


# Fields made gate presets after the digests below were frozen, at the value every row trained with
# then (the base default): a row that now pins one at that value runs exactly as before.
LATER_PINNED = {"gate_bias_init": 0.0}


def _as_frozen(over: dict) -> list[dict]:
  """The row as it may have been frozen: as is, or without the later-pinned fields at their old value."""
  bare = {k: v for k, v in over.items() if not (k in LATER_PINNED and v == LATER_PINNED[k])}
  return [over, bare]


# sha256 (first 12 hex digits) of each method's overrides as sorted JSON, as committed runs were
# trained with them. A method added later is not listed (add it here once its runs are committed);
# a listed one must not change: give a changed recipe a new method name instead.
FROZEN_DIGESTS = {
  ("bindings_lm", "fox"): "16154de3dd7f",
  ("bindings_lm", "fpa"): "5759ab2a6916",
  ("bindings_lm", "fpa_bloop"): "52ffb8a1390e",
  ("bindings_lm", "fpa_evict"): "4a8de99e81c5",
  ("bindings_lm", "softmax"): "f584e58cad9d",
  ("bindings_lm", "stack"): "c25090f5d863",
  ("clip_coupling", "fox_b5"): "44136fa355b3",
  ("clip_coupling", "fpa_still_clip_apart"): "f6811ed15ecd",
  ("clip_coupling", "fpa_still_one_clip"): "2586ea5f92d0",
  ("live_sets", "fpa (default)"): "73dc1546a61b",
  ("live_sets", "fpa absolute_scale=1"): "0a806fe52225",
  ("live_sets", "fpa all-zero init"): "0bae43bf74db",
  ("live_sets", "fpa gate_forget=True"): "660a38b56f1b",
  ("live_sets", "fpa no absolute (step,offset)"): "ff41987afa28",
  ("live_sets", "fpa no walk (absolute,offset)"): "5ae757932bbb",
  ("live_sets", "fpa offset_scale=1"): "67d648bdec5a",
  ("live_sets", "fpa step_bias_init=-1e-3, zero weights"): "dfdfb9d11f29",
  ("live_sets", "fpa step_scale=1"): "d766e07e6e1e",
  ("live_sets", "fpa weights ~N(0, 1e-3), no bias"): "1770da59cb97",
  ("live_sets", "stack (default)"): "4af5c95299cd",
  ("live_sets", "stack gate_forget=True"): "562df90aed26",
  ("live_sets", "stack step_bias_init=-1e-3, zero weights"): "1e38338c0ad8",
  ("live_sets", "stack weights ~N(0, 1e-3), no bias"): "3c3eae4d8216",
  ("lm_ablations", "fox"): "c64a914aec76",
  ("lm_ablations", "fox_absolute"): "e9864d7bb4ed",
  ("lm_ablations", "fox_offset"): "96c043c443ba",
  ("lm_ablations", "fox_step"): "1b6cb5b3371d",
  ("lm_ablations", "fpa"): "f10b6b67c8aa",
  ("lm_ablations", "fpa_fox0"): "fde125a0adf5",
  ("lm_ablations", "fpa_fox0_glr0.1"): "70dfcf619774",
  ("lm_ablations", "fpa_fox0_init0"): "a52a81c82e00",
  ("lm_ablations", "fpa_fox0_scale1"): "9d13d0485c26",
  ("lm_ablations", "fpa_scale1"): "e70b49437154",
  ("one_recipe", "fox"): "185062e83841",
  ("one_recipe", "recipe"): "9d6604563e8c",
  ("one_recipe", "recipe_late"): "59df415cfb67",
  ("one_recipe", "recipe_late_fh0"): "8d3ca9f54068",
  ("one_recipe", "recipe_no_objective"): "411a875fbfbc",
  ("passkey", "fox"): "6b223cbcada4",
  ("passkey", "fox_b5"): "185062e83841",
  ("passkey", "fpa"): "f10b6b67c8aa",
  ("passkey", "fpa_fox5"): "93ae1f2b8b86",
  ("passkey", "fpa_fox5_cont"): "93ae1f2b8b86",
  ("passkey", "fpa_fox5_evict"): "2133dd30e7de",
  ("passkey", "fpa_lm5"): "04d6e10d434f",
  ("passkey", "fpa_lm5_init0"): "530d4452a4d7",
  ("passkey", "fpa_lm5_slow"): "a39e02ebff94",
  ("passkey", "fpa_lm5_still"): "f04ac4d3af59",
  ("passkey", "fpa_lm5_warm"): "a968dd067509",
  ("passkey", "fpa_lm5_warmc"): "c8f9b1b50956",
  ("passkey", "fpa_lm5_warmc10"): "768ecf62279d",
  ("passkey", "fpa_lm5_warmc10_fh1"): "411a875fbfbc",
  ("passkey", "fpa_lm5_warmc10_r3000"): "b91726071591",
  ("passkey", "softmax"): "be908d82c66e",
  ("passkey", "stack"): "475b83d8f3e9",
  ("passkey", "stack_fox5"): "c015c90e4eee",
  ("perplexity", "fox"): "c64a914aec76",
  ("perplexity", "fpa"): "f10b6b67c8aa",
  ("perplexity", "fpa_fox0"): "fde125a0adf5",
  ("perplexity", "fpa_fox5"): "1381c5a98a8b",
  ("perplexity", "fpa_lm"): "5759ab2a6916",
  ("perplexity", "fpa_lm_evict"): "4a8de99e81c5",
  ("perplexity", "fpa_lm_warm"): "0b5542f69d66",
  ("perplexity", "fpa_lm_warmc10"): "751cdc9637e6",
  ("perplexity", "fpa_lm_warmc10_fh1"): "e66e78ea52f5",
  ("perplexity", "softmax"): "be908d82c66e",
  ("perplexity", "stack"): "475b83d8f3e9",
}

# A few key methods in full: what the digests above stand for.
FROZEN = {
  ("passkey", "fpa_lm5_warmc10_fh1"): {
    'absolute_init_std': 0.0,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'fox_heads': 1,
    'gate_bias_init': 5.0,
    'gate_clip_apart': True,
    'gate_forget': True,
    'gate_lr_scale': 0.1,
    'gate_lr_warmup_steps': 1200,
    'offset_init_std': 0.0,
    'offset_scale': 1.0,
    'step_bias_init': 0.0,
    'step_init_std': 0.0,
    'step_scale': 1.0,
  },
  ("passkey", "fox_b5"): {
    'absolute_init_std': 0.001,
    'absolute_scale': 10.0,
    'attention': 'fox',
    'fox_heads': 0,
    'gate_bias_init': 5.0,
    'gate_clip_apart': False,
    'gate_forget': False,
    'gate_lr_scale': 1.0,
    'gate_lr_warmup_steps': 0,
    'offset_init_std': 0.001,
    'offset_scale': 10.0,
    'step_init_std': 0.001,
    'step_scale': 10.0,
  },
  ("passkey", "fpa_lm5"): {
    'absolute_init_std': 0.001,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'fox_heads': 0,
    'gate_bias_init': 5.0,
    'gate_clip_apart': False,
    'gate_forget': True,
    'gate_lr_scale': 1.0,
    'gate_lr_warmup_steps': 0,
    'offset_init_std': 0.001,
    'offset_scale': 1.0,
    'step_bias_init': 0.0,
    'step_init_std': 0.001,
    'step_scale': 1.0,
  },
  ("perplexity", "fpa_lm_evict"): {
    'absolute_init_std': 0.001,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'evict_ramp_start': 300,
    'evict_ramp_steps': 1200,
    'evict_target': 0.1,
    'evict_weight': 1.0,
    'evict_window': 16,
    'fox_heads': 0,
    'gate_clip_apart': False,
    'gate_forget': True,
    'gate_lr_scale': 1.0,
    'gate_lr_warmup_steps': 0,
    'offset_init_std': 0.001,
    'offset_scale': 1.0,
    'step_init_std': 0.001,
    'step_scale': 1.0,
  },
  ("perplexity", "fpa_lm_warmc10_fh1"): {
    'absolute_init_std': 0.0,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'fox_heads': 1,
    'gate_clip_apart': True,
    'gate_forget': True,
    'gate_lr_scale': 0.1,
    'gate_lr_warmup_steps': 1200,
    'offset_init_std': 0.0,
    'offset_scale': 1.0,
    'step_init_std': 0.0,
    'step_scale': 1.0,
  },
  ("lm_ablations", "fpa_fox0_scale1"): {
    'absolute_init_std': 0.001,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'fox_heads': 0,
    'gate_bias_init': 0.0,
    'gate_clip_apart': False,
    'gate_forget': True,
    'gate_lr_scale': 1.0,
    'gate_lr_warmup_steps': 0,
    'offset_init_std': 0.001,
    'offset_scale': 1.0,
    'step_init_std': 0.001,
    'step_scale': 1.0,
  },
  ("bindings_lm", "fpa_bloop"): {
    'absolute_init_std': 0.001,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'budget_loop_max': 0.3,
    'budget_loop_min': 0.1,
    'budget_loop_prob': 0.5,
    'fox_heads': 0,
    'gate_clip_apart': False,
    'gate_forget': True,
    'gate_lr_scale': 1.0,
    'gate_lr_warmup_steps': 0,
    'offset_init_std': 0.001,
    'offset_scale': 1.0,
    'step_init_std': 0.001,
    'step_scale': 1.0,
  },
  ("one_recipe", "recipe"): {
    'absolute_init_std': 0.0,
    'absolute_scale': 1.0,
    'attention': 'fpa',
    'evict_ramp_start': 300,
    'evict_ramp_steps': 1200,
    'evict_target': 0.1,
    'evict_weight': 1.0,
    'evict_window': 16,
    'fox_heads': 1,
    'gate_bias_init': 5.0,
    'gate_clip_apart': True,
    'gate_forget': True,
    'gate_lr_scale': 0.1,
    'gate_lr_warmup_steps': 1200,
    'offset_init_std': 0.0,
    'offset_scale': 1.0,
    'step_bias_init': 0.0,
    'step_init_std': 0.0,
    'step_scale': 1.0,
  },
  ("live_sets", "fpa all-zero init"): {
    'absolute_init_std': 0.0,
    'attention': 'fpa',
    'offset_init_std': 0.0,
    'step_bias_init': 0.0,
    'step_init_std': 0.0,
  },
}


@pytest.mark.parametrize("key", sorted(FROZEN_DIGESTS), ids=lambda k: f"{k[0]}:{k[1]}")
def test_every_committed_method_keeps_its_overrides(key):
  methods = _methods()
  assert key in methods, f"{key} is gone: a committed study row must stay runnable"
  assert FROZEN_DIGESTS[key] in map(_digest, _as_frozen(methods[key])), f"{key} changed: {sorted(methods[key].items())}"


@pytest.mark.parametrize("key", sorted(FROZEN), ids=lambda k: f"{k[0]}:{k[1]}")
def test_key_methods_in_full(key):
  assert FROZEN[key] in _as_frozen(_methods()[key])
  assert _digest(FROZEN[key]) == FROZEN_DIGESTS[key]


def test_study_names_are_the_recipes():
  """Each study keeps its module-level names; they are the recipes' objects, not copies."""
  assert passkey.METHODS is recipes.PASSKEY and passkey.FAMILY is recipes.PASSKEY_FAMILY
  assert set(passkey.FAMILY) == set(passkey.METHODS)
  assert perplexity.METHODS is recipes.PERPLEXITY and lm_ablations.ROWS is recipes.LM_ABLATIONS
  assert bindings_lm.METHODS is recipes.BINDINGS_LM and clip_coupling.RUNS is recipes.CLIP_COUPLING
  assert live_sets.ABLATIONS is recipes.LIVE_SETS_ABLATIONS and one_recipe.METHODS is recipes.ONE_RECIPE
  from experiments import _common

  assert _common.EVICT_FROM_SCRATCH is recipes.EVICT_FROM_SCRATCH


def test_gate_presets():
  """The LM gate's steps, each a dict of every gate preset field; the last one is the library's
  LM_DEFAULT, defined on its own in fpa_jax.configs."""
  steps = (recipes.LM_GATE, recipes.LM_WARM, recipes.LM_WARM_CLIP, recipes.LM_FOX_FIRST, recipes.LM_FOX_HEAD)
  for preset in (C.SINGLE_HEAD_GATE, C.LM_DEFAULT, *steps):
    assert set(preset) == set(C.GATE_PRESET_FIELDS)
  # the LM default: the one-recipe study's gate (LM_FOX_FIRST on every kv head, FoX's term at bias 5)
  assert C.LM_DEFAULT == {**recipes.LM_FOX_FIRST, "fox_heads": 0, "gate_bias_init": 5.0}
  assert C.LM_DEFAULT == {k: recipes.ONE_RECIPE[recipes.PRETRAIN][k] for k in C.GATE_PRESET_FIELDS}
  assert recipes.LM_GATE == {**C.SINGLE_HEAD_GATE, "gate_forget": True, "step_scale": 1.0, "absolute_scale": 1.0,
                             "offset_scale": 1.0}  # fmt: skip
  assert recipes.LM_WARM == {**recipes.LM_GATE, "step_init_std": 0.0, "absolute_init_std": 0.0,
                             "offset_init_std": 0.0, "gate_lr_warmup_steps": 1200}  # fmt: skip
  assert recipes.LM_WARM_CLIP == {**recipes.LM_WARM, "gate_clip_apart": True}
  assert recipes.LM_FOX_FIRST == {**recipes.LM_WARM_CLIP, "gate_lr_scale": 0.1}
  assert recipes.LM_FOX_HEAD == {**recipes.LM_FOX_FIRST, "fox_heads": 1}


def test_every_method_resolves_to_a_valid_config():
  """Each method's overrides make a valid run config on its study's base ('small'; live_sets: the base
  defaults), i.e. no recipe names a field the configs lost."""
  for (study, m), over in _methods().items():
    if study == "live_sets":
      live_sets.layer_config("scopes", **over)
    else:
      C.get_config("small", **over)


def test_studies_keep_the_gate_their_committed_runs_were_trained_with():
  """Every LM study row pins every gate field (a preset's defaults can change without changing a
  committed row: rerunning one resumes its checkpoints and reproduces its numbers). Rows trained
  before LM_GATE pin SINGLE_HEAD_GATE's scales; the LM rows pin LM_GATE's."""
  rows = [(f"passkey {m}", o) for m, o in passkey.METHODS.items()]
  rows += [(f"perplexity {m}", o) for m, o in perplexity.METHODS.items()]
  rows += [(f"lm_ablations {m}", o) for m, (o, _) in lm_ablations.ROWS.items()]
  rows += [(f"bindings_lm {m}", o) for m, o in bindings_lm.METHODS.items()]
  for name, over in rows:
    assert set(C.GATE_PRESET_FIELDS) <= set(over), name  # pinned, not left to the preset
  scales = ("step_scale", "absolute_scale", "offset_scale")
  lm = lambda name: "fpa_lm" in name or name.startswith("bindings_lm") or "scale1" in name
  for name, over in rows:
    ref = recipes.LM_GATE if lm(name) else C.SINGLE_HEAD_GATE
    assert all(over[k] == ref[k] for k in scales), name
  # the studies' rows of the LM default are trained with it
  for over in (passkey.METHODS[passkey.DEFAULT_METHOD], perplexity.METHODS[perplexity.DEFAULT_ROW]):
    gate = lambda d: {k: d[k] for k in C.GATE_PRESET_FIELDS if k != "gate_bias_init"}  # noqa: E731
    assert gate(over) == gate(recipes.LM_FOX_HEAD)  # the LM default before the one-recipe study
  cold = ["passkey fpa_lm5", "perplexity fpa_lm", "perplexity fpa_lm_evict"] + [
    f"bindings_lm {m}"
    for m in bindings_lm.METHODS
    if m != "fpa_recipe"  # the one-recipe study's recipe, as is
  ]
  for name, over in rows:
    if name in cold:  # trained with LM_GATE as it was: random read-outs, no lr ramp
      assert {k: over[k] for k in C.GATE_PRESET_FIELDS if k not in ("gate_forget", "gate_bias_init")} == {
        k: v for k, v in recipes.LM_GATE.items() if k not in ("gate_forget", "gate_bias_init")
      }, name
