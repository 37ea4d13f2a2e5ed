"""KV-cache eviction policies and the bounds behind the `fpa` tolerance policy.

One class per policy (`POLICY_CLASSES`; their base `PolicyRule` says which methods the cache and the
decoder call, so that neither branches on a name): `Full`, `FPATolerance`, `FPAThreshold`, `FPABudget`,
`FPAHeads`, `FPAGlobal`, `Window`, `SinkWindow`, `H2O`, `SnapKV`, and `ScorePolicy` for a policy of your own
(subclass it and write `score()`). By name (`PolicyRule.name`, `CachePolicy(name, ...)`, the CLIs):
  full          keep every key (the cache must hold the whole sequence).
  fpa           evict a key once its first-passage penalty reaches a threshold that makes all evicted
                keys together carry at most eps of any later query's attention (`tolerance_threshold`).
                `bound="keys"` (default): per key, tau_e = U + scale Q ||k_e|| + log N - log eps from the
                cached key's actual norm; `bound="params"`: tau = 2U + log N - log eps (U, Q from the
                parameters: `logit_bound`, `query_norm_bound`).
  fpa_threshold evict a key once its penalty reaches a given tau (the plain knob).
  fpa_budget    capacity C; when full, evict the key with the largest current penalty (ties: oldest),
                never one of the last W = `recent` keys (the newest included). With penalties near
                zero (a gate that has not judged the keys yet) "largest penalty, ties oldest" is a
                window: the rule degrades to `window`, and the protected window means a learned rule
                need not re-learn recency (DMS's delayed eviction).
  fpa_heads     fpa_budget with a capacity of its own per (layer, kv head): `split` [L, KVH], each head's
                kept fraction of the sequence (mean <= budget; `inference.head_budget.calibrate_head_split`
                measures fpa_global's on prompts), fixed before decoding, so each head evicts its own
                largest penalty within its own capacity C_lh, in a cache of its own of C_lh slots read in
                place (`FPAHeads`, `cache.HeadCaches`). W = `recent` from the mean budget, at most
                C_lh - 1 per head. No split: every head the budget (fpa_budget exactly).
  fpa_global    one key budget for the whole cache of a row: `budget` keys per (layer, kv head) on
                average, G = budget * n_layers * kv_heads in all; the largest penalties across every
                layer and head go first (ties: oldest, then lower layer / head), so heads that forget
                make room for heads that retrieve. The cache is one slot pool per row (as paged
                attention; `fpa_jax.inference.pool`): exactly G slots for all layers and kv heads
                together, each tagged with its owner (layer, kv head), so it allocates what
                `fpa_budget` allocates at the same budget plus an int32 tag per slot
                (`decode.cache_bytes`). Every `repack_every` steps the pool is sorted by owner, so
                each head's keys lie side by side and each query head attends over its own range plus
                the keys its head wrote since: O(keys it holds) per head and step (`FPAGlobal.pool_impl`;
                "masked": the whole pool masked, O(G); `fpa_jax.inference.pool`). `head_cap` (optional): at most that many keys per
                (layer, kv head), its largest penalty going first as in `fpa_budget` (default: no
                limit, a head may fill the pool). `head_offset` (optional, `FPAGlobal`): nats added to
                each (layer, kv head)'s penalties in the eviction order only (+inf: the head keeps its
                protected window alone, DuoAttention's streaming heads). The last W keys of every
                head are protected. Between steps at most G - n_layers * kv_heads keys are held, so each step's new keys always find
                free slots and each query attends to at most G keys counting its own step's.
  window        capacity C; the last C keys.
  sink_window   capacity C; the first `n_sink` = 4 keys and the last C - 4 (StreamingLLM).
  h2o           capacity C; the C/2 most recent keys plus the heavy hitters by attention mass
                received so far (Zhang et al. 2023); when full, evict the lightest non-recent key.
  snapkv        capacity C (Li et al. 2024): at prefill, each prompt key's score is the attention the
                prompt's last `obs_window` = 32 queries give it (the model's attention, penalties
                included), summed over those queries, max-pooled over `kernel` = 7 neighbouring keys,
                summed over the query heads of its kv head; the window's own keys score +inf; the C
                best are kept. Decoding (SnapKV itself never evicts generated keys; here the capacity is
                fixed): when full, evict the lowest-score key outside the last W = `recent` keys,
                ties oldest; generated keys score 0, so the cache settles on the C - W best prompt
                keys plus the last W keys. Needs the whole prompt: `generate(prefill="parallel")`.
  score         a policy of your own (`CachePolicy(score=fn, budget=...)`): capacity C; when full,
                the key with the lowest fn(q, k, field, level, penalty, positions) outside the last
                W = `recent` keys goes (ties: oldest); a parallel prefill keeps the best-scored keys.

Users hold a policy as a `CachePolicy` (a name and its arguments, checked when built; kvpress's
presses are the model), sized by `budget` (the keys kept: a fraction or a count) or by
`compression_ratio` (the fraction removed, kvpress's convention); `resolve(seq_len)` (what
`make_policy` does) gives the resolved rule the cache runs (its `PolicyRule` subclass, sizes filled
in, static under jit).

Eviction is per (row, head) except for `fpa_global`: heads forget on their own schedule. A key's
penalty never decreases as decoding goes on (its running min of the field can only fall), so an
evicted `fpa` key would never have come back. The same holds for FoX models (FoX's penalty is a sum
of decays).

The protected window `recent` (W; fpa_budget, fpa_heads, fpa_global, snapkv) defaults to budget // 8: an eighth
of the budget (kvpress's DMS default of 128 keys at 1k-key budgets), small enough that most of the
budget stays the policy's choice, and W = 0 below 8 keys (the new key is always kept anyway).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, ClassVar, Literal

import jax
import jax.numpy as jnp

from fpa_jax.inference.graph import attention_layers, layer_configs
from fpa_jax.layers import attention_spec
from fpa_jax.ops import first_passage as fp
from fpa_jax.ops.common import F32

PolicyName = Literal[
  "full", "fpa", "fpa_threshold", "fpa_budget", "fpa_heads", "fpa_global", "window", "sink_window", "h2o", "snapkv"
]
POLICIES: tuple[str, ...] = PolicyName.__args__
SCORE = "score"  # a policy of your own: `CachePolicy(score=fn, budget=...)` (not a CLI choice)
BUDGETED = ("fpa_budget", "fpa_heads", "fpa_global", "window", "sink_window", "h2o", "snapkv", SCORE)  # need a budget
THRESHOLDED = ("fpa", "fpa_threshold")  # evict by penalty threshold
WINDOWED = ("fpa_budget", "fpa_heads", "fpa_global", "snapkv", SCORE)  # have a protected recent window
BOUNDS = ("keys", "params")
# fpa_global's implementations, one behaviour: "packed" (the default: the pool repacked by owner every
# `repack_every` steps, each head over its own range), "masked" (each head over the whole pool, masked;
# eviction by top-k), "gather" (each head over its own slots, gathered), "reference" (masked; eviction by
# one sort of the pool)
POOL_IMPLS = ("packed", "masked", "gather", "reference")
REPACK_EVERY = 32  # "packed": decode steps between repacks (a sort of the pool each)
N_SINK = 4
OBS_WINDOW = 32  # snapkv: the prompt's last queries that vote
KERNEL = 7  # snapkv: max-pool width over keys


def _check_budget(budget, what: str) -> None:
  """The checks of a budget that need no sequence length: a fraction in (0, 1] or a positive int."""
  if isinstance(budget, bool) or not isinstance(budget, (int, float)):
    raise ValueError(f"{what} must be a fraction in (0, 1] or a positive int count, got {budget!r}")
  if budget <= 0:
    raise ValueError(f"{what} must be > 0, got {budget}")
  if isinstance(budget, float) and budget > 1.0:
    raise ValueError(
      f"a float {what} is a fraction of the sequence length and must be <= 1, got {budget}; "
      "pass an int for an absolute number of keys"
    )


def resolve_budget(budget: float | int | None, seq_len: int, what: str = "budget") -> int | None:
  """A fraction in (0, 1] of `seq_len` (float) or an absolute count (int) -> a key count."""
  if budget is None:
    return None
  _check_budget(budget, what)
  if isinstance(budget, float):
    return max(1, int(math.ceil(budget * seq_len)))
  return int(budget)


def default_recent(budget_keys: int) -> int:
  """W's default: an eighth of the budget (see the module docstring)."""
  return budget_keys // 8


