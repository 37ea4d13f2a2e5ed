"""A head budget: the split of a KV budget between (layer, kv head)s, chosen once and then fixed.

`fpa_global` splits one budget between heads as it decodes (the largest penalties across every
layer and head go first), which holds retrieval where a per-head budget loses it, but its shared
pool is slow to read. `fpa_heads` (`policies.FPAHeads`) decodes at the per-head speed of
`fpa_budget` with a capacity of its own per head; this module gives it its split:

    split = calibrate_head_split(model, prompts, 0.125)      # [L, KVH], fpa_global's split on prompts
    save_head_split("my_model", split, 0.125)                # head_split.json beside params.npz
    split, budget = load_head_split("my_model")
    tokens, stats = generate(model, prompts, 32, policy=FPAHeads(budget=budget, split=split))

A split is [L, KVH] float: each (layer, kv head)'s kept fraction of the sequence, in [0, 1], its
mean the budget (so its keys sum to the budget's: budget * L * KVH * T). By hand: AdaKV's or
DuoAttention's split (retrieval heads near 1, streaming heads near 0, `normalise_split` to the budget).
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fpa_jax.inference.decode import Decoder, _split_on_one_device
from fpa_jax.inference.graph import vocab_size
from fpa_jax.inference.policies import CachePolicy, FPAGlobal
from fpa_jax.inference.split_file import SPLIT_FILE, load_head_split, split_path  # noqa: F401  (public here)


def normalise_split(share, budget: float) -> np.ndarray:
  """share [L, KVH] >= 0 (any scale: keys held, shares of the budget) -> the split of `budget`: the
  same proportions, mean `budget`, no head above 1 (a head's whole sequence; what it would get past
  that goes to the others in proportion, water-filling). An all-zero share: every head the budget.
  ValueError on a negative, NaN or infinite share, or a budget outside (0, 1]."""
  x = np.asarray(share, np.float64)
  if x.ndim != 2 or x.size == 0:
    raise ValueError(f"share must be [layers, kv heads], got shape {x.shape}")
  if not np.all(np.isfinite(x)) or np.any(x < 0):
    raise ValueError("share must be finite and >= 0 (keys held per head, or shares of the budget)")
  if isinstance(budget, bool) or not isinstance(budget, float) or not 0.0 < budget <= 1.0:
    raise ValueError(f"budget must be a fraction in (0, 1] (the mean kept fraction per head), got {budget!r}")
  if not np.any(x > 0):
    return np.full(x.shape, budget)
  total = budget * x.size  # the kept fractions summed over heads
  out = np.zeros_like(x)
  free = np.ones(x.shape, bool)
  while True:  # at most L * KVH rounds: each clips at least one more head to 1
    left = total - out[~free].sum()
    w = np.where(free, x, 0.0)
    if w.sum() <= 0:  # only zero-share heads left: they share what remains evenly
      w = free.astype(np.float64)
    y = np.where(free, w * left / w.sum(), out)
    over = free & (y > 1.0)
    if not over.any():
      return np.minimum(y, 1.0)
    out[over], free[over] = 1.0, False


def calibrate_head_split(
  model,
  prompts,
  budget: float,
  *,
  batch_size: int = 8,
  recent: int | None = None,
  prefill: Literal["parallel", "decode"] = "parallel",
  show_progress: bool = True,
) -> np.ndarray:
  """Where `fpa_global` at `budget` puts its keys on `prompts` -> the split [L, KVH] for `FPAHeads`.

  Each prompt is prefilled under `fpa_global` (`prefill`: "parallel", the whole prompt at once then
  the global cut, or "decode", token by token); each head's share is the keys it holds after the
  prompt over the prompt's length, averaged over the prompts, then scaled to a mean of `budget`
  (`normalise_split`: the pool holds a little less than the budget, its tags and a step's room).
  Deterministic: the same model, prompts and budget give the same split.

  model: a `DecoderLM` or a model of your own (`inference.graph`); prompts: int [N, T] or a list of
    token sequences (padded here to the longest; the budget is a fraction of it); budget: a fraction
    in (0, 1]; recent: fpa_global's W (default budget // 8, as `FPAHeads`); batch_size: prompts per
    call (one compile: the last batch is padded with copies); show_progress: a bar over the batches
    (`fpa_jax.eval`'s). ValueError before tracing on an empty set, an int budget, or a bad token.
  """
  from fpa_jax.eval.tables import progress  # the package's bar (fpa_jax.eval sits above inference)

  if isinstance(budget, bool) or not isinstance(budget, float) or not 0.0 < budget <= 1.0:
    raise ValueError(
      f"calibrate at a fractional budget in (0, 1] (the split is kept fractions of the sequence), got {budget!r}"
    )
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  rows = _token_rows(prompts)
  vocab = vocab_size(model)
  if any(r.min(initial=0) < 0 or r.max(initial=0) >= vocab for r in rows):
    raise ValueError(f"prompt tokens must be in [0, vocab_size={vocab})")
  width = max(len(r) for r in rows)
  dec = Decoder(model, FPAGlobal(budget=budget, recent=recent), max_len=width)  # checked here, before tracing
  dec.policy.check_prefill(prefill)
  graphdef, state = _split_on_one_device(model)
  pol = dec.policy

  @jax.jit
  def held(state, tokens, lengths):  # -> [L, B, KVH] keys each head holds after its prompt
    _, st = Decoder(nnx.merge(graphdef, state), pol, max_len=width).prefill(tokens, lengths, mode=prefill)
    return st.occupancy()[1]

  shares = []
  starts = range(0, len(rows), batch_size)
  for i in progress(starts, enabled=show_progress, desc="calibrate_head_split", total=len(starts)):
    part = rows[i : i + batch_size]
    n = len(part)
    part = part + [part[0]] * (batch_size - n) if len(rows) > batch_size else part  # one shape, one compile
    tokens = np.stack([np.pad(r, (0, width - len(r))) for r in part]).astype(np.int32)
    lengths = np.asarray([len(r) for r in part], np.int32)
    h = np.asarray(jax.device_get(held(state, jnp.asarray(tokens), jnp.asarray(lengths))), np.float64)
    shares += list((h / lengths[None, :, None]).transpose(1, 0, 2)[:n])  # per prompt [L, KVH]
  return normalise_split(np.mean(shares, axis=0), budget)


def _token_rows(prompts) -> list[np.ndarray]:
  if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f"prompts must be int [N, T] or a list of token sequences, got shape {arr.shape}")
    rows = list(arr)
  else:
    rows = [np.asarray(r).reshape(-1) for r in prompts]
  if not rows or any(len(r) == 0 for r in rows):
    raise ValueError("calibrate on at least one non-empty prompt")
  if any(not np.issubdtype(r.dtype, np.integer) for r in rows):
    raise ValueError("prompts must hold int tokens")
  return [r.astype(np.int64) for r in rows]


def save_head_split(path: str | os.PathLike, split, budget: float, *, meta: dict[str, Any] | None = None) -> str:
  """Write a split [L, KVH] and its budget as `head_split.json` into `path` (an `export_model`
  folder: beside its params.npz; or a path ending in .json) -> the file written. `meta`: anything
  JSON (how it was calibrated: prompts, commit). Checked as `FPAHeads` checks it (ValueError)."""
  pol = CachePolicy("fpa_heads", budget=budget, split=split)  # the policy's own checks
  out = split_path(path)
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  rec = {
    "split": [list(r) for r in pol.split],
    "budget": pol.budget,
    "layers": len(pol.split),
    "kv_heads": [len(r) for r in pol.split],
    "meta": meta or {},
  }
  with open(out, "w") as f:
    json.dump(rec, f, indent=1)
  return out
