"""The training objective: the LM loss and its auxiliary terms, in one place (the trainer's step calls
`objective`; evaluation calls `lm_loss`). In a training loop of your own, on any model made of
`FirstPassageAttention` layers: `evictability_loss(model, tokens, key=...) -> (logits, hinge, metrics)`
(one forward pass; docs/training.md, "The recipe in your own loop").

    total = sum of masked token cross-entropies + n_tokens * evict_weight * evict_hinge

so that after the step divides by the token count the gradient is that of mean CE + evict_weight *
evict_hinge (with grad_accum: each micro-batch's hinge weighted by its share of the tokens).

Evictability (`TrainConfig.evict_*`, off when evict_weight = 0: then `objective` is exactly
`lm_loss`, the same program). On `evict_queries` stratified query positions per sequence (drawn
from `key`, new each step), every layer's soft live fraction of the keys outside the recent window
(`fpa_jax.ops.evictability.live_counts`) is hinged at the kept-fraction target of the step,

    target_t = 1 / (1 + (1 / evict_target - 1) * clip((t - evict_ramp_start) / evict_ramp_steps, 0, 1))

DMS's ramp: the compression ratio 1 / target grows linearly from 1 (target 1: no pressure, the
hinge is 0) to 1 / evict_target; evict_ramp_steps = 0 starts at the final target. evict_ramp_start
delays the ramp to a later step: retrofitting a trained run (DMS's recipe) starts it at the run's
step, where the optimizer's step count resumes. The hinge is per
(sequence, query, layer, kv head), averaged over (query, old key) pairs (`hinge_live_fraction`):
every head must fit the budget on its own, as the per-head `fpa_budget` cache does; with
evict_shared the heads of every pressed layer share one budget, as `fpa_global`'s cache does (the
hinge on their mean live fraction: a head that retrieves may keep more where others keep less).
Metrics (all scalars, logged with the train metrics): evict_loss (the hinge, before the weight),
evict_target, evict_live (soft live fraction over all layers), evict_live_l{i} (per layer) and
evict_live_hard (penalty < evict_tau with the exact penalty: what a threshold policy would keep).

Utility-supervised levels (`TrainConfig.utility_*`, off when utility_weight = 0; Locret's target,
`fpa_jax.ops.utility`): at the same kind of sampled queries, every old key (outside evict_window) is
labelled keep when it is among the top utility_keep share by the largest ||v||-weighted attention a
later query gives it (the model's own attention, no gradient), evict otherwise, and the soft live
indicator sigmoid((evict_tau - penalty) / evict_temp) (softplus penalty of evict_soft) is fit to the
labels by a class-balanced cross-entropy, per layer, averaged over layers:

    total += n_tokens * utility_weight * utility_loss

Metrics: utility_loss, utility_recall (share of keep pairs under evict_tau with the exact penalty: what
a threshold policy keeps of what is read), utility_evicted (share of evict pairs at or over it), and
both per layer (_l{i}). Any of the three terms can be on together. `objective_layers` ("1": the top
of two layers) restricts the hinge and the utility term to those layers (their metrics' _l{i} then
count the chosen layers in order); the others keep every key they like.

Gate statistics (`eval_terms`, the trainer's periodic eval: did the read-outs learn to forget?): on the
first held-out batch (its first STATS_ROWS sequences, their first STATS_LEN tokens: the all-pairs
penalty is O(T^2)), per layer, the field's range along each sequence, the share of (query, earlier
key) pairs in one segment with a penalty > 0 (active) and > FORGOTTEN nats (weight below e^-5 of an unpenalised
key's), and the mean penalty, each averaged over sequences and kv heads: whether a gate learns to
forget, as training goes.

Budget in the loop (`TrainConfig.budget_loop_*`, off when budget_loop_prob = 0): on a share
budget_loop_prob of the steps (drawn from `key`) the model runs through the cache an `fpa_budget`
decode of round(rho * T) keys would hold, rho ~ U[budget_loop_min, budget_loop_max]
(`fpa_jax.ops.budget`; the mask is not differentiated, the LM loss over what is kept is; with
budget_loop_soft > 0 the evicted keys stay at a soft bias beyond the cache's threshold, so the loss
reaches the penalties of keys it needed and lost; budget_loop_shared: one cache per layer for all
its kv heads, fpa_global's rule; budget_loop_start: no budgeted step before that optimizer step; the
step's cut, `cut=(capacity, recent[, soft, shared])`, is what the model is called with).
Metric: budget_kept (capacity / T of the step; 1 = no cut). Both terms can be on together.

Self-distillation through the cut (`TrainConfig.distill_weight` > 0, with budget in the loop): DMS
trains its student through the evicting cache against the full-cache teacher's distribution; here
the teacher is the model's own full forward (no gradient), so the LM loss stays on the full forward
(the text keeps learning, as the paired control does) and the cut forward is pulled to it:

    total = sum of CEs (full forward) + distill_weight * sum over target tokens of KL(full || cut)

(`distill_kl`; a step that draws no cut has KL 0 up to rounding: its cut forward is the full one). A frozen teacher (DMS's own) would hold the text at
the source checkpoint's loss, which a retrofit's control moves past (docs/objective.md). Metric:
distill_kl (per target token). The hinge and the utility term read the full forward's gates.

The model must have a gate (`ModelConfig.attention` in `configs.GATED`; `Config.validate` checks).
Shapes: B batch, T sequence, V vocab, L layers, KVH kv heads, Q sampled queries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fpa_jax.configs import TrainConfig
from fpa_jax.layers import attention_inputs, gates_by_layer, with_gates
from fpa_jax.ops import budget as BL
from fpa_jax.ops import evictability as E
from fpa_jax.ops import utility as UT
from fpa_jax.ops.penalty import first_passage_penalty

FORGOTTEN = 5.0  # nats: a penalty past this is reported as forgotten (gate_forgotten_l{i})
STATS_ROWS, STATS_LEN = 2, 256  # the gate statistics' sample of the first eval batch


def lm_loss(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """-> (sum of masked token cross-entropies, number of target tokens)."""
  logits = model(batch["inputs"], batch["segment_ids"])  # [B, T, V] fp32
  return _ce_sum(logits, batch)


def _ce_sum(logits: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, T]
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask)


def evict_target(step, cfg) -> jax.Array:
  """Kept-fraction target at optimizer step `step` (int scalar, may be traced): DMS's linear ramp of
  the compression ratio from 1 to 1 / cfg.evict_target over cfg.evict_ramp_steps (0: no ramp),
  starting at step cfg.evict_ramp_start (target 1 before it)."""
  final_cr = 1.0 / cfg.evict_target
  if cfg.evict_ramp_steps <= 0:
    return jnp.float32(cfg.evict_target)
  progress = jnp.clip((jnp.asarray(step, jnp.float32) - cfg.evict_ramp_start) / cfg.evict_ramp_steps, 0.0, 1.0)
  return 1.0 / (1.0 + (final_cr - 1.0) * progress)


def evict_terms(gates: tuple[jax.Array, jax.Array], segment_ids, cfg, step, key) -> tuple[jax.Array, dict]:
  """(hinge, metrics) from the model's per-layer gates: field, level [L, B, T, KVH] each; the
  trainer's call of `evictability_hinge` with the run's evict_* fields and the step's target."""
  return evictability_hinge(
    gates,
    key,
    segment_ids=segment_ids,
    target=evict_target(step, cfg),
    window=cfg.evict_window,
    tau=cfg.evict_tau,
    temp=cfg.evict_temp,
    soft=cfg.evict_soft,
    queries=cfg.evict_queries,
    shared=cfg.evict_shared,
  )