SPLIT_SLACK = 1e-6  # a split's mean may pass its budget by this much (float rounding of a normalised split)


def as_split(split) -> tuple[tuple[float, ...], ...]:
  """`fpa_heads`' split -> a tuple per layer of floats per kv head (hashable: the policy is static).
  split: [L, KVH] (an array, nested lists; a model of your own may give its layers different kv
  heads), each head's kept fraction of the sequence, in [0, 1]. ValueError: what to change."""
  try:
    rows = [list(r) for r in split]
  except TypeError:
    raise ValueError(
      f"split must be [layers, kv heads] (a kept fraction of the sequence per head, e.g. a numpy array from "
      f"calibrate_head_split), got {split!r}"
    ) from None
  if not rows or any(not r for r in rows):
    raise ValueError(f"split must be [layers, kv heads] with at least one head per layer, got {split!r}")
  out = []
  for li, r in enumerate(rows):
    vals = []
    for x in r:
      if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"split[{li}] must hold numbers (a kept fraction per kv head), got {x!r}")
      x = float(x)
      if math.isnan(x) or not 0.0 <= x <= 1.0:
        raise ValueError(
          f"split[{li}] has {x}: each head's kept fraction of the sequence must be in [0, 1] (NaN refused); "
          "a head that should keep more than its whole sequence cannot: give the budget to another head"
        )
      vals.append(x)
    out.append(tuple(vals))
  return tuple(out)


def split_mean(split) -> float:
  """The mean kept fraction over every (layer, kv head) of a split (what its budget bounds)."""
  vals = [x for r in split for x in r]
  return sum(vals) / len(vals)


