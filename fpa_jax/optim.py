"""The gate's optimizer parts, for any optax / NNX training step (the trainer uses the same ones).

    import optax
    from flax import nnx
    from fpa_jax import optim
    tx = optim.gate_optimizer(optax.adamw(3e-3), recipe="lm")   # the recommended recipe's parts
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

The FPA gate's step / absolute / offset read-outs (`fpa_jax.gates`) are found by name
(`gate_readout_mask`); the recipe (`configs.LM_DEFAULT`, docs/design.md) treats them apart from every
other weight in two ways:
  - clipping: their gradient is clipped by its own global norm (`clip_by_global_norm_apart`); with
    one norm their gradient, large from step 0 even at zero read-outs, shrinks every other update,
    so an FPA model whose read-outs never moved would still train another trajectory than FoX;
  - learning rate: their update is multiplied by `gate_lr_scale`, ramped from 0 over
    `gate_lr_warmup_steps` (`scale_gate_readouts`): started at 0 the read-outs leave the model
    FoX's, which learns first; FPA's extremum terms come in as the ramp rises.
FoX's own forget term is not a read-out here: it trains as every other weight.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from fpa_jax.configs import TrainConfig, gate_recipe

GATE_READOUTS = ("step", "absolute", "offset")  # `gates.Gate`'s extremum read-outs (not `forget`)
OPTIONS = ("gate_clip_apart", "gate_lr_scale", "gate_lr_warmup_steps")  # the recipes' optimizer fields


def gate_readout_mask(params):
  """optax mask: True on every leaf under a `gate` module's step / absolute / offset read-out (the
  names `FirstPassageAttention` gives them), False elsewhere. `params`: any pytree of parameters
  keyed by module path (an `nnx.State`, as `nnx.Optimizer` and `nnx.split` give)."""

  def one(path, _):
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return "gate" in keys and any(r in keys for r in GATE_READOUTS)

  return jax.tree_util.tree_map_with_path(one, params)


def clip_by_global_norm_apart(max_norm: float, mask_fn: Callable = gate_readout_mask) -> optax.GradientTransformation:
  """optax.clip_by_global_norm on two groups, each by its own norm: the leaves where `mask_fn(updates)`
  is True (the gate read-outs) and the rest (why: the module docstring; `experiments.clip_coupling`).
  Stateless, like clip_by_global_norm, so either one restores the other's optimizer state."""

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    marks = treedef.flatten_up_to(mask_fn(updates))

    def factor(group: bool):
      sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x, m in zip(leaves, marks) if bool(m) == group]
      if not sq:
        return None
      norm = jnp.sqrt(sum(sq))
      return jnp.where(norm < max_norm, 1.0, max_norm / norm)

    f = {g: factor(g) for g in (True, False)}
    out = [(x * f[bool(m)]).astype(x.dtype) for x, m in zip(leaves, marks)]
    return jax.tree_util.tree_unflatten(treedef, out), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scale_gate_readouts(
  scale: float, warmup_steps: int = 0, mask_fn: Callable = gate_readout_mask
) -> optax.GradientTransformation:
  """Multiply the read-outs' updates (`mask_fn`) by `scale`, ramped linearly from 0 over `warmup_steps`
  updates (0: constant). Chained after the base optimizer, so it scales their whole update (weight
  decay included): their learning rate. scale=1 without a ramp is the identity."""
  if warmup_steps:
    return optax.masked(optax.scale_by_schedule(optax.linear_schedule(0.0, scale, warmup_steps)), mask_fn)
  return optax.masked(optax.scale(scale), mask_fn)


def gate_optimizer(
  tx: optax.GradientTransformation,
  *,
  recipe: str | None = "lm",
  clip_norm: float = 1.0,
  mask_fn: Callable = gate_readout_mask,
  **options,
) -> optax.GradientTransformation:
  """`tx` (e.g. `optax.adamw(lr)`) with the gate recipe's optimizer parts around it:
  chain(clip, tx, read-out lr scale), each part only where the settings ask for it (none at all: `tx`).

  recipe: a name of `configs.GATE_RECIPES` ("lm": `configs.LM_DEFAULT`, the layer's
    `from_args(recipe="lm")`), whose `gate_clip_apart`, `gate_lr_scale` and `gate_lr_warmup_steps`
    are the defaults; None: give all three in `options`.
  clip_norm: global-norm gradient clipping, > 0 (0 = none); with `gate_clip_apart` the read-outs
    and the other weights each by their own norm (`clip_by_global_norm_apart`).
  options: `gate_clip_apart` (bool), `gate_lr_scale` (> 0, the read-outs' lr multiplier),
    `gate_lr_warmup_steps` (int >= 0, its ramp from 0); they override the recipe's.
  The trainer builds its optimizer with this (`fpa_jax.train.make_optimizer`). Raises ValueError
  naming the argument to change."""
  bad = sorted(set(options) - set(OPTIONS))
  if bad:
    raise ValueError(f"unknown argument(s) {bad}; gate_optimizer takes {OPTIONS}")
  opts = {**(gate_recipe(recipe, "train") if recipe is not None else {}), **options}
  missing = [k for k in OPTIONS if k not in opts]
  if missing:
    raise ValueError(f"recipe=None needs every optimizer setting: give {missing} (or a recipe, e.g. recipe='lm')")
  checks = {f.name: f.metadata["check"] for f in dataclasses.fields(TrainConfig)}  # the config fields' own
  for k, v in {"clip_norm": clip_norm, **opts}.items():
    checks[k](k, v)
  parts = []
  if clip_norm > 0:
    parts.append(
      clip_by_global_norm_apart(clip_norm, mask_fn) if opts["gate_clip_apart"] else optax.clip_by_global_norm(clip_norm)
    )
  parts.append(tx)
  if opts["gate_lr_warmup_steps"] or opts["gate_lr_scale"] != 1.0:
    parts.append(scale_gate_readouts(opts["gate_lr_scale"], opts["gate_lr_warmup_steps"], mask_fn))
  return optax.chain(*parts) if len(parts) > 1 else tx
