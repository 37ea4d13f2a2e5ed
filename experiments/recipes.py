"""The studies' model recipes: config overrides on top of a study's model and training settings.

The library keeps one recommended recipe (`fpa_jax.configs.LM_DEFAULT`); every other recipe a study
trains is a row of that study and lives here, with the reason it exists. `ONE_RECIPE` is the set the
one-recipe study (`experiments.one_recipe`) trains from scratch, seed by seed:

  fox                  FoX at the weak-decay init (forget-gate bias 5: sigmoid(5) = 0.993), the baseline
  recipe               the library's LM default at the same bias, trained with the evictability objective
  recipe_no_objective  the same without the objective: the objective's text cost, paired by seed
  recipe_late          the objective ramped only once retrieval is learned (steps 1500..2100)
  recipe_late_fh0      recipe_late with no FoX head (`fox_heads=0`): every head can keep a far key alone
"""

from __future__ import annotations

from typing import Any

from fpa_jax.configs import LM_DEFAULT, SINGLE_HEAD_GATE

# The evictability objective as the LM studies train it from scratch (`fpa_jax.losses`): the hinge
# on the soft live fraction of keys older than 16 tokens, its target ramped (DMS) from 1 to 0.1 over
# steps 300..1500, after the model has started to learn the task.
EVICT_FROM_SCRATCH: dict[str, Any] = {
  "evict_weight": 1.0,
  "evict_target": 0.1,
  "evict_window": 16,
  "evict_ramp_start": 300,
  "evict_ramp_steps": 1200,
}

# ... started late, as DMS retrofits a trained model but inside one run: from step 300 the hinge drove
# every gate to forget everything (soft live fraction 0.02 by step 900, below the 0.1 target) before
# retrieval was learned (`recipe`, seed 2: 1x validation 0.00 to step 1800).
EVICT_LATE: dict[str, Any] = {**EVICT_FROM_SCRATCH, "evict_ramp_start": 1500, "evict_ramp_steps": 600}

# FoX's forget gate at bias 5 (weak decay at init): the init at which FoX learns passkey retrieval
# in the passkey study (bias 0, the FoX paper's, did not within its budget).
FOX_B5: dict[str, Any] = {**SINGLE_HEAD_GATE, "attention": "fox", "gate_bias_init": 5.0}
# The LM default's gate started exactly at FOX_B5 (the read-outs at 0, FoX's term at bias 5).
RECIPE_GATE: dict[str, Any] = {**LM_DEFAULT, "attention": "fpa", "gate_bias_init": 5.0, "step_bias_init": 0.0}

ONE_RECIPE: dict[str, dict[str, Any]] = {
  "fox": FOX_B5,
  "recipe": {**RECIPE_GATE, **EVICT_FROM_SCRATCH},
  "recipe_no_objective": RECIPE_GATE,
  "recipe_late": {**RECIPE_GATE, **EVICT_LATE},
  "recipe_late_fh0": {**RECIPE_GATE, "fox_heads": 0, **EVICT_LATE},
}