_EVICT = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name.startswith("evict_")}
# evictability_hinge's options, each the TrainConfig's evict_<name>
HINGE_OPTIONS = ("target", "window", "tau", "temp", "soft", "queries", "shared")


def evictability_hinge(
  gates: tuple[jax.Array, jax.Array],
  key: jax.Array,
  *,
  segment_ids: jax.Array | None = None,
  target=_EVICT["evict_target"],
  window: int = _EVICT["evict_window"],
  tau: float = _EVICT["evict_tau"],
  temp: float = _EVICT["evict_temp"],
  soft: float = _EVICT["evict_soft"],
  queries: int = _EVICT["evict_queries"],
  shared: bool = _EVICT["evict_shared"],
) -> tuple[jax.Array, dict]:
  """The evictability hinge from gate outputs (field, level) [L, B, T, KVH] each (`layers.with_gates`)
  -> (hinge [] fp32, metrics): the module docstring's term, before its weight.

  key: a PRNG key for the `queries` stratified query positions per sequence (draw a new one each
  step). target: the kept fraction of the keys outside the recent `window`, in (0, 1] (a scalar,
  may be traced: `evict_target`'s ramp); tau, temp, soft: the soft count's half-life penalty (nats),
  width and softplus temperature (`ops.evictability.live_counts`). segment_ids [B, T]: keys of
  another segment do not count. shared: one budget for every head of every layer together
  (`ops.evictability.hinge_live_fraction`), not one per (layer, kv head). Defaults: the TrainConfig
  evict_* fields'.
  metrics: evict_loss, evict_target, evict_live, evict_live_hard, evict_live_l{i} (scalars, no gradient)."""
  field, level = gates
  n_layers, b, t, kvh = field.shape
  fold = lambda a: jnp.moveaxis(a, 0, 2).reshape(b, t, n_layers * kvh)  # layers become heads
  kw = dict(target=target, window=window, tau=tau, temp=temp, soft=soft, queries=queries, shared=shared)
  return _hinge(fold(field), fold(level), (kvh,) * n_layers, key, segment_ids, **kw)