def split_capacities(split, keys: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
  """Per (layer, kv head) capacities C_lh of `fpa_heads` for sequences of `seq_len` keys and a mean
  budget of `keys` per head: ceil(split_lh * seq_len), then, while they sum past keys * L * KVH,
  one key less for the heads rounded up most (ties: the later head), and at least 1 (the query's own
  key: a head given 0 keeps its newest key only). A uniform split at budget b gives every head
  ceil(b * seq_len), `fpa_budget`'s capacity. ValueError when the split keeps more than the budget."""
  flat = [(li, hi, x * seq_len) for li, r in enumerate(split) for hi, x in enumerate(r)]
  allowed = keys * len(flat)
  want = sum(t for *_, t in flat)
  if want > allowed * (1 + SPLIT_SLACK) + SPLIT_SLACK:
    raise ValueError(
      f"the split keeps {want / len(flat):.2f} keys per head on average over {seq_len} keys, more than the budget's "
      f"{keys}: scale the split down to a mean of {keys / seq_len:.4g} (head_budget.normalise_split), or raise the budget"
    )
  cap = {(li, hi): min(seq_len, math.ceil(t - SPLIT_SLACK * max(t, 1.0))) for li, hi, t in flat}
  over = sum(cap.values()) - allowed
  if over > 0:  # the rounding up passed the budget: undo it where it added most
    order = sorted(flat, key=lambda e: (-(cap[e[:2]] - e[2]), -e[0], -e[1]))
    for li, hi, _ in order[:over]:
      cap[(li, hi)] -= 1
  return tuple(tuple(max(1, cap[(li, hi)]) for hi in range(len(r))) for li, r in enumerate(split))


@dataclasses.dataclass(frozen=True)
class CachePolicy:
  """A KV-cache policy with its arguments, before it meets a sequence (as kvpress's presses): pass
  it as `policy=` to `generate`, `cached_logits` and the `fpa_jax.eval` functions, on `DecoderLM` or
  a model of your own. Checked when built (ValueError naming the argument); `resolve(seq_len)` adds
  the checks that need the length and gives the resolved rule (a `PolicyRule` subclass) the cache runs.

      CachePolicy("fpa_budget", budget=0.25)          # keep a quarter of the keys (a fraction kept)
      CachePolicy("window", compression_ratio=0.75)   # the same size, as kvpress says it (removed)
      CachePolicy("snapkv", budget=128)               # an absolute number of keys (per layer, kv head)
      CachePolicy(score=my_score, budget=0.25)        # your own rule: evict the lowest score

  name: one of `POLICIES` (module docstring); None: "full", or "score" when `score` is given.
  budget: the keys kept, a fraction in (0, 1] of the sequence (float) or a count (int);
    compression_ratio: the fraction removed, in [0, 1) (kvpress's convention; budget = 1 - it).
    At most one of them; budgeted policies need one.
  tolerance (fpa), threshold (fpa_threshold), recent, head_cap (fpa_global), bound (fpa): as
    `make_policy`.
  split (fpa_heads): [L, KVH] each (layer, kv head)'s kept fraction of the sequence, in [0, 1], its
    mean at most the budget (`FPAHeads`); None: every head the budget.
  score: fn(q, k, field, level, penalty, positions) -> scores, called at every decode step whose
    cache is full and once on a prompt (parallel prefill): the lowest-scored key outside the
    protected window `recent` (default budget // 8) is evicted (ties: the oldest); at prefill the
    best-scored keys are kept. Its arguments, for the newest query (at prefill: each row's last):
      q [B, H, K] (RoPE, QK-norm applied), k [B, S, KVH, K] the cached keys, field [B, KVH] the
      gate's field now, level [B, S, KVH] the keys' levels, penalty [B, S, KVH] each key's
      first-passage penalty now (relu(level - min of the field since the key)), positions
      [B, S, KVH] int32 the keys' positions (-1: an empty slot, never a candidate);
    it returns [B, S, KVH] (or anything that broadcasts to it). Query head h reads kv head
    h // (H / KVH). Define it once (module level): the compiled program is cached per function.
  """

  name: str | None = None
  budget: float | int | None = None
  compression_ratio: float | None = None
  tolerance: float | None = None
  threshold: float | None = None
  recent: int | None = None
  head_cap: float | int | None = None
  bound: str | None = None
  score: Callable | None = None
  pool_impl: str | None = None
  split: tuple[tuple[float, ...], ...] | None = None

  def __post_init__(self):
    name = self.name
    if self.split is not None:
      object.__setattr__(self, "split", as_split(self.split))  # hashable; ValueError on a bad one
    if self.score is not None:
      if not callable(self.score):
        raise ValueError(
          f"score must be a function (q, k, field, level, penalty, positions) -> scores, got {self.score!r}"
        )
      if name not in (None, SCORE):
        raise ValueError(f"score= makes a policy of its own (evict the lowest score): leave name unset, not {name!r}")
      name = SCORE
    elif name == SCORE:
      raise ValueError("policy 'score' needs score=fn(q, k, field, level, penalty, positions) -> [B, S, KVH] scores")
    object.__setattr__(self, "name", "full" if name is None else name)
    self._check()

  def _check(self) -> None:
    """Every check that needs no sequence length (`resolve` does the rest)."""
    name = self.name
    if name not in POLICIES + (SCORE,):
      raise ValueError(f"unknown policy {name!r}; use one of {POLICIES}")
    if self.budget is not None and self.compression_ratio is not None:
      raise ValueError(
        "give either budget (the keys kept: a fraction or a count) or compression_ratio (the fraction removed, "
        f"as kvpress), not both; got budget={self.budget!r}, compression_ratio={self.compression_ratio!r}"
      )
    cr = self.compression_ratio
    if cr is not None and (isinstance(cr, bool) or not isinstance(cr, numbers.Real) or not 0.0 <= cr < 1.0):
      raise ValueError(
        f"compression_ratio is the fraction of keys removed, in [0, 1), got {cr!r}; for a number of keys kept "
        "pass budget=<int>"
      )
    if self.budget is not None:
      _check_budget(self.budget, "budget")
    if name in BUDGETED and self.kept is None:
      raise ValueError(
        f"policy {name!r} needs a budget (a fraction of the sequence, e.g. 0.25, or a key count) or a "
        "compression_ratio (the fraction removed, e.g. 0.75)"
      )
    tol, thr = self.tolerance, self.threshold
    if name == "fpa" and (tol is None or not 0.0 < tol < 1.0):
      raise ValueError(
        f"policy 'fpa' needs a tolerance in (0, 1) (the attention mass evicted keys may carry), got {tol!r}"
      )
    if name == "fpa_threshold" and (thr is None or not thr > 0):
      raise ValueError(f"policy 'fpa_threshold' needs a threshold > 0 (a penalty in nats), got {thr!r}")
    if name != "fpa" and tol is not None:
      raise ValueError(f"tolerance only applies to policy 'fpa', not {name!r}")
    if name != "fpa_threshold" and thr is not None:
      raise ValueError(f"threshold only applies to policy 'fpa_threshold', not {name!r}")
    if name != "fpa" and self.bound is not None:
      raise ValueError(f"bound only applies to policy 'fpa', not {name!r}")
    if self.bound is not None and self.bound not in BOUNDS:
      raise ValueError(f"bound must be one of {BOUNDS}, got {self.bound!r}")
    if name not in WINDOWED and self.recent is not None:
      raise ValueError(f"recent (a protected window) applies to policies {WINDOWED}, not {name!r}")
    w = self.recent
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
      raise ValueError(f"recent must be an int >= 0 (keys never evicted), got {w!r}")
    if name != "fpa_global" and self.head_cap is not None:
      raise ValueError(f"head_cap only applies to policy 'fpa_global', not {name!r}")
    if self.head_cap is not None:
      _check_budget(self.head_cap, "head_cap")
    if name != "fpa_global" and self.pool_impl is not None:
      raise ValueError(f"pool_impl only applies to policy 'fpa_global', not {name!r}")
    if self.pool_impl is not None and self.pool_impl not in POOL_IMPLS:
      raise ValueError(
        f"pool_impl must be one of {POOL_IMPLS} (fpa_global's implementations, one behaviour), got {self.pool_impl!r}"
      )
    if name != "fpa_heads" and self.split is not None:
      raise ValueError(f"split only applies to policy 'fpa_heads', not {name!r}")
    kept = self.kept
    if self.split is not None and isinstance(kept, float) and split_mean(self.split) > kept + SPLIT_SLACK:
      raise ValueError(
        f"the split keeps {split_mean(self.split):.4g} of each head's keys on average, more than budget={kept:g}: "
        f"scale it to a mean of {kept:g} (head_budget.normalise_split), or raise the budget"
      )

  @property
  def kept(self) -> float | int | None:
    """The budget as the keys kept: `budget`, or 1 - `compression_ratio` (a fraction); None if neither."""
    if self.compression_ratio is not None:
      return 1.0 - float(self.compression_ratio)
    return self.budget

  @property
  def kind(self) -> type[PolicyRule]:
    """The policy's class (`POLICY_CLASSES`): what it supports (`PolicyRule.prefills`, `keeps_all`, ...)."""
    return policy_class(self.name)

  def resolve(self, seq_len: int, *, into: type[PolicyRule] | None = None, **own) -> PolicyRule:
    """The resolved rule (static) for sequences of up to `seq_len` keys (see `make_policy`); raises what to change.
    `into`: the class to build (default `kind`; a subclass of your own), `own`: its other fields."""
    name = self.name
    cap = resolve_budget(self.kept, seq_len)
    if name == "full" and cap is not None and cap < seq_len:
      raise ValueError(
        f"policy 'full' keeps all {seq_len} keys but the budget allows {cap}; raise the budget or pick an evicting "
        "policy"
      )
    if name == "sink_window" and cap is not None and cap <= N_SINK:
      raise ValueError(f"sink_window keeps {N_SINK} sink keys plus a window: budget must be > {N_SINK}, got {cap}")
    if name == "h2o" and cap is not None and cap < 2:
      raise ValueError(f"h2o splits its budget into recent and heavy halves: budget must be >= 2, got {cap}")
    kw = {"recent": 0}
    if name in WINDOWED:
      keys = min(cap, seq_len)
      w = default_recent(keys) if self.recent is None else self.recent
      if w >= keys and keys < seq_len:
        raise ValueError(
          f"recent={w} protects at least the whole budget of {keys} keys (nothing could be evicted): "
          f"use recent < {keys}, or raise the budget"
        )
      kw["recent"] = min(w, max(keys - 1, 0))
    if name == "fpa_global":
      keys = min(cap, seq_len)
      limit = resolve_budget(self.head_cap, seq_len, "head_cap")
      if limit is not None and limit < keys:
        raise ValueError(
          f"head_cap={limit} keys per (layer, kv head) is below the mean budget of {keys} keys per head: "
          "the pool could never be filled; use head_cap >= budget, or leave it unset (no per-head limit)"
        )
      kw["keys"] = keys
      kw["head_cap"] = None if limit is None or limit >= seq_len else limit
      cap = seq_len if kw["head_cap"] is None else limit
    if name == "fpa_heads":
      keys = min(cap, seq_len)  # the mean budget per head
      kw["keys"] = keys
      kw["split"] = self.split
      if self.split is not None:
        caps = split_capacities(self.split, keys, seq_len)
        cap = max(max(r) for r in caps)  # the most any head holds
        if min(min(r) for r in caps) < cap:  # uneven: a cache per head (an even split is fpa_budget at cap)
          kw["head_keys"] = caps
        else:
          kw["recent"] = min(kw["recent"], cap - 1)
    if name == "fpa":
      kw["bound"] = self.bound or "keys"
    if name == SCORE:
      kw["score_fn"] = self.score
    if self.pool_impl is not None:
      kw["pool_impl"] = self.pool_impl
    cls = into or self.kind
    capacity = min(cap, seq_len) if cap is not None else seq_len
    return cls(capacity=capacity, tolerance=self.tolerance, threshold=self.threshold, **{**kw, **own})

  def record(self) -> dict[str, Any]:
    """{"policy": name, and each argument given}: a results file's JSON record (a score function by name)."""
    out: dict[str, Any] = {"policy": self.name}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name != "name" and v is not None:
        out[f.name] = getattr(v, "__qualname__", repr(v)) if callable(v) else v  # a score function by name
    return out


@dataclasses.dataclass(frozen=True)
class PolicyRule:
  """The base class of the policy rules: one subclass per rule (`POLICY_CLASSES`), with the few
  methods the cache and the decoder call, so that neither branches on a name (a `CachePolicy` is a
  policy by name and arguments; it resolves to one of these). Built by a user it holds the arguments
  (`FPABudget(budget=0.25)`, checked when built, as `CachePolicy`); `resolve(seq_len)` gives the
  same class with the sizes filled in (static under jit). A policy of your own subclasses
  `ScorePolicy` and writes `score()` (kvpress's `ScorerPress`).

  capacity: keys per (row, kv head) the policy may fill (fpa_global: the per-head limit inside the
    pool, the sequence length when there is none); None until resolved.
  recent: W, the last keys (the newest included) that are never evicted (0: none; None until resolved).
  tolerance (fpa), threshold (fpa, fpa_threshold: the cache's eviction threshold), budget,
  compression_ratio: the user's arguments (`CachePolicy`; budget and compression_ratio are cleared
  when resolved).

  What a subclass says (class attributes): `thresholded` (evicts by a penalty threshold: the cache
  checks the threshold and counts an overflow), `is_global` (one slot pool per row over every layer
  instead of a cache per layer), `chunkable` (`extend` chunk by chunk), `prefills` (the prefill
  modes of `generate`; "none": `cached_logits`, every token decoded with no prefill), `keeps_all`
  (the parallel model computes the same thing: the eval runs that).
  """

  name: ClassVar[str] = ""
  thresholded: ClassVar[bool] = False
  is_global: ClassVar[bool] = False
  chunkable: ClassVar[bool] = True
  prefills: ClassVar[tuple[str, ...]] = ("parallel", "decode", "none")
  keeps_all: ClassVar[bool] = False

  capacity: int | None = None
  recent: int | None = None
  tolerance: float | None = None
  threshold: Any = None
  budget: float | int | None = None
  compression_ratio: float | None = None

  def __post_init__(self):
    if self.capacity is None:
      self.spec()  # the arguments' checks (CachePolicy's), before any sequence is seen

  # -------------------------------------------------------------------------------- the user's side
  @property
  def kind(self) -> type[PolicyRule]:
    return type(self)

  @property
  def resolved(self) -> bool:
    return self.capacity is not None

  def spec(self) -> CachePolicy:
    """The arguments as a `CachePolicy` (what `record` writes and `resolve` checks)."""
    kw = {f: getattr(self, f) for f in SPEC_ARGS if f != "score" and getattr(self, f, None) is not None}
    return CachePolicy(self.name, **kw)

  def record(self) -> dict[str, Any]:
    return self.spec().record()

  def resolve(self, seq_len: int) -> PolicyRule:
    """This policy sized for sequences of up to `seq_len` keys (`CachePolicy.resolve`), same class."""
    if self.resolved:
      raise ValueError(f"{type(self).__name__} is already resolved (capacity={self.capacity}): pass the unresolved one")
    own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SPEC_ARGS + RESOLVED}
    return self.spec().resolve(seq_len, into=type(self), **own)

  @classmethod
  def default_prefill(cls) -> str:
    return "parallel" if "parallel" in cls.prefills else "decode"

  @classmethod
  def check_prefill(cls, prefill: str) -> None:
    """ValueError naming what to use when the policy cannot run `prefill` ("parallel", "decode"; "none":
    every token decoded with no prompt, `cached_logits`)."""
    if prefill not in cls.prefills:
      raise ValueError(cls.refusal(prefill))

  @classmethod
  def refusal(cls, prefill: str) -> str:
    return f"policy {cls.name!r} cannot run prefill={prefill!r}: use one of {cls.prefills}"

  # -------------------------------------------------------------------------------- the cache's side
  def head_slots(self, layer: int) -> tuple[int, ...] | None:
    """Layer `layer`'s cache: None, one `LayerCache` for all its kv heads, `capacity` slots each; or
    one slot count per kv head, each head a cache of its own (`cache.HeadCaches`; `FPAHeads`)."""
    return None

  def for_head(self, layer: int, head: int) -> PolicyRule:
    """The rule kv head `head` of layer `layer` runs in its own cache, where `head_slots` gives one."""
    return self

  def evict_rank(self, cache, pen: jax.Array, cand: jax.Array, now: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A full (row, kv head) of a `LayerCache`: (rank [B, S, H], candidates [B, S, H] bool); the
    candidate of the largest rank goes, ties the oldest. `cand`: the alive keys outside the protected
    window; `pen` [B, S, H] the penalties now; `now` [B, 1, 1] the position being written.
    Default: the largest penalty (fpa_budget; the thresholded policies on overflow)."""
    return pen, cand

  def keep_rank(self, pen: jax.Array, pos: jax.Array, score: jax.Array | None) -> jax.Array:
    """Prefill and `extend`: [B, N, H] how much each candidate key is wanted (the largest kept first,
    ties the newest; the protected window comes first anyway). Default: the smallest penalty."""
    return -pen

  def rescore(self, cache, q: jax.Array, field: jax.Array, pen: jax.Array):
    """A decode step, before eviction: the cache with `score` updated for this step's query
    (q [B, H, K], field [B, KVH] fp32, pen [B, S, KVH]). Default: unchanged."""
    return cache

  def observe(self, cache, p: jax.Array):
    """A decode step, after attention: p [B, KVH, G, S] the step's attention. Default: unchanged."""
    return cache

  def prompt_scores(self, q, k, field, level, pen, pos, lengths, *, scale: float):
    """A parallel prefill: [B, T, KVH] scores of the prompt's keys for `keep_rank` (None: none).
    q [B, T, H, K], k [B, T, KVH, K], field, level, pen [B, T, KVH] fp32, pos [B, T, KVH], lengths [B]."""
    return None

  def chunk_scores(self, q, k, field, level, pen, pos, lengths):
    """`extend`: [B, N, KVH] scores of the cached and the chunk's keys (None: none); q [B, T, H, K]
    the chunk's queries, field [B, T, KVH] (padding +inf), the rest over the N candidates."""
    return None

  # -------------------------------------------------------------------------------- the decoder's side
  def layer_thresholds(self, model, n_keys: int) -> list[tuple[Any, Any, Any]]:
    """Per attention layer of `model`, (threshold, key_coef, key_cap) [KVH] for `init_layer_cache`
    (None: none). Default: no threshold."""
    return [(None, None, None)] * len(layer_configs(model))

  def check_model(self, model) -> None:
    """Before tracing, on a model of your own: ValueError if it cannot run this policy."""

  def slots_per_row(self, layers) -> int:
    """Key slots one row's cache allocates over all layers (`layers`: each one's `ModelConfig`)."""
    return self.capacity * sum(c.kv_heads for c in layers)


class _ByPosition(PolicyRule):
  """Order by position alone: the oldest candidate goes, the newest are kept."""

  def evict_rank(self, cache, pen, cand, now):
    return jnp.zeros_like(pen), cand

  def keep_rank(self, pen, pos, score):
    return jnp.zeros_like(pen)


class Full(_ByPosition):
  """Every key (the cache holds the whole sequence)."""

  name = "full"
  keeps_all = True


class Window(_ByPosition):
  """The last C keys."""

  name = "window"


@dataclasses.dataclass(frozen=True)
class SinkWindow(PolicyRule):
  """The first `n_sink` keys and the last C - n_sink (StreamingLLM)."""

  name = "sink_window"
  n_sink: int = N_SINK

  def evict_rank(self, cache, pen, cand, now):
    mask = cand & (cache.pos >= self.n_sink)
    return jnp.zeros_like(pen), jnp.where(jnp.any(mask, 1, keepdims=True), mask, cand)

  def keep_rank(self, pen, pos, score):
    return (pos < self.n_sink).astype(jnp.float32)


class H2O(PolicyRule):
  """The C/2 most recent keys plus the heaviest by attention received (H2O); decode prefill only."""

  name = "h2o"
  chunkable = False
  prefills = ("decode", "none")

  @classmethod
  def refusal(cls, prefill):
    return f"h2o ranks keys by the attention they received while decoding: use prefill='decode' (not {prefill!r})"

  def evict_rank(self, cache, pen, cand, now):
    return -cache.score, fp.candidates(cand, cache.pos, now, self.capacity // 2)

  def observe(self, cache, p):
    return cache._replace(score=cache.score + p.sum(2).transpose(0, 2, 1))


@dataclasses.dataclass(frozen=True)
class SnapKV(PolicyRule):
  """The prompt keys its last `obs_window` queries attend to most (SnapKV); parallel prefill only."""

  name = "snapkv"
  chunkable = False
  prefills = ("parallel",)
  obs_window: int = OBS_WINDOW
  kernel: int = KERNEL

  @classmethod
  def refusal(cls, prefill):
    what = "use generate()" if prefill == "none" else "use prefill='parallel'"
    return f"snapkv ranks the prompt's keys by its last window's attention at prefill: {what}"

  def evict_rank(self, cache, pen, cand, now):
    return -cache.score, cand

  def keep_rank(self, pen, pos, score):
    return score

  def prompt_scores(self, q, k, field, level, pen, pos, lengths, *, scale):
    return snapkv_scores(q, k, field, level, lengths, scale=scale, window=self.obs_window, kernel=self.kernel)


class FPABudget(PolicyRule):
  """At most C keys; when full the largest penalty goes (ties: the oldest), never one of the last W."""

  name = "fpa_budget"


@dataclasses.dataclass(frozen=True)
class FPAHeads(PolicyRule):
  """`fpa_budget` with a capacity of its own per (layer, kv head), fixed before decoding: a split of
  the budget between heads (AdaKV; DuoAttention's retrieval and streaming heads; `fpa_global`'s
  split measured on a few prompts, `head_budget.calibrate_head_split`).

  split: [L, KVH] each head's kept fraction of the sequence, in [0, 1], its mean at most the budget
    (None: every head the budget, `fpa_budget` exactly). Resolved for T keys, head (l, h) holds
    C_lh = ceil(split_lh * T) keys (`split_capacities`: trimmed back to budget * L * KVH in all, at
    least 1) and, when full, evicts its largest penalty (ties: the oldest) outside its last
    W_lh = min(W, C_lh - 1) keys, W = `recent` (default: an eighth of the mean budget).
  keys: the mean budget per head; head_keys: [L][KVH] the capacities C_lh (None without a split, or
    where every head gets the same C: then `capacity` C, one cache per layer, `fpa_budget` at C);
  layer, head: None, or the (layer, kv head) whose cache this rule runs (`for_head`: `fpa_budget`
    at capacity C_lh, recent W_lh).

  Layout: each (layer, kv head) a cache of its own of exactly C_lh slots (`cache.HeadCaches`), so a
  decode step reads each head's keys in place and every op of it is O(C_lh): the cache allocates
  the split's keys, sum C_lh, and a layer's step costs what they cost.

      FPAHeads(budget=0.125, split=calibrate_head_split(model, prompts, 0.125))
      FPAHeads(budget=0.25, split=[[0.02, 0.02], [0.9, 0.06]])  # layer 1 head 0 retrieves, the others stream
  """

  name = "fpa_heads"
  keys: int | None = None
  split: tuple[tuple[float, ...], ...] | None = None
  head_keys: tuple[tuple[int, ...], ...] | None = None
  layer: int | None = None
  head: int | None = None

  def __post_init__(self):
    if self.split is not None:
      object.__setattr__(self, "split", as_split(self.split))  # hashable: the policy is static
    super().__post_init__()

  def head_slots(self, layer):
    return None if self.head_keys is None else self.head_keys[layer]

  def for_head(self, layer, head):
    if self.head_keys is None:
      return self
    c = self.head_keys[layer][head]
    return dataclasses.replace(self, capacity=c, recent=min(self.recent, c - 1), head_keys=None, layer=layer, head=head)

  def check_layers(self, layers) -> None:
    """ValueError unless the split has one row per attention layer and one number per kv head."""
    if self.split is None:
      return
    want = [c.kv_heads for c in layers]
    got = [len(r) for r in self.split]
    if got != want:
      raise ValueError(
        f"the split is {len(got)} layers x {got} kv heads; the model has {len(want)} attention layers with "
        f"{want} kv heads: give one kept fraction per (layer, kv head), e.g. calibrate_head_split(model, ...)"
      )

  def check_model(self, model):
    self.check_layers(layer_configs(model))

  def slots_per_row(self, layers):
    self.check_layers(layers)  # here too: every entry point sizes the cache, a DecoderLM too
    if self.head_keys is None:
      return super().slots_per_row(layers)
    return sum(sum(r) for r in self.head_keys)


class FPAThreshold(PolicyRule):
  """Keys whose penalty is below `threshold`."""

  name = "fpa_threshold"
  thresholded = True

  def layer_thresholds(self, model, n_keys):
    return [(jnp.full((c.kv_heads,), self.threshold, jnp.float32), None, None) for c in layer_configs(model)]


@dataclasses.dataclass(frozen=True)
class FPATolerance(PolicyRule):
  """`fpa`: keys whose penalty is below the threshold that keeps evicted keys' share of any later
  query's attention <= `tolerance` (`bound`: "keys" per key, "params" per layer)."""

  name = "fpa"
  thresholded = True
  bound: str | None = None

  def layer_thresholds(self, model, n_keys):
    us = layer_logit_bounds(model)
    if self.bound == "params":
      return [(tolerance_threshold(u, n_keys, self.tolerance), None, None) for u in us]
    qs = layer_query_bounds(model)
    return [
      (key_tolerance_threshold(u, n_keys, self.tolerance), attention_spec(c).scale * q, u)
      for u, q, c in zip(us, qs, layer_configs(model))
    ]

  def check_model(self, model):
    for f in attention_layers(model):
      _check_bounded(f, model)


@dataclasses.dataclass(frozen=True)
class FPAGlobal(PolicyRule):
  """One budget per row over every layer and kv head: a slot pool in the bytes of keys * L * KVH
  cached keys (`pool_slots`), the largest penalties across layers and heads out first
  (`fpa_jax.inference.pool`).

  keys: the mean budget per (layer, kv head); head_cap: the per-head limit (None: none);
  pool_impl: how the pool runs (`POOL_IMPLS`, the same keys kept); repack_every: "packed": decode
  steps between repacks of the pool by owner (N).
  head_offset: None, or one number per (layer, kv head), layer-major (L * KVH: owner = layer * KVH +
    kv head), added to that head's penalties where the pool picks what goes, never in attention: a
    per-head calibration of the shared budget (AdaKV, DuoAttention). +inf: the head keeps its
    protected window only (a streaming head); 0 everywhere: plain fpa_global.

      FPAGlobal(budget=0.125, head_offset=(inf,) * 4 + (0, inf, inf, inf))  # layer 1, head 0 gets it all
  """

  name = "fpa_global"
  is_global = True
  chunkable = False
  keys: int | None = None
  head_cap: float | int | None = None
  pool_impl: str = "packed"
  repack_every: int = REPACK_EVERY
  head_offset: tuple[float, ...] | None = None

  def __post_init__(self):
    off = self.head_offset
    if off is not None:
      bad = not isinstance(off, (tuple, list)) or not off
      bad = bad or any(isinstance(x, bool) or not isinstance(x, numbers.Real) or math.isnan(x) for x in off)
      if bad:
        raise ValueError(
          f"head_offset must be a non-empty sequence of numbers (nats, or inf) per (layer, kv head), got {off!r}"
        )
      object.__setattr__(self, "head_offset", tuple(float(x) for x in off))  # hashable: the policy is static
    if self.pool_impl not in POOL_IMPLS:
      raise ValueError(
        f"pool_impl must be one of {POOL_IMPLS} (fpa_global's implementations, one behaviour), got {self.pool_impl!r}"
      )
    n = self.repack_every
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"repack_every must be an int >= 1 (decode steps between repacks of the pool), got {n!r}")
    super().__post_init__()

  @property
  def pack_steps(self) -> int:
    """ "packed": steps between repacks, `repack_every` but at most the mean budget `keys`, so the
    lists of keys written since (one int32 per owner and step) hold at most one entry per pool slot."""
    return max(1, min(self.repack_every, self.keys or self.repack_every))

  def pool_slots(self, n_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """G, the slots of a row's pool: the most whose pool, with everything it allocates besides (an
    int32 owner tag per slot, every layer's gate carry and packed's index), fits in the
    bytes of the budget's keys, keys * n_layers * kv_heads cached keys (k, v of `head_dim` at
    `itemsize` bytes, and a key's 17 bytes of state: `cache.LayerCache`), so fpa_global at budget b
    allocates no more than b of `full`'s bytes, nor than `fpa_budget` at b. ValueError if that leaves
    no room for a key besides a step's L * KVH new ones (G <= L * KVH). A budget of the whole
    sequence (keys >= capacity, no head_cap: budget=1.0) gets G = (keys + 1) * L * KVH, every key of
    every head plus a step's new ones, so it keeps every key as `full` does (its tags and index then
    take it just past `full`'s bytes)."""
    owners = n_layers * kv_heads
    if self.head_cap is None and self.keys >= self.capacity:
      return (self.keys + 1) * owners
    key = 2 * head_dim * itemsize + 17  # k, v; level, run_min, pos, score (4 bytes each), alive (1)
    # The gate carries [L][KVH] fp32 and packed's PackIndex (start, count [O], since, step, new_slot
    # [O, N], new_pos [N]) at its largest, N = keys, whatever the implementation: every implementation
    # and repack interval then has the same G, so all hold the same keys.
    n = self.keys
    fixed = 4 * owners + 4 * (2 * owners + 2 + owners * n + n)
    g = (self.keys * owners * key - fixed) // (key + 4)  # + the int32 owner tag
    if g <= owners:
      raise ValueError(
        f"fpa_global's pool in the bytes of {self.keys} keys per (layer, kv head) holds {g} slots per row, no "
        f"room for a key beside the {owners} new keys of a step: give a larger budget"
      )
    return int(g)

  def evict_order(self, pen: jax.Array, owner: jax.Array) -> jax.Array:
    """What the global rule ranks (largest goes first): `pen` [B, N] plus each key's owner's
    `head_offset` (owner [B, N] int32, layer * KVH + kv head; -1: no key, offset 0)."""
    if self.head_offset is None:
      return pen
    off = jnp.asarray(self.head_offset, F32)
    return pen + jnp.where(owner >= 0, off[jnp.clip(owner, 0, off.shape[0] - 1)], 0.0)

  def slots_per_row(self, layers):
    self._check_offset(layers)  # here, not in check_model: every model sizes its pool, a DecoderLM too
    c = layers[0]  # one pool: the same kv heads, head dim and dtype in every layer (`check_model`)
    return self.pool_slots(len(layers), c.kv_heads, c.head_dim, jnp.dtype(c.dtype).itemsize)

  def _check_offset(self, layers) -> None:
    owners = sum(c.kv_heads for c in layers)
    if self.head_offset is not None and len(self.head_offset) != owners:
      raise ValueError(
        f"head_offset has {len(self.head_offset)} numbers; the model has {len(layers)} attention layers with "
        f"{owners} kv heads in all: give one per (layer, kv head), layer-major"
      )

  def check_model(self, model):
    shapes = {(c.kv_heads, c.head_dim, c.dtype) for c in layer_configs(model)}
    if len(shapes) > 1:
      raise ValueError(
        f"fpa_global shares one slot pool between the layers, so they need the same (kv heads, head dim, dtype); "
        f"{type(model).__name__}'s layers have {sorted(shapes)}: use fpa_budget (one cache per layer)"
      )


@dataclasses.dataclass(frozen=True)
class ScorePolicy(PolicyRule):
  """A policy of your own: capacity C; when full, the lowest-scored key outside the last W goes
  (ties: the oldest); a parallel prefill and each chunk of `extend` keep the best-scored keys.
  Subclass it and write `score` (kvpress's `ScorerPress.score`), or give `score_fn`
  (`CachePolicy(score=fn)`). Called for the newest query (at prefill: each row's last); arguments
  as `CachePolicy`'s `score`."""

  name = SCORE
  score_fn: Callable | None = None

  def score(self, q, k, field, level, penalty, positions) -> jax.Array:
    """[B, S, KVH] (or what broadcasts to it): the lowest goes. q [B, H, K], k [B, S, KVH, K],
    field [B, KVH], level, penalty [B, S, KVH] fp32, positions [B, S, KVH] int32."""
    if self.score_fn is None:
      raise ValueError("a ScorePolicy needs score_fn=fn or a subclass that writes score(q, k, field, level, ...)")
    return self.score_fn(q, k, field, level, penalty, positions)

  @property
  def _overridden(self) -> bool:
    return type(self).score is not ScorePolicy.score

  def spec(self) -> CachePolicy:
    kw = {f: getattr(self, f) for f in SPEC_ARGS if f != "score" and getattr(self, f, None) is not None}
    return CachePolicy(score=self.score if self._overridden else self.score_fn, **kw)

  def resolve(self, seq_len):
    out = super().resolve(seq_len)
    return dataclasses.replace(out, score_fn=None) if self._overridden else out

  def scores(self, q, k, field, level, penalty, positions) -> jax.Array:
    return score_keys(self, q, k, field, level, penalty, positions)

  def evict_rank(self, cache, pen, cand, now):
    return -cache.score, cand

  def keep_rank(self, pen, pos, score):
    return score

  def rescore(self, cache, q, field, pen):
    return cache._replace(score=self.scores(q, cache.k.swapaxes(1, 2), field, cache.level, pen, cache.pos))

  def _at_end(self, q, k, field, level, pen, pos, lengths):
    at_end = lambda x: jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0).reshape((-1,) + (1,) * (x.ndim - 1)), 1)
    return self.scores(at_end(q)[:, 0], k, at_end(field)[:, 0], level, pen, pos)

  def prompt_scores(self, q, k, field, level, pen, pos, lengths, *, scale):
    return self._at_end(q, k, field, level, pen, pos, lengths)

  def chunk_scores(self, q, k, field, level, pen, pos, lengths):
    return self._at_end(q, k, field, level, pen, pos, lengths)


