"""KV-cache eviction policies and the bound behind the `fpa` tolerance policy.

Policies (`Policy.name`):
  full          keep every key (the cache must hold the whole sequence).
  fpa           evict a key once its first-passage penalty reaches tau = 2U + log N - log eps:
                all evicted keys together then carry at most eps of any later query's attention
                (see `tolerance_threshold`). U is a bound on |scale q.k| from the parameters.
  fpa_threshold evict a key once its penalty reaches a given tau (the plain knob).
  fpa_budget    capacity C; when full, evict the key with the largest current penalty (ties: oldest).
  window        capacity C; the last C keys.
  sink_window   capacity C; the first `n_sink` = 4 keys and the last C - 4 (StreamingLLM).
  h2o           capacity C; the C/2 most recent keys plus the heavy hitters by attention mass
                received so far (Zhang et al. 2023); when full, evict the lightest non-recent key.

Eviction is per (row, head): heads forget on their own schedule. A key's penalty never decreases
as decoding goes on (its running min of the field can only fall), so an evicted `fpa` key would
never have come back. The same holds for FoX models (FoX's penalty is a sum of decays).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

PolicyName = Literal["full", "fpa", "fpa_threshold", "fpa_budget", "window", "sink_window", "h2o"]
POLICIES: tuple[str, ...] = PolicyName.__args__
BUDGETED = ("fpa_budget", "window", "sink_window", "h2o")  # need a budget (their capacity)
THRESHOLDED = ("fpa", "fpa_threshold")  # evict by penalty threshold
N_SINK = 4


@dataclasses.dataclass(frozen=True)
class Policy:
  """A resolved policy (static under jit). `capacity`: slots per (row, head) the policy may fill."""

  name: str
  capacity: int
  tolerance: float | None = None  # fpa
  threshold: float | None = None  # fpa_threshold
  n_sink: int = N_SINK

  @property
  def thresholded(self) -> bool:
    return self.name in THRESHOLDED


def resolve_budget(budget: float | int | None, seq_len: int) -> int | None:
  """A fraction in (0, 1] of `seq_len` (float) or an absolute count (int) -> a key count."""
  if budget is None:
    return None
  if isinstance(budget, bool) or not isinstance(budget, (int, float)):
    raise ValueError(f"budget must be a fraction in (0, 1] or a positive int count, got {budget!r}")
  if budget <= 0:
    raise ValueError(f"budget must be > 0, got {budget}")
  if isinstance(budget, float):
    if budget > 1.0:
      raise ValueError(
        f"a float budget is a fraction of the sequence length and must be <= 1, got {budget}; "
        "pass an int for an absolute number of keys"
      )
    return max(1, int(math.ceil(budget * seq_len)))
  return int(budget)


def make_policy(
  name: str,
  seq_len: int,
  *,
  budget: float | int | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
) -> Policy:
  """Check the arguments of a policy for sequences of up to `seq_len` keys; raise what to change.

  The capacity is the budget for budgeted policies; otherwise `seq_len`, or the budget if one is
  given (a bounded buffer: if an `fpa`/`fpa_threshold` cache is full the largest penalty goes, and
  the stats report it as an overflow, since the tolerance bound then no longer holds).
  """
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r}; use one of {POLICIES}")
  cap = resolve_budget(budget, seq_len)
  if name in BUDGETED and cap is None:
    raise ValueError(f"policy {name!r} needs a budget (a fraction of the sequence, e.g. 0.25, or a key count)")
  if name == "fpa" and (tolerance is None or not 0.0 < tolerance < 1.0):
    raise ValueError(
      f"policy 'fpa' needs a tolerance in (0, 1) (the attention mass evicted keys may carry), got {tolerance!r}"
    )
  if name == "fpa_threshold" and (threshold is None or not threshold > 0):
    raise ValueError(f"policy 'fpa_threshold' needs a threshold > 0 (a penalty in nats), got {threshold!r}")
  if name != "fpa" and tolerance is not None:
    raise ValueError(f"tolerance only applies to policy 'fpa', not {name!r}")
  if name != "fpa_threshold" and threshold is not None:
    raise ValueError(f"threshold only applies to policy 'fpa_threshold', not {name!r}")
  if name == "full" and cap is not None and cap < seq_len:
    raise ValueError(
      f"policy 'full' keeps all {seq_len} keys but the budget allows {cap}; raise the budget or pick an evicting policy"
    )
  if name == "sink_window" and cap is not None and cap <= N_SINK:
    raise ValueError(f"sink_window keeps {N_SINK} sink keys plus a window: budget must be > {N_SINK}, got {cap}")
  if name == "h2o" and cap is not None and cap < 2:
    raise ValueError(f"h2o splits its budget into recent and heavy halves: budget must be >= 2, got {cap}")
  return Policy(name, min(cap, seq_len) if cap is not None else seq_len, tolerance, threshold)


# ------------------------------------------------------------------------------------------------
# The bound
# ------------------------------------------------------------------------------------------------


def _sigma_max(m: jax.Array) -> jax.Array:
  """Largest singular value of each [..., D, K] matrix."""
  return jnp.linalg.svd(m.astype(jnp.float32), compute_uv=False)[..., 0]


def logit_bound(
  norm_scale: jax.Array,
  wq: jax.Array,
  wk: jax.Array,
  *,
  scale: float,
  q_norm_scale: jax.Array | None = None,
  k_norm_scale: jax.Array | None = None,
) -> jax.Array:
  """U [KVH]: a bound on |scale * q.k| over every input, from one layer's parameters.

  The block input goes through an RMSNorm with scale g [D] before the projections: y = x/rms(x) * g
  with ||x/rms(x)||_2 <= sqrt(D), so ||q_h|| <= sqrt(D) * sigma_max(diag(g) Wq[:, h, :]) (same for k),
  and RoPE is a rotation. With QK-norm (scales s_q, s_k [K]) the bound is sqrt(K) * max|s| per side.
  Then U_h = scale * ||q_h|| * ||k_h||. Grouped-query (wk [D, KVH, K]): per kv head, the max over
  the query heads of its group (the cache thresholds are per kv head). Computed in fp32; valid for
  fp32 compute (bf16 rounding can exceed it by ~1%).
  """
  d, h, k = wq.shape
  kvh = wk.shape[1]
  if q_norm_scale is not None:
    nq = jnp.sqrt(k) * jnp.max(jnp.abs(q_norm_scale))
    nk = jnp.sqrt(k) * jnp.max(jnp.abs(k_norm_scale))
    return jnp.full((kvh,), scale * nq * nk, jnp.float32)
  g = norm_scale.astype(jnp.float32)[:, None, None]
  per_head = lambda w: _sigma_max(jnp.moveaxis(g * w.astype(jnp.float32), 1, 0))  # [heads]
  return scale * d * per_head(wq).reshape(kvh, h // kvh).max(-1) * per_head(wk)


def tolerance_threshold(u: jax.Array, n_keys: int, tolerance: float) -> jax.Array:
  """tau = 2U + log N - log eps: evicting keys whose penalty reached tau loses <= eps of the mass.

  At query i the full-cache weight of key e is exp(s_ie - pen_ie) / Z with s_ie <= U and
  Z >= exp(s_ii) >= exp(-U) (the query's own key, penalty 0, is always kept), so it is at most
  exp(2U - pen_ie) <= exp(2U - tau) once e's penalty reached tau (penalties never decrease). With at
  most N evicted keys the lost mass is <= N exp(2U - tau) = eps; the output then moves by at most
  2 eps max_j ||v_j||. Same form as FoX's Adaptive Computation Pruning threshold.
  """
  return 2.0 * u + math.log(n_keys) - math.log(tolerance)