def _hinge(field, level, heads, key, segment_ids, *, target, window, tau, temp, soft, queries, shared):
  """`evictability_hinge` on every layer's heads side by side: field, level [B, T, sum(heads)], layer
  i's `heads[i]` kv heads in a row."""
  b, t, _ = field.shape
  q = E.sample_queries(key, b, t, queries, window)
  counts = E.live_counts(field, level, q, window=window, tau=tau, temp=temp, soft=soft, segment_ids=segment_ids)
  hinge, _ = E.hinge_live_fraction(counts, target, shared)
  pooled = jax.lax.stop_gradient(E.pooled_fraction(counts.soft, counts.eligible))  # [sum(heads)]
  if len(set(heads)) == 1:
    per_layer = pooled.reshape(len(heads), heads[0]).mean(-1)
  else:  # layers with their own kv heads
    ends = np.cumsum(heads)
    per_layer = jnp.stack([pooled[e - n : e].mean() for n, e in zip(heads, ends)])
  hard = E.pooled_fraction(counts.hard, counts.eligible).mean()
  metrics = {
    "evict_loss": jax.lax.stop_gradient(hinge),
    "evict_target": jnp.asarray(target, jnp.float32),
    "evict_live": per_layer.mean(),
    "evict_live_hard": hard,
    **{f"evict_live_l{i}": per_layer[i] for i in range(len(heads))},
  }
  return hinge, metrics


def evictability_loss(model, tokens, segment_ids=None, *, key: jax.Array, **hinge_options):
  """The evictability objective on any NNX model made of `FirstPassageAttention` layers (`DecoderLM`
  or a model of your own): one forward pass `model(tokens[, segment_ids])` whose gated layers' gate
  outputs are captured (`layers.gates_by_layer`: what the layers sow) -> (out, hinge, metrics).

  out: the model's own output (the logits, for the LM loss of the same pass); hinge, metrics: as
  `evictability_hinge` (key and hinge_options: target, window, tau, temp, soft, queries), over the
  heads of every gated layer (fpa, stack, fox; layers may differ in kv heads; layers without a gate,
  softmax / nope, have nothing to evict and are left out); `evict_live_l{i}` numbers the gated
  layers in path order. Train on mean CE + weight * hinge (the trainer's `evict_weight`).
  tokens [B, T] int; segment_ids [B, T] or None (then the model is called without it).
  ValueError when no layer has a gate."""
  options = _hinge_options(hinge_options)  # before the forward pass
  args = (tokens,) if segment_ids is None else (tokens, segment_ids)
  out, found = gates_by_layer(model, *args)
  nodes = dict(nnx.iter_graph(model))
  fields, levels, heads = [], [], []
  for path, calls in found:
    if getattr(nodes.get(path), "gate", None) is None:
      continue
    for f, lv in calls:
      per = [(f, lv)] if f.ndim == 3 else list(zip(f, lv))  # a scanned stack: [L, B, T, KVH]
      for fi, li in per:
        fields.append(fi)
        levels.append(li)
        heads.append(fi.shape[-1])
  if not fields:
    raise ValueError(
      f"{type(model).__name__} has no gated FirstPassageAttention layer (gate fpa, stack or fox): nothing to evict"
    )
  field, level = jnp.concatenate(fields, -1), jnp.concatenate(levels, -1)
  hinge, metrics = _hinge(field, level, tuple(heads), key, segment_ids, **options)
  return out, hinge, metrics