POLICY_CLASSES: dict[str, type[PolicyRule]] = {
  c.name: c for c in (Full, FPATolerance, FPAThreshold, FPABudget, FPAHeads, FPAGlobal, Window, SinkWindow, H2O, SnapKV)
}
POLICY_CLASSES[SCORE] = ScorePolicy
SPEC_ARGS = ("budget", "compression_ratio", "tolerance", "threshold", "recent", "head_cap", "bound", "score", "split")
# what `CachePolicy.resolve` sets (with recent, head_cap, bound)
RESOLVED = ("capacity", "keys", "score_fn", "head_keys")


def policy_class(name: str) -> type[PolicyRule]:
  """The class of a policy name (`POLICY_CLASSES`); ValueError on an unknown name."""
  if name not in POLICY_CLASSES:
    raise ValueError(f"unknown policy {name!r}; use one of {POLICIES}")
  return POLICY_CLASSES[name]


def as_policy(
  policy: str | CachePolicy | PolicyRule | type[PolicyRule] = "full", **policy_kw
) -> CachePolicy | PolicyRule:
  """The policy object every entry point runs: from a policy name and its keywords (None values
  ignored; a `CachePolicy`), from a `PolicyRule` class and its keywords (`FPABudget, budget=0.25`), or
  an object itself, a `CachePolicy` or an unresolved `PolicyRule` (then no keywords: ValueError, the
  arguments belong in the object). Either has `resolve(seq_len)`, `record()` and `kind`."""
  given = {k: v for k, v in policy_kw.items() if v is not None}
  if isinstance(policy, type) and issubclass(policy, PolicyRule):
    return policy(**given)
  if isinstance(policy, (CachePolicy, PolicyRule)):
    if given:
      raise ValueError(
        f"policy is a {type(policy).__name__}: give its arguments in it "
        f"({'CachePolicy(%r, ...)' % policy.name if isinstance(policy, CachePolicy) else type(policy).__name__ + '(...)'}), "
        f"not as keywords {sorted(given)}"
      )
    if isinstance(policy, PolicyRule) and policy.resolved:
      raise ValueError(
        "policy is a resolved PolicyRule (make_policy); pass a policy name, a CachePolicy or an unresolved one"
      )
    return policy
  return CachePolicy(policy, **given)


