"""The trainer configs the LM studies build (`experiments._common.study_config` over each study's model,
run and recipe): for every method, at the studies' default flags, the fields each study trained its
committed runs with, so a shared builder cannot move a run's config. The recipes themselves are frozen
in test_recipes.py. CPU, seconds (no training)."""

from __future__ import annotations

import argparse

import pytest

from experiments import bindings_lm, forget_train, lm_ablations, one_recipe, passkey, perplexity
from experiments.recipes import ONE_RECIPE
from fpa_jax.configs import get_config

# the byte LM all of them train at their default flags
BYTE_LM = {"n_layers": 2, "d_model": 128, "n_heads": 4, "d_ff": 0, "block_size": 64, "vocab_size": 259}
BYTE_DATA = {"data_dir": "data", "small_data": False, "tokenizer": "bytes"}
PASSKEY_RUN = {
  **BYTE_LM,
  **BYTE_DATA,
  "task": "passkey",
  "seq_len": 512,
  "batch_size": 8,
  "lr": 2e-3,
  "warmup_steps": 50,
  "log_every": 10,
  "ckpt_every": 100,
}


def _same(cfg, fields: dict, recipe: dict) -> None:
  """`cfg` is the `small` preset with `fields`, then the method's `recipe`, and nothing else."""
  assert cfg.to_dict() == get_config("small", **{**fields, **recipe}).to_dict()


@pytest.mark.parametrize("method", list(one_recipe.METHODS))
def test_one_recipe_config(method):
  args = one_recipe.parse_args([])
  args.seed = 1
  want = {**PASSKEY_RUN, "steps": 300, "lr_decay_steps": 3000, "min_lr_ratio": 0.1, "seed": 1}
  _same(one_recipe.study_config(method, args, 300), want, one_recipe.METHODS[method])


@pytest.mark.parametrize("method", list(passkey.METHODS))
def test_passkey_config(method):
  args = passkey.parse_args([])
  args = args[0] if isinstance(args, tuple) else args
  want = {**PASSKEY_RUN, "lr_decay_steps": 1500, "min_lr_ratio": 1.0, "seed": 0}
  recipe = passkey.METHODS[method]
  _same(passkey.study_config(method, args, 300), {**want, "steps": 300, "cooldown_steps": 0}, recipe)
  # a cooldown stage, and an objective's ramp from where the stage starts (for a method with one)
  ramp = {"evict_ramp_start": 600} if "evict_weight" in recipe else {}
  cfg = passkey.study_config(method, args, 1700, 200, ramp_start=600)
  _same(cfg, {**want, "steps": 1700, "cooldown_steps": 200}, {**recipe, **ramp})


PPL_RUN = {**BYTE_LM, **BYTE_DATA, "task": "text", "seq_len": 256, "batch_size": 8, "lr": 2e-3, "warmup_steps": 30}
PPL_RUN |= {"min_lr_ratio": 0.1, "log_every": 10, "ckpt_every": 100}


@pytest.mark.parametrize("method", list(perplexity.METHODS))
def test_perplexity_config(method):
  args = perplexity.parse_args([])
  want = {**PPL_RUN, "steps": 300, "seed": 1}
  _same(perplexity.study_config(method, args, 1), want, perplexity.METHODS[method])


@pytest.mark.parametrize("row", list(lm_ablations.ROWS))
def test_lm_ablations_config(row):
  args = lm_ablations.parse_args([])
  extra = {"eval_every": args.eval_every, "heldout_windows": args.heldout_windows}
  recipe = {**lm_ablations.ROWS[row][0], **extra}
  _same(perplexity.study_config(row, args, 0, overrides=recipe), {**PPL_RUN, "steps": 600, "seed": 0}, recipe)


@pytest.mark.parametrize("variant", forget_train.VARIANTS)
def test_forget_train_config(variant):
  args = argparse.Namespace(
    steps=400, seq_len=2048, batch_size=2, layers=2, d_model=128, heads=4, block_size=128, lr=2e-3, warmup=50,
    seed=0, eps=1e-3, ramp_start=50, ramp_steps=150, data_dir="data", small_data=False,
  )  # fmt: skip
  want = {**BYTE_LM, **BYTE_DATA, "block_size": 128, "attn_impl": "chunked", "task": "text", "seq_len": 2048}
  want |= {"batch_size": 2, "steps": 400, "lr": 2e-3, "warmup_steps": 50, "seed": 0}
  recipe = {**ONE_RECIPE["recipe_t25_fh0"], "evict_ramp_start": 50, "evict_ramp_steps": 150}
  if variant == "keys":
    recipe |= {"skip_tolerance": 1e-3, "skip": "keys"}
  _same(forget_train.study_config(args, variant), want, recipe)


@pytest.mark.parametrize("method", list(bindings_lm.METHODS))
def test_bindings_lm_config(method):
  args = bindings_lm.parse_args([])
  want = {**BYTE_LM, "block_size": 32, "vocab_size": 83, "task": "synthetic", "seq_len": 128, "batch_size": 16}
  want |= {"steps": 3000, "warmup_steps": 50, "lr": 3e-3, "seed": 2, "log_every": 50, "ckpt_every": 500}
  _same(bindings_lm.study_config(method, args, 2, 83), want, bindings_lm.METHODS[method])