def _hinge_options(given: dict) -> dict:
  return _options(given, HINGE_OPTIONS, {k: _EVICT[f"evict_{k}"] for k in HINGE_OPTIONS}, "the hinge")


def _options(given: dict, names: tuple[str, ...], defaults: dict, what: str) -> dict:
  """An objective's keyword options, checked before tracing, the TrainConfig's defaults filled in."""
  bad = sorted(set(given) - set(names))
  if bad:
    raise ValueError(f"unknown argument(s) {bad}; {what} takes {names} (the TrainConfig evict_* / utility_* fields)")
  return {k: given.get(k, defaults[k]) for k in names}


def utility_terms(per_layer, key, segment_ids=None, *, keep, window, tau, temp, soft, queries):
  """The utility objective (module docstring) from what each gated layer attended with: per_layer a
  sequence of (q [B, T, H, K], k, v [B, T, KVH, K], field, level [B, T, KVH]) in path order
  (`layers.attention_inputs`) -> (loss [] fp32, metrics). One draw of `queries` sampled queries per
  sequence (`key`) serves every layer."""
  if not per_layer:
    raise ValueError("the utility objective needs at least one gated attention layer")
  b, t = per_layer[0][3].shape[:2]
  qi = E.sample_queries(key, b, t, queries, window)
  losses, recall, evicted = [], [], []
  for q, k, v, field, level in per_layer:
    pen, hard, elig = E.pair_penalties(field, level, qi, window=window, soft=soft, segment_ids=segment_ids)
    util = UT.key_utility(q, k, v, field, level, qi, segment_ids=segment_ids)
    labels = UT.keep_labels(util, elig, keep)
    losses.append(UT.utility_bce(pen, labels, elig, tau=tau, temp=temp))
    e = jnp.broadcast_to(elig[..., None], labels.shape)
    under = jax.lax.stop_gradient(hard) < tau
    recall.append(jnp.sum(labels & under) / jnp.maximum(jnp.sum(labels), 1))
    evicted.append(jnp.sum(e & ~labels & ~under) / jnp.maximum(jnp.sum(e & ~labels), 1))
  loss = jnp.mean(jnp.stack(losses))
  metrics = {
    "utility_loss": jax.lax.stop_gradient(loss),
    "utility_recall": jnp.mean(jnp.stack(recall)),
    "utility_evicted": jnp.mean(jnp.stack(evicted)),
    **{f"utility_recall_l{i}": r for i, r in enumerate(recall)},
    **{f"utility_evicted_l{i}": r for i, r in enumerate(evicted)},
  }
  return loss, metrics


def gated_attention_inputs(model, *args, **kwargs):
  """model(*args, **kwargs) -> (out, [(q, k, v, field, level) of every gated layer and call, in path
  order]) (`layers.attention_inputs`; a scanned stack's layers one by one; layers without a gate,
  softmax / nope, left out)."""
  out, found = attention_inputs(model, *args, **kwargs)
  nodes = dict(nnx.iter_graph(model))
  per_layer = []
  for path, calls in found:
    if getattr(nodes.get(path), "gate", None) is None:
      continue
    for call in calls:
      per_layer += [call] if call[3].ndim == 3 else list(zip(*call))  # a scanned stack: [L, ...] each
  return out, per_layer


UTILITY_OPTIONS = ("keep", "window", "tau", "temp", "soft", "queries")


