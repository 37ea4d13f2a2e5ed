"""Statistics of an evaluation: Wilson intervals, pooled passkey cells, the cache stats of
several batches merged, and a checked policy's record."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fpa_jax.inference import CachePolicy, as_policy


Z95 = 1.959963984540054  # standard normal quantile at 0.975


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
  """Wilson score interval of a binomial proportion `correct / n` (default 95%).

  (p + z^2 / 2n -/+ z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n), with p = correct / n:
  unlike p -/+ z sqrt(p (1 - p) / n) it stays in [0, 1] and is not empty at p = 0 or 1.
  """
  if isinstance(n, bool) or int(n) != n or n < 1:
    raise ValueError(f"n must be a positive integer count, got {n!r}")
  if int(correct) != correct or not 0 <= correct <= n:
    raise ValueError(f"correct must be an integer in [0, n={n}], got {correct!r}")
  p, z2 = correct / n, z * z
  centre = (p + z2 / (2 * n)) / (1 + z2 / n)
  half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
  return max(0.0, centre - half), min(1.0, centre + half)


def check_policy(policy: str | CachePolicy, seq_len: int, **policy_kw) -> dict[str, Any]:
  """Validate a cache policy for sequences of `seq_len` before any work starts: a name with its
  keywords (budget or compression_ratio, tolerance, threshold, or any other `CachePolicy` field) or
  a `CachePolicy`; -> its JSON record {"policy": name, and each argument given (not None)}."""
  pol = as_policy(policy, **policy_kw)
  pol.resolve(seq_len)  # raises what to change
  return pol.record()


def merge_stats(acc: dict[str, Any] | None, s: dict[str, Any]) -> dict[str, Any]:
  """Combine the cache stats of two batches: peaks and losses by max, the kept mean by mean."""
  keys = ("cache_fraction", "kept_fraction_mean", "lost_mass_max", "overflow")
  s = {k: s[k] for k in keys if k in s}
  if acc is None:
    return {**s, "batches": 1}
  out = {"batches": acc["batches"] + 1}
  for k, v in s.items():
    if k == "overflow":
      out[k] = bool(acc[k] or v)
    elif k == "kept_fraction_mean":
      out[k] = (acc[k] * acc["batches"] + v) / out["batches"]
    else:
      out[k] = max(acc[k], v)
  return out


def summary(correct: int, n: int, digit: float | None = None) -> dict[str, Any]:
  lo, hi = wilson_interval(correct, n)
  out = {"n": n, "correct": correct, "accuracy": correct / n, "ci95": [lo, hi]}
  if digit is not None:
    out["digit_accuracy"] = digit
  return out


def pool_cells(cells: list[dict]) -> dict[str, Any]:
  n, k = sum(c["n"] for c in cells), sum(c["correct"] for c in cells)
  digit = [c["digit_accuracy"] for c in cells if "digit_accuracy" in c]
  d = float(np.average(digit, weights=[c["n"] for c in cells])) if len(digit) == len(cells) else None
  return _summary(k, n, d)


_merge_stats, _summary, _pool = merge_stats, summary, pool_cells  # the names of fpa_jax/eval.py