def make_policy(
  name: str | CachePolicy,
  seq_len: int,
  *,
  budget: float | int | None = None,
  compression_ratio: float | None = None,
  tolerance: float | None = None,
  threshold: float | None = None,
  recent: int | None = None,
  head_cap: float | int | None = None,
  bound: str | None = None,
  score: Callable | None = None,
  pool_impl: str | None = None,
  split=None,
) -> PolicyRule:
  """Check the arguments of a policy for sequences of up to `seq_len` keys; raise what to change.

  `name`: a policy name (or a `CachePolicy`, then no other argument). The capacity is the budget for
  budgeted policies (fpa_global: the per-head limit `head_cap`, default none: `seq_len`; its pool
  holds budget * n_layers * kv_heads keys); otherwise `seq_len`, or the budget if one is given (a
  bounded buffer: if an `fpa`/`fpa_threshold` cache is full the largest penalty goes, and the stats
  report it as an overflow, since the tolerance bound then no longer holds). `budget` (kept: a
  fraction or a count) or `compression_ratio` (the fraction removed), not both. `recent` (W):
  fpa_budget, fpa_global, snapkv and score only, 0 <= W < budget, default budget // 8. `bound`: fpa
  only, "keys" (default) or "params". `score`: a policy of your own (`CachePolicy`). `split`:
  fpa_heads only, [L, KVH] kept fractions per head (`FPAHeads`).
  """
  kw = dict(
    budget=budget,
    compression_ratio=compression_ratio,
    tolerance=tolerance,
    threshold=threshold,
    recent=recent,
    head_cap=head_cap,
    bound=bound,
    score=score,
    pool_impl=pool_impl,
    split=split,
  )
  if score is not None and name == SCORE:
    name = None
  return as_policy(name, **kw).resolve(seq_len)