def utility_loss(model, tokens, segment_ids=None, *, key: jax.Array, **options):
  """The utility objective on any NNX model made of `FirstPassageAttention` layers, from one forward
  pass (as `evictability_loss`) -> (out, loss, metrics). options: keep (the TrainConfig's
  utility_keep), window, tau, temp, soft, queries (its evict_* fields); defaults: TrainConfig's.
  tokens [B, T] int; segment_ids [B, T] or None. ValueError when no layer has a gate."""
  opts = _options(options, UTILITY_OPTIONS, _UTILITY_DEFAULTS, "the utility objective")
  args = (tokens,) if segment_ids is None else (tokens, segment_ids)
  out, per_layer = gated_attention_inputs(model, *args)
  if not per_layer:
    raise ValueError(
      f"{type(model).__name__} has no gated FirstPassageAttention layer (gate fpa, stack or fox): nothing to rank"
    )
  loss, metrics = utility_terms(per_layer, key, segment_ids, **opts)
  return out, loss, metrics


_UTILITY_DEFAULTS = {
  "keep": next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "utility_keep"),
  **{k: _EVICT[f"evict_{k}"] for k in ("window", "tau", "temp", "soft", "queries")},
}


def _utility_of(per_layer, segment_ids, cfg, key):
  return utility_terms(
    per_layer,
    key,
    segment_ids,
    keep=cfg.utility_keep,
    window=cfg.evict_window,
    tau=cfg.evict_tau,
    temp=cfg.evict_temp,
    soft=cfg.evict_soft,
    queries=cfg.evict_queries,
  )


def objective(model, batch: dict, cfg, step=0, key: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """-> (value to differentiate, aux): aux holds lm_sum (sum of CEs), count (target tokens) and, with
  an objective on, its metrics (see the module docstring). `cfg`: anything with the TrainConfig
  evict_*, utility_* and budget_loop_* fields (a run Config); `step`: the optimizer step (the target's
  ramp); `key`: a PRNG key for the query positions and the step's cut (needed when any is on)."""
  cut_on = bool(cfg.budget_loop_prob)
  utility_on = bool(cfg.utility_weight)
  if not cfg.evict_weight and not cut_on and not utility_on:
    s, n = lm_loss(model, batch)
    return s, {"lm_sum": s, "count": n}
  if key is None:
    raise ValueError("objective with evict_weight, utility_weight or budget_loop_prob > 0 needs a PRNG `key`")
  # the evict queries' stream as before budget in the loop; the cut's and the utility's their own
  k_evict, k_cut, k_utility = key, jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)
  metrics, cut = {}, None
  if cut_on:
    t = batch["inputs"].shape[1]
    prob = jnp.where(jnp.asarray(step) >= cfg.budget_loop_start, cfg.budget_loop_prob, 0.0)
    cut = BL.draw_capacity(k_cut, t, prob, cfg.budget_loop_min, cfg.budget_loop_max)
    if cfg.budget_loop_soft or cfg.budget_loop_shared:
      cut = (*cut, float(cfg.budget_loop_soft), bool(cfg.budget_loop_shared))
    metrics["budget_kept"] = cut[0].astype(jnp.float32) / t
  student = None
  if cut_on and cfg.distill_weight:  # the cut forward is the student; every other term reads the full one
    student, cut = model(batch["inputs"], batch["segment_ids"], cut=cut), None
  if not cfg.evict_weight and not utility_on:
    logits = model(batch["inputs"], batch["segment_ids"], cut=cut)
    s, n = _ce_sum(logits, batch)
    total, metrics = _with_distill(s, n, logits, student, batch, cfg, metrics)
    return total, {"lm_sum": s, "count": n, **metrics}
  seg = batch["segment_ids"]
  pick = cfg.objective_layer_ids  # None: every layer
  if utility_on:
    logits, per_layer = gated_attention_inputs(model, batch["inputs"], seg, cut=cut)
    if pick is not None:
      if len(per_layer) != cfg.n_layers:  # indices would not name layers
        raise ValueError(f"objective_layers needs every layer gated; {len(per_layer)} of {cfg.n_layers} are")
      per_layer = [per_layer[i] for i in pick]
    gates = tuple(jnp.stack([c[i] for c in per_layer]) for i in (3, 4))  # [L', B, T, KVH]
  else:
    logits, gates = with_gates(model, batch["inputs"], seg, cut=cut)
    if pick is not None:
      gates = tuple(g[jnp.asarray(pick)] for g in gates)
  s, n = _ce_sum(logits, batch)
  total, metrics = _with_distill(s, n, logits, student, batch, cfg, metrics)
  if cfg.evict_weight:
    hinge, ev = evict_terms(gates, seg, cfg, step, k_evict)
    total = total + jax.lax.stop_gradient(n) * (cfg.evict_weight * hinge)
    metrics |= ev
  if utility_on:
    u, um = _utility_of(per_layer, seg, cfg, k_utility)
    total = total + jax.lax.stop_gradient(n) * (cfg.utility_weight * u)
    metrics |= um
  return total, {"lm_sum": s, "count": n, **metrics}


def distill_kl(teacher_logits: jax.Array, student_logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Sum over the masked positions of KL(softmax(teacher) || softmax(student)), fp32; no gradient
  reaches the teacher. teacher_logits, student_logits [B, T, V]; mask [B, T] (the loss mask)."""
  if teacher_logits.shape != student_logits.shape or mask.shape != teacher_logits.shape[:-1]:
    raise ValueError(
      f"distill_kl: teacher {teacher_logits.shape} and student {student_logits.shape} logits must match "
      f"[B, T, V] and the mask {mask.shape} be their [B, T]"
    )
  log_t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), -1)
  log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32), -1)
  kl = jnp.sum(jnp.exp(log_t) * (log_t - log_s), -1)
  return jnp.sum(kl * mask.astype(jnp.float32))


def _with_distill(s, n, logits, student, batch, cfg, metrics):
  """-> (s + distill_weight * KL sum, metrics with distill_kl) when the step has a student, else (s, metrics)."""
  if student is None:
    return s, metrics
  kl = distill_kl(logits, student, batch["loss_mask"])
  return s + cfg.distill_weight * kl, {**metrics, "distill_kl": kl / jnp.maximum(n, 1.0)}


def gate_stats(gates: tuple[jax.Array, jax.Array], segment_ids: jax.Array | None) -> dict[str, jax.Array]:
  """Per-layer gate statistics (module docstring) from field, level [L, B, T, KVH] and segment_ids
  [B, T] (None: one segment) -> {gate_field_range_l{i}, gate_active_l{i}, gate_forgotten_l{i},
  gate_penalty_l{i}}, fp32 scalars. O(L B KVH T^2): an eval-time diagnostic, not a training term."""
  field, level = (jnp.moveaxis(a, -1, -2) for a in gates)  # [L, B, KVH, T]
  t = field.shape[-1]
  pen = first_passage_penalty(field, level)  # [L, B, KVH, T(i), T(j)]
  pairs = jnp.tril(jnp.ones((t, t), bool), -1)
  if segment_ids is not None:
    pairs = pairs & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, T]
  pairs = jnp.broadcast_to(pairs, pen.shape[1:]).astype(jnp.float32)
  n = jnp.maximum(pairs.sum((1, 2, 3)), 1.0)  # per sequence
  share = lambda x: jnp.mean(jnp.sum(jnp.where(pairs > 0, x, 0.0), (-3, -2, -1)) / n, -1)  # [L]: mean over B
  rng = (field.max(-1) - field.min(-1)).mean((1, 2))
  active, forgotten = share((pen > 0).astype(jnp.float32)), share((pen > FORGOTTEN).astype(jnp.float32))
  mean_pen = share(pen)
  out = {}
  for i in range(field.shape[0]):
    out |= {
      f"gate_field_range_l{i}": rng[i],
      f"gate_active_l{i}": active[i],
      f"gate_forgotten_l{i}": forgotten[i],
      f"gate_penalty_l{i}": mean_pen[i],
    }
  return out


def eval_terms(model, batch: dict, with_gate_stats: bool) -> tuple[jax.Array, jax.Array, dict]:
  """-> (sum of masked CEs, target tokens, `gate_stats` or {}): the trainer's eval of one batch."""
  if not with_gate_stats:
    return *lm_loss(model, batch), {}
  logits, gates = with_gates(model, batch["inputs"], batch["segment_ids"])
  cut = lambda a: a[..., :STATS_ROWS, :STATS_LEN, :]  # noqa: E731  [L, B, T, KVH]
  seg = batch["segment_ids"]
  stats = gate_stats(tuple(map(cut, gates)), None if seg is None else seg[:STATS_ROWS, :STATS_LEN])
  return *_ce_sum(logits, batch), stats