def score_keys(policy: PolicyRule, q, k, field, level, penalty, positions) -> jax.Array:
  """The `score` policy's scores of the cached keys -> [B, S, KVH] fp32 (arguments: `CachePolicy`);
  ValueError, while tracing, when the function's result does not broadcast to penalty's shape."""
  s = jnp.asarray(policy.score(q, k, field, level, penalty, positions))
  try:
    return jnp.broadcast_to(s, penalty.shape).astype(jnp.float32)
  except ValueError:
    raise ValueError(
      f"the policy's score function returned shape {s.shape}; it must give one score per cached key, "
      f"{penalty.shape} [batch, keys, kv heads] (the shape of its `penalty` argument)"
    ) from None


# ------------------------------------------------------------------------------------------------
# The bound
# ------------------------------------------------------------------------------------------------


def _sigma_max(m: jax.Array) -> jax.Array:
  """Largest singular value of each [..., D, K] matrix."""
  return jnp.linalg.svd(m.astype(jnp.float32), compute_uv=False)[..., 0]


def _proj_norm_bounds(norm_scale, w, q_norm_scale=None) -> jax.Array:
  """[heads] bound on ||x_h|| for x = proj(RMSNorm(input)) with projection w [D, heads, K].

  RMSNorm's output y = x/rms(x) * g has ||x/rms(x)||_2 <= sqrt(D), so ||y W_h|| <= sqrt(D) *
  sigma_max(diag(g) W_h). With QK-norm the head's output is u * s with ||u||_2 <= sqrt(K) (its own
  RMSNorm), so ||x_h|| <= sqrt(K) max|s|; RoPE is a rotation (norm unchanged).
  """
  d, h, k = w.shape
  if q_norm_scale is not None:
    return jnp.full((h,), jnp.sqrt(k) * jnp.max(jnp.abs(q_norm_scale.astype(jnp.float32))), jnp.float32)
  g = norm_scale.astype(jnp.float32)[:, None, None]
  return jnp.sqrt(d) * _sigma_max(jnp.moveaxis(g * w.astype(jnp.float32), 1, 0))


def _qk_norm_logit_bound(q_norm_scale, k_norm_scale, rope: bool) -> jax.Array:
  """[] bound on |q.k| with QK-norm: K * max over RoPE pairs p of max_p|s_q| * max_p|s_k|.

  q = R(u * s_q), k = R'(w * s_k) with ||u||, ||w|| <= sqrt(K) (RMSNorm outputs) and R, R' the RoPE
  rotations, which act on the pairs (i, i + K/2) (half-split) so q.k = sum_p (u_p s_q,p)^T R_p (w_p
  s_k,p) <= sum_p a_p b_p ||u_p|| ||w_p|| <= max_p (a_p b_p) ||u|| ||w|| with a_p = max_p |s_q|
  (Cauchy-Schwarz twice). Without RoPE the pairs are single coordinates. Never looser than
  K max|s_q| max|s_k|; attained when u, w sit on the best pair and the rotations align them.
  """
  a, b = jnp.abs(q_norm_scale.astype(jnp.float32)), jnp.abs(k_norm_scale.astype(jnp.float32))
  k = a.shape[-1]
  if rope:
    a = jnp.maximum(a[: k // 2], a[k // 2 :])
    b = jnp.maximum(b[: k // 2], b[k // 2 :])
  return k * jnp.max(a * b)


def logit_bound(
  norm_scale: jax.Array,
  wq: jax.Array,
  wk: jax.Array,
  *,
  scale: float,
  q_norm_scale: jax.Array | None = None,
  k_norm_scale: jax.Array | None = None,
  rope: bool = True,
) -> jax.Array:
  """U [KVH]: a bound on |scale * q.k| over every input, from one layer's parameters.

  U_h = scale * ||q_h||max * ||k_h||max (`_proj_norm_bounds`: the RMSNorm scale g [D] times the
  projections' spectral norms); with QK-norm (scales s_q, s_k [K]) the tighter pairwise form
  `_qk_norm_logit_bound`. Grouped-query (wk [D, KVH, K]): per kv head, the max over the query heads
  of its group (the cache thresholds are per kv head). Computed in fp32; valid for fp32 compute
  (bf16 rounding can exceed it by ~1%).
  """
  d, h, k = wq.shape
  kvh = wk.shape[1]
  if q_norm_scale is not None:
    return jnp.full((kvh,), scale * _qk_norm_logit_bound(q_norm_scale, k_norm_scale, rope), jnp.float32)
  nq = _proj_norm_bounds(norm_scale, wq).reshape(kvh, h // kvh).max(-1)
  return scale * nq * _proj_norm_bounds(norm_scale, wk)


def query_norm_bound(norm_scale: jax.Array, wq: jax.Array, kv_heads: int, q_norm_scale=None) -> jax.Array:
  """Q [KVH]: a bound on ||q_h|| over every input, the max over the query heads of each kv head's group."""
  h = wq.shape[1]
  return _proj_norm_bounds(norm_scale, wq, q_norm_scale).reshape(kv_heads, h // kv_heads).max(-1)


def tolerance_threshold(u: jax.Array, n_keys: int, tolerance: float) -> jax.Array:
  """tau = 2U + log N - log eps: evicting keys whose penalty reached tau loses <= eps of the mass.

  At query i the full-cache weight of key e is exp(s_ie - pen_ie) / Z with s_ie <= U and
  Z >= exp(s_ii) >= exp(-U) (the query's own key, penalty 0, is always kept), so it is at most
  exp(2U - pen_ie) <= exp(2U - tau) once e's penalty reached tau (penalties never decrease). With at
  most N evicted keys the lost mass is <= N exp(2U - tau) = eps; the output then moves by at most
  2 eps max_j ||v_j||. Same form as FoX's Adaptive Computation Pruning threshold.
  """
  return 2.0 * u + math.log(n_keys) - math.log(tolerance)


def key_tolerance_threshold(u: jax.Array, n_keys: int, tolerance: float) -> jax.Array:
  """The base of the per-key threshold (`bound="keys"`): tau_e = U + log N - log eps + min(U, scale Q ||k_e||).

  As in `tolerance_threshold`, Z >= exp(-U) from the query's own key, but the numerator uses the
  cached key itself: s_ie = scale q_i.k_e <= scale ||q_i|| ||k_e|| <= scale Q ||k_e|| (Q:
  `query_norm_bound`, any future query), and also <= U; so the weight is <= exp(U + min(U, scale Q
  ||k_e||) - pen_ie) <= eps / N once pen_ie >= tau_e. Never looser than the parameter bound (the
  min), tighter by U - scale Q ||k_e|| for the many keys far below the worst-case norm. This
  returns U + log N - log eps; the cache adds the per-key term (`cache.LayerCache.key_coef`).
  """
  return u + math.log(n_keys) - math.log(tolerance)


# ------------------------------------------------------------------------------------------------
# The bounds of a model's layers (the `fpa` policy) and SnapKV's vote
# ------------------------------------------------------------------------------------------------


def layer_logit_bounds(model) -> list[jax.Array]:
  """Per attention layer, U [KVH]: a bound on |scale q.k| from the parameters (`policies.logit_bound`).
  `model`: a `DecoderLM` or a model of your own (`graph.attention_layers`); a layer without QK-norm
  needs the RMSNorm in front of it known (`graph.Found.norm_scale`: DecoderLM, `models.Block`)."""
  out = []
  for f in attention_layers(model):  # per-layer views of a scanned (stacked) model too
    a = f.layer
    _check_bounded(f, model)
    out.append(
      logit_bound(
        f.norm_scale,
        a.wq[...],
        a.wk[...],
        scale=a.spec.scale,  # the layer's logit scale
        q_norm_scale=None if a.q_norm is None else a.q_norm.scale[...],
        k_norm_scale=None if a.k_norm is None else a.k_norm.scale[...],
        rope=a.cfg.use_rope,
      )
    )
  return out


def layer_query_bounds(model) -> list[jax.Array]:
  """Per attention layer, Q [KVH]: a bound on any query's norm (max over each kv head's group;
  `policies.query_norm_bound`)."""
  out = []
  for f in attention_layers(model):
    a = f.layer
    _check_bounded(f, model)
    out.append(
      query_norm_bound(f.norm_scale, a.wq[...], a.cfg.kv_heads, None if a.q_norm is None else a.q_norm.scale[...])
    )
  return out


def _check_bounded(f, model) -> None:
  if f.layer.q_norm is None and f.norm_scale is None:
    raise ValueError(
      f"policy 'fpa' bounds every logit from the layers' parameters, but {type(model).__name__}'s layer at "
      f"{f.path} has no QK-norm and no known RMSNorm before it: build the layer with qk_norm=True (the bound then "
      "reads the q / k norm scales), or use a budgeted policy (fpa_budget)"
    )


def snapkv_scores(q, k, field, level, lengths, *, scale: float, window: int, kernel: int) -> jax.Array:
  """[B, T, KVH] SnapKV's vote for each prompt key: the attention of the last `window` queries.

  For each row of length L, the queries at L - window .. L - 1 (those >= 0) attend as the model
  does (logits scale q.k - penalty, causal; penalty = relu(level_j - min field over (j, i])); each
  query head's probabilities are summed over the window queries, max-pooled over `kernel`
  neighbouring keys (stride 1, centred; SnapKV's clustering of the votes) and summed over the query
  heads of a kv head. The window's own keys score +inf (always kept); padding 0.

  Args: q [B, T, H, K], k [B, T, KVH, K], field, level [B, T, KVH], lengths [B].
  """
  b, t, h, dk = q.shape
  kvh = k.shape[2]
  w_idx = lengths[:, None] - window + jnp.arange(window)[None, :]  # [B, W] query positions
  w_ok = w_idx >= 0
  w_idx = jnp.maximum(w_idx, 0)
  qw = jnp.take_along_axis(q, w_idx[:, :, None, None], axis=1)  # [B, W, H, K]
  j = jnp.arange(t)[None, None, :]  # key index
  causal = j <= w_idx[:, :, None]  # [B, W, T]
  pen = fp.penalty(level[:, None], fp.run_min_at(field, w_idx))  # [B, W, T, KVH] key j at query i
  qg = qw.reshape(b, window, kvh, h // kvh, dk)
  s = jnp.einsum("bwhgk,bthk->bwhgt", qg, k, preferred_element_type=F32) * scale
  logits = s - pen.transpose(0, 1, 3, 2)[:, :, :, None]
  p = jax.nn.softmax(jnp.where(causal[:, :, None, None], logits, -jnp.inf), axis=-1)
  votes = jnp.sum(jnp.where(w_ok[:, :, None, None, None], p, 0.0), axis=1)  # [B, KVH, G, T]
  pooled = jax.lax.reduce_window(votes, -jnp.inf, jax.lax.max, (1, 1, 1, kernel), (1, 1, 1, 1), "SAME")
  score = jnp.sum(pooled, axis=2).transpose(0, 2, 1)  # [B, T, KVH]
  tt = jnp.arange(t)[None, :, None]
  in_window = (tt >= lengths[:, None, None] - window) & (tt < lengths[:, None, None])
  return jnp.where(in_window, jnp.inf, jnp.where(tt < lengths[:, None, None], score, 0.0))


# ------------------------------------------------------------------------------------------------
# The command lines' policy flags (`python -m fpa_jax.inference`, `python -m fpa_jax.eval`)
# ------------------------------------------------------------------------------------------------


def parse_budget(raw: str) -> float | int:
  """'0.25' -> a fraction, '128' -> a key count (--budget, --head-cap)."""
  try:
    return int(raw)
  except ValueError:
    return float(raw)


def add_policy_args(ap, *, of: str = "prompt + new tokens") -> None:
  """Add the KV-cache policy flags to an argparse parser (one group); `policy_from_args` reads them.
  `of`: what a fractional budget is a fraction of, for the help text."""
  g = ap.add_argument_group("KV-cache policy (fpa_jax.inference.policies)")
  g.add_argument("--policy", default="full", choices=POLICIES, help="the eviction policy (full: keep every key)")
  g.add_argument("--budget", type=parse_budget, help=f"fraction of {of} (0.25) or a key count (128)")
  g.add_argument(
    "--compression-ratio", type=float, help="instead of --budget: the fraction of keys removed (kvpress's; 0.75)"
  )
  g.add_argument("--tolerance", type=float, help="policy fpa: attention mass evicted keys may carry")
  g.add_argument("--threshold", type=float, help="policy fpa_threshold: penalty (nats) at which a key goes")
  g.add_argument("--bound", choices=BOUNDS, help="policy fpa: the logit bound (default keys)")
  g.add_argument(
    "--recent", type=int, help="fpa_budget, fpa_heads, fpa_global, snapkv: last keys never evicted (default budget/8)"
  )
  g.add_argument(
    "--head-cap", type=parse_budget, help="fpa_global: max keys per layer and head in the pool (default: none)"
  )
  g.add_argument(
    "--pool-impl", choices=POOL_IMPLS, help="fpa_global: how the pool runs (default packed; the same keys)"
  )
  g.add_argument(
    "--head-split",
    help="fpa_heads: a head_split.json (head_budget.save_head_split) or the exported model folder holding one; "
    "its budget unless --budget is given",
  )


POLICY_FLAGS = ("budget", "compression_ratio", "tolerance", "threshold", "bound", "recent", "head_cap", "pool_impl")


def policy_from_args(a, **more) -> CachePolicy:
  """The `CachePolicy` the flags of `add_policy_args` name (ValueError: what to change); `more`:
  other arguments (a flag and the same argument in `more`: ValueError)."""
  kw = {k: getattr(a, k) for k in POLICY_FLAGS if getattr(a, k, None) is not None}
  if getattr(a, "head_split", None):
    from fpa_jax.inference.split_file import load_head_split

    kw["split"], budget = load_head_split(a.head_split)
    if "budget" not in kw and "compression_ratio" not in kw:
      kw["budget"] = budget
  both = sorted(set(kw) & set(more))
  if both:
    raise ValueError(f"{both} given twice: as --{both[0].replace('_', '-')} and as another argument")
  return as_policy(a.policy, **kw, **more)
