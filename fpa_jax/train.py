"""Sharded, resumable training of the decoder LM.

    python -m fpa_jax.train --config tiny --attention fpa --task text --steps 50 --workdir /tmp/run
    python -m fpa_jax.train --config small --attention fox --task passkey --steps 2000 --set seq_len=1024 \
        --set batch_size=8 --workdir runs/fox --mesh data=4,model=2 --set lr=3e-4 --set grad_accum=2 \
        [--profile-steps 10:12]

Rerunning a command with a larger --steps resumes from the latest checkpoint in --workdir (model,
optimizer, step and data iterator). The cosine horizon is `lr_decay_steps` (default: --steps);
fix it (`--set lr_decay_steps=N`) when you plan to extend a run, so the extension is exactly the
run you would have had straight through. A resume keeps the model (`configs.resume_fields()`: sizes,
attention and gate, RoPE, scales, param dtype, layer layout); any training or data field, and
attn_impl, block_size, dtype, remat or the init fields, may change. A damaged latest checkpoint is
skipped (logged, moved to checkpoints.corrupt/) in favour of the newest one that restores
(`Checkpointer.restore_newest`); if none does, the run stops with one error naming the fix.

Outputs in the workdir: metrics.jsonl (one JSON object per logged step: step, loss, tokens_per_s,
lr, grad_norm, ...; evict_* with the evictability objective on, utility_* with the utility one,
budget_kept with budget in the loop (whose steps' loss is the loss through that step's cache, or
with self-distillation the full forward's, and distill_kl), eval_loss and gate_* statistics of a
gated model at each periodic eval, `fpa_jax.losses`), TensorBoard events
under tb/, checkpoints/ (orbax), config.json.

Design (functional NNX): the model and optimizer are created *inside* a jit whose out_shardings
come from the parameters' logical axis names (`fpa_jax.sharding.RULES`), so nothing is ever
materialised unsharded; `nnx.split` gives (graphdef, state) and the train step is a pure jitted
function state -> state with explicit in/out NamedShardings and the state buffers donated.
Multi-host: see `fpa_jax.sharding.maybe_initialize_distributed` (called by `main`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from fpa_jax import cli
from fpa_jax import configs as C
from fpa_jax import data as D  # its modules (grain, TFDS) load on first use, in make_data
from fpa_jax import optim
from fpa_jax import sharding as S
from fpa_jax.checkpoint import Checkpointer, abstract_with_shardings, own_process_state
from fpa_jax.losses import eval_terms, lm_loss, objective  # noqa: F401 (lm_loss: re-exported for compatibility)
from fpa_jax.models import DecoderLM, weight_decay_mask
from fpa_jax.optim import GATE_READOUTS, clip_by_global_norm_apart, gate_readout_mask  # noqa: F401 (re-exported)


class NonFiniteLossError(FloatingPointError):
  """Raised when the loss or gradient norm is NaN/inf; the last good checkpoint is kept."""


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def make_data(cfg: C.Config, split: str = "train"):
  """The configured data pipeline of `split` (`fpa_jax.data.make_pipeline`, the synthetic task included)."""
  pi, pc = jax.process_index(), jax.process_count()
  if cfg.batch_size % pc:
    raise ValueError(f"batch_size={cfg.batch_size} (global) is not divisible by the {pc} processes")
  # The pipeline's batch is per process; cfg.batch_size is global. vocab_size: synthetic only.
  return D.make_pipeline(
    cfg.task,
    split,
    data_dir=cfg.data_dir,
    seq_len=cfg.seq_len,
    batch_size=cfg.batch_size // pc,
    seed=cfg.seed,
    tokenizer=cfg.tokenizer,
    small=cfg.small_data,
    text_source=cfg.text_source,
    shuffle=(split == "train"),
    num_epochs=None if split == "train" else 1,
    process_index=pi,
    process_count=pc,
    vocab_size=cfg.vocab_size,
  )


# ------------------------------------------------------------------------------------------------
# Optimizer, state, step
# ------------------------------------------------------------------------------------------------


def lr_schedule(cfg: C.TrainConfig) -> optax.Schedule:
  warm = min(cfg.warmup_steps, cfg.decay_steps)
  base = optax.warmup_cosine_decay_schedule(
    0.0, cfg.lr, warm, max(cfg.decay_steps, warm + 1), end_value=cfg.lr * cfg.min_lr_ratio
  )
  if not cfg.cooldown_steps:
    return base
  start = cfg.steps - cfg.cooldown_steps  # WSD: from base(start) linearly down to 0 at `steps`
  cool = optax.linear_schedule(base(start), 0.0, cfg.cooldown_steps)
  return optax.join_schedules([base, cool], [start])


def make_optimizer(cfg: C.Config) -> optax.GradientTransformation:
  """AdamW (decay on matrices only) + warmup/cosine + global-norm clipping, with the gate's parts
  (`fpa_jax.optim.gate_optimizer`: the read-outs clipped apart, their lr scaled and ramped) as the
  config's `gate_clip_apart`, `gate_lr_scale` and `gate_lr_warmup_steps` say."""
  adamw = optax.adamw(
    lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=weight_decay_mask(cfg.model)
  )
  options = {k: getattr(cfg, k) for k in optim.OPTIONS}
  return optim.gate_optimizer(adamw, recipe=None, clip_norm=cfg.clip_norm, **options)


def _init_fn(cfg: C.Config, tx) -> Callable[[], tuple]:
  def init():
    model = DecoderLM(cfg.model, rngs=nnx.Rngs(params=cfg.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  return init


def abstract_state(cfg: C.Config, tx=None):
  """-> (graphdef, abstract state) of the trainer's (model, optimizer) for `cfg` and `tx` (default
  `make_optimizer(cfg)`): shapes and dtypes only (`nnx.eval_shape`: no memory, no FLOPs), the layout
  `create_state` fills; a step can be lowered and compiled on it."""
  tx = make_optimizer(cfg) if tx is None else tx
  return nnx.split(nnx.eval_shape(_init_fn(cfg, tx)))


def create_state(cfg: C.Config, mesh: jax.sharding.Mesh, tx=None):
  """-> (graphdef, sharded state, state shardings). Params are created shard-by-shard in a jit."""
  tx = make_optimizer(cfg) if tx is None else tx
  init = _init_fn(cfg, tx)
  graphdef, abstract = abstract_state(cfg, tx)
  shardings = S.state_shardings(abstract, mesh)
  state = jax.jit(lambda: nnx.state(init()), out_shardings=shardings)()
  return graphdef, state, shardings, abstract


AnyMesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _in_mesh(mesh: AnyMesh):
  """The context a step traces in: `jax.set_mesh` for a concrete mesh, `jax.sharding.use_abstract_mesh`
  for an abstract one (no devices: a step that can only be exported, e.g. for a TPU pod on CPU)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


class _UnderMesh:
  """A jitted function called, traced, lowered and exported with `mesh` in context (`_in_mesh`)."""

  def __init__(self, jitted, mesh: AnyMesh):
    self.jitted, self.mesh = jitted, mesh

  def __call__(self, *args):
    with _in_mesh(self.mesh):
      return self.jitted(*args)

  def lower(self, *args):
    with _in_mesh(self.mesh):
      return self.jitted.lower(*args)

  def export(self, *args, platforms: tuple[str, ...] | list[str]) -> jax.export.Exported:
    """`jax.export` of the function on `args` (arrays or `jax.ShapeDtypeStruct`s) for `platforms`,
    e.g. ["tpu"]: on an abstract mesh, the sharded program for devices this host does not have."""
    with _in_mesh(self.mesh):
      return jax.export.export(self.jitted, platforms=platforms)(*args)


class TrainStep:
  """Builds the jitted step; `traces` counts Python traces (must stay 1: no retracing).

  mesh: the concrete mesh the step runs on, or a `jax.sharding.AbstractMesh` (with `shardings` of
  `sharding.state_shardings(abstract, mesh)`) for a step that is only exported (`jitted.export`)."""

  def __init__(self, cfg: C.Config, graphdef, shardings, mesh: AnyMesh, tx):
    self.cfg, self.graphdef, self.mesh, self.traces = cfg, graphdef, mesh, 0
    self.schedule = lr_schedule(cfg)
    batch_sh = {k: S.batch_sharding(mesh) for k in ("inputs", "targets", "segment_ids", "loss_mask")}
    rep = NamedSharding(mesh, P())
    # Both run under the mesh (`_in_mesh`), so the model's activation constraints
    # (`fpa_jax.sharding.constrain`) shard the batch over `data` (they are no-ops without a mesh).
    self.jitted = _UnderMesh(
      jax.jit(self._step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, rep), donate_argnums=(0,)), mesh
    )
    self.eval_jitted = _UnderMesh(jax.jit(self._eval, in_shardings=(shardings, batch_sh), out_shardings=rep), mesh)
    self.stats_jitted = _UnderMesh(  # the eval with gate statistics (`losses.gate_stats`): first batch only
      jax.jit(functools.partial(self._eval, stats=True), in_shardings=(shardings, batch_sh), out_shardings=rep), mesh
    )

  def _step(self, state, batch):
    self.traces += 1  # Python side effect: runs once per trace, never per call
    cfg = self.cfg
    model, opt = nnx.merge(self.graphdef, state)
    gdef, params, rest = nnx.split(model, nnx.Param, ...)

    # The objective (`fpa_jax.losses`): the LM loss, plus the evictability hinge when evict_weight > 0
    # (its query positions drawn from a key of (seed, step, micro-batch)).
    randomised = cfg.evict_weight or cfg.utility_weight or cfg.budget_loop_prob  # sampled queries / the cache budget
    step_key = jax.random.fold_in(jax.random.key(cfg.seed), opt.step[...]) if randomised else None

    def loss_fn(p, mb, k=0):
      key = None if step_key is None else jax.random.fold_in(step_key, k)
      return objective(nnx.merge(gdef, p, rest), mb, cfg, opt.step[...], key)

    a = cfg.grad_accum
    if a == 1:
      (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
      loss_sum, count = aux.pop("lm_sum"), aux.pop("count")
    else:
      # Micro-batch k takes rows k, k+a, ...: every device keeps an equal share of each micro-batch.
      spec = NamedSharding(self.mesh, P(None, S.RULES[S.BATCH]))
      micro = {
        k: jax.lax.with_sharding_constraint(jnp.swapaxes(v.reshape(v.shape[0] // a, a, *v.shape[1:]), 0, 1), spec)
        for k, v in batch.items()
      }

      def body(carry, xs):
        g_acc, l_acc, n_acc = carry
        mb, k = xs
        (_, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, k)
        l, n = aux.pop("lm_sum"), aux.pop("count")
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, n_acc + n), aux

      zeros = jax.tree.map(jnp.zeros_like, params)
      (grads, loss_sum, count), aux = jax.lax.scan(
        body, (zeros, jnp.float32(0), jnp.float32(0)), (micro, jnp.arange(a))
      )
      aux = jax.tree.map(lambda m: jnp.mean(m, axis=0), aux)  # evict_* metrics: mean over micro-batches
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)  # mean over all target tokens of the step
    lr = self.schedule(opt.step[...])
    loss, grad_norm = loss_sum / denom, optax.tree.norm(grads)
    opt.update(model, grads)
    # Non-finite guard on device: a bad step leaves the whole state (params, moments, step) as it
    # was; the loop sees `nonfinite` at its next host sync and stops (no host sync per step).
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), nnx.state((model, opt)), state)
    metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": lr,
      "tokens": count,
      "nonfinite": jnp.logical_not(ok).astype(jnp.int32),
      **aux,  # evict_* (objective on): hinge, target, live fractions per layer; budget_kept
    }
    return new_state, metrics

  def _eval(self, state, batch, stats=False):
    model, _ = nnx.merge(self.graphdef, state)
    return eval_terms(model, batch, stats)

  def __call__(self, state, batch):
    return self.jitted(state, batch)


# ------------------------------------------------------------------------------------------------
# Loop
# ------------------------------------------------------------------------------------------------


class _Logger:
  """metrics.jsonl + TensorBoard (process 0 only)."""

  def __init__(self, workdir: str):
    self.on = jax.process_index() == 0
    self.f = open(os.path.join(workdir, "metrics.jsonl"), "a") if self.on else None
    self.tb = None
    if self.on:
      try:
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:  # pragma: no cover - optional
        self.tb = None

  def write(self, record: dict) -> None:
    if not self.on:
      return
    self.f.write(json.dumps(record) + "\n")
    self.f.flush()
    if self.tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self.tb.add_scalar(k, v, record["step"])

  def close(self) -> None:
    if self.f:
      self.f.close()
    if self.tb is not None:
      self.tb.close()


def _check_resume_config(saved: dict, cfg: C.Config, directory: str) -> None:
  """Refuses a checkpoint of another model: the saved config (a flat `Config.to_dict()`, old runs
  included) must agree with `cfg.model` on `configs.resume_fields()`; a field it lacks (a run older
  than the field) passes. Training and data fields, attn_impl, dtype, remat etc. may change."""
  model = cfg.model
  diff = {k: (saved[k], getattr(model, k)) for k in C.resume_fields() if k in saved and saved[k] != getattr(model, k)}
  if diff:
    raise ValueError(
      f"checkpoint in {directory} was made with a different model ({diff}, saved vs now); "
      "use a new --workdir or the original settings"
    )


def train(
  config: C.Config,
  *,
  workdir: str,
  data: Iterator | None = None,
  mesh: jax.sharding.Mesh | None = None,
  progress: bool | None = None,
  log: Callable[[str], None] | None = None,
  profile_steps: tuple[int, int] | None = None,
) -> dict[str, Any]:
  """Train (or resume) `config` in `workdir`. `data`: any iterator of batch dicts with
  get_state/set_state (default: the configured pipeline). Returns a summary dict with the final
  `state`, `graphdef`, `history` (logged records), `traces`, `start_step`, `step`.

  Metrics stay on device between log / checkpoint steps (no per-step host sync). A step with a
  non-finite loss or gradient norm is skipped on device; the next log / checkpoint step raises
  NonFiniteLossError without saving, so the last checkpoint predates the first bad step.
  `profile_steps=(A, B)`: a `jax.profiler` trace of steps A..B in <workdir>/profile.
  `progress`: a tqdm bar (True), silence (False), or by default (None) a bar on a terminal and one
  `log` line per logged step when stderr is a pipe or a file.
  """
  log = log or (lambda s: print(s, file=sys.stderr, flush=True))
  cfg = config.validate(training=True)  # refuses what cannot be trained
  mesh = mesh if mesh is not None else S.make_mesh(cfg.mesh or None)
  cfg.validate_mesh(dict(mesh.shape))
  os.makedirs(workdir, exist_ok=True)

  pipeline = make_data(cfg) if data is None else data
  vocab = getattr(pipeline, "vocab_size", cfg.vocab_size)
  if vocab != cfg.vocab_size:
    log(f"[train] vocab_size {cfg.vocab_size} -> {vocab} (from the data pipeline)")
    cfg = C.replace(cfg, vocab_size=vocab)

  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.keep_checkpoints)
  check = lambda saved: _check_resume_config(saved, cfg, ckpt.directory)
  start = 0
  try:
    newest = ckpt.newest_config()
    if newest:  # before building the state: another model's checkpoint gets this error, not a shape mismatch
      check(newest[1])
    tx = make_optimizer(cfg)
    graphdef, state, shardings, abstract = create_state(cfg, mesh, tx)
    step_fn = TrainStep(cfg, graphdef, shardings, mesh, tx)
    if ckpt.all_steps():
      # The newest checkpoint that restores (a damaged newer one is logged, skipped and moved aside);
      # none restoring is one CheckpointRestoreError (a ValueError: the CLI's "error: ...", exit 2).
      del state  # freed first: restored straight into sharded buffers
      restored = ckpt.restore_newest(abstract_with_shardings(abstract, shardings), check_config=check, log=log)
      start, state, data_state, _ = restored
      pipeline.set_state(own_process_state(data_state))  # raises if the process count changed
      log(f"[train] resumed from step {start} in {ckpt.directory}")
  except BaseException:
    ckpt.close()
    raise
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=1)

  logger = _Logger(workdir)
  tty = sys.stderr.isatty() if progress is None else progress
  # progress=None into a pipe or a log file: one plain line per logged step instead of a bar
  lines = progress is None and not tty and jax.process_index() == 0
  bar = None
  if tty and jax.process_index() == 0:
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=start, dynamic_ncols=True)
  eval_data = None
  history: list[dict] = []
  last_good = start
  t_window, tok_window = time.perf_counter(), 0.0
  step = start
  pending: list[tuple[int, dict]] = []  # (step, on-device metrics) since the last host sync
  prof = _Profiler(profile_steps, os.path.join(workdir, "profile"), log)
  try:
    for step in range(start, cfg.steps):
      done = step + 1
      prof.before(done)
      batch = S.shard_batch(next(pipeline), mesh)
      state, metrics = step_fn(state, batch)
      pending.append((done, metrics))
      prof.after(done, state)
      tok_window += cfg.batch_size * cfg.seq_len  # throughput counts every input token
      if bar is not None:
        bar.update(1)
      is_log = done % cfg.log_every == 0 or done == cfg.steps or done == start + 1
      is_ckpt = done % cfg.ckpt_every == 0 or done == cfg.steps
      if not (is_log or is_ckpt):
        continue  # metrics stay on device: no host sync between log / checkpoint steps
      with jax.transfer_guard_device_to_host("allow"):  # the loop's only metric transfer
        m = _fetch_metrics(pending)
      pending = []
      bad = [d for d, mm in m if mm["nonfinite"]]
      if bad:
        first = dict(m)[bad[0]]
        ckpt.wait()
        raise NonFiniteLossError(
          f"non-finite loss/grad at step {bad[0]} (loss={first['loss']}, grad_norm={first['grad_norm']}); "
          f"{len(bad)} bad step(s) skipped on device, stopped without saving. Last good checkpoint: "
          f"step {ckpt.latest_step()} in {ckpt.directory}. "
          "Try a lower lr, a longer warmup_steps, clip_norm > 0 or dtype='float32' (config fields: "
          "get_config(..., lr=...), or --set lr=... on the command line)."
        )
      if is_log:
        last = m[-1][1]
        now = time.perf_counter()
        rec = {
          "step": done,
          "loss": last["loss"],
          "tokens_per_s": tok_window / max(now - t_window, 1e-9),
          "lr": last["lr"],
          "grad_norm": last["grad_norm"],
          "loss_tokens": last["tokens"],
          **{k: v for k, v in last.items() if k.startswith(("evict_", "utility_", "budget_", "distill_"))},
        }
        if cfg.eval_every and done % cfg.eval_every == 0:
          with jax.transfer_guard_device_to_host("allow"):
            eval_data, ev, gate = _evaluate(cfg, step_fn, state, mesh, eval_data, log)
          if ev is not None:
            rec["eval_loss"] = ev
          rec.update(gate)  # gate_* statistics (`losses.gate_stats`)
        logger.write(rec)
        history.append(rec)
        t_window, tok_window = time.perf_counter(), 0.0
        if bar is not None:
          bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        elif lines:
          log(f"[train] step {done}/{cfg.steps} loss {last['loss']:.4f} tok/s {rec['tokens_per_s']:.0f}")
      if is_ckpt:  # only reached when every step since the last sync was finite
        with jax.transfer_guard_device_to_host("allow"):
          ckpt.save(done, state, pipeline.get_state(), cfg.to_dict())
        last_good = done
  finally:
    prof.close()
    ckpt.close()
    logger.close()
    if bar is not None:
      bar.close()
  return {
    "state": state,
    "graphdef": graphdef,
    "history": history,
    "traces": step_fn.traces,
    "start_step": start,
    "step": max(step + 1, start) if cfg.steps > start else start,
    "config": cfg,
    "last_checkpoint": last_good,
  }


def _fetch_metrics(pending: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
  """One device->host transfer of the metrics of the steps since the last sync -> python scalars."""
  host = jax.device_get([m for _, m in pending])
  return [
    (d, {k: (int(v) if k == "nonfinite" else float(v)) for k, v in h.items()}) for (d, _), h in zip(pending, host)
  ]


class _Profiler:
  """`jax.profiler` trace of steps A..B (1-based, inclusive, as in metrics.jsonl) into `logdir`."""

  def __init__(self, steps: tuple[int, int] | None, logdir: str, log):
    self.steps, self.logdir, self.log, self.on = steps, logdir, log, False

  def before(self, done: int) -> None:
    if self.steps and self.steps[0] <= done <= self.steps[1] and not self.on:  # also mid-range on resume
      os.makedirs(self.logdir, exist_ok=True)
      jax.profiler.start_trace(self.logdir)
      self.on = True

  def after(self, done: int, state) -> None:
    if self.on and done >= self.steps[1]:
      jax.block_until_ready(state)  # the traced steps' device work ends inside the trace
      self.close()

  def close(self) -> None:
    if self.on:
      jax.profiler.stop_trace()
      self.on = False
      self.log(f"[train] profile of steps {self.steps[0]}:{self.steps[1]} written to {self.logdir}")


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
  """'A:B' -> (A, B) with 1 <= A <= B; None/'' -> None."""
  if not spec:
    return None
  a, sep, b = spec.partition(":")
  if not sep or not a.strip().isdigit() or not b.strip().isdigit() or not 1 <= int(a) <= int(b):
    raise ValueError(f"--profile-steps {spec!r}: expected A:B with 1 <= A <= B (steps as in metrics.jsonl)")
  return int(a), int(b)


def _pad_rows(batch: dict, rows: int) -> dict:
  """Pad a final partial eval batch with all-masked rows, so its shape (and the jit) stays fixed."""
  n = len(batch["inputs"])
  if n == rows:
    return batch
  return {k: np.concatenate([v, np.zeros((rows - n,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def heldout_batches(cfg: C.Config) -> list[dict]:
  """The fixed validation set the periodic eval scores, as this process's padded batches: for text
  the held-out windows over every validation document (`fpa_jax.data.make_heldout`,
  `heldout_windows` of them), else the first `eval_batches` batches of the unshuffled split."""
  rows = cfg.batch_size // jax.process_count()
  if cfg.task == "text":
    h = D.make_heldout(
      "validation",
      data_dir=cfg.data_dir,
      seq_len=cfg.seq_len,
      batch_size=rows,
      n_windows=cfg.heldout_windows,
      tokenizer=cfg.tokenizer,
      small=cfg.small_data,
      text_source=cfg.text_source,
    )
    return [_pad_rows(b, rows) for b in h]
  it = make_data(cfg, "validation")
  out = []
  for b in it:
    out.append(_pad_rows(b, rows))
    if len(out) == cfg.eval_batches:
      break
  return out


def _evaluate(cfg, step_fn, state, mesh, eval_data, log):
  """Mean validation loss over the fixed held-out set (`heldout_batches`, read once, the same at
  every eval); skipped if the task has no validation split."""
  if eval_data is None:
    try:
      eval_data = heldout_batches(cfg)
    except Exception as e:  # noqa: BLE001 - a missing split just disables eval
      log(f"[train] no validation split for {cfg.task!r} ({e}); eval disabled")
      return False, None, {}
  if eval_data is False:
    return False, None, {}
  tot, n, stats = 0.0, 0.0, {}
  for i, b in enumerate(eval_data):
    fn = step_fn.stats_jitted if i == 0 and cfg.attention in C.GATED else step_fn.eval_jitted
    s, c, st = jax.device_get(fn(state, S.shard_batch(b, mesh)))
    tot, n = tot + float(s), n + float(c)
    stats = stats or {k: float(v) for k, v in st.items()}
  return eval_data, (tot / n if n else None), stats


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> tuple[C.Config, argparse.Namespace]:
  ap = argparse.ArgumentParser(prog="python -m fpa_jax.train", description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", default="tiny", choices=sorted(C.CONFIGS))
  ap.add_argument("--attention", choices=C.ATTENTIONS)
  # "synthetic" is a hidden test-only task (deterministic in-memory tokens), not listed in --help.
  ap.add_argument("--task", help=f"one of {C.TASKS}")
  ap.add_argument("--steps", type=int)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--mesh", help="e.g. data=4,model=2 (product = device count); default all on data")
  ap.add_argument("--data-dir")
  ap.add_argument(
    "--set",
    dest="sets",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="override any config field, repeatable (e.g. --set lr=3e-4 --set dtype=bfloat16)",
  )
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument(
    "--profile-steps",
    metavar="A:B",
    help="write a jax.profiler trace of steps A..B (1-based, inclusive) to <workdir>/profile",
  )
  args = cli.parse(ap, argv)
  overrides = C.parse_overrides(C.CONFIGS[args.config], args.sets)
  for key in ("attention", "task", "steps", "mesh", "data_dir"):
    if getattr(args, key) is not None:
      overrides[key] = getattr(args, key)
  base = C.CONFIGS[args.config]()
  decay = overrides.get("lr_decay_steps", base.lr_decay_steps) or overrides.get("steps", base.steps)
  if "warmup_steps" not in overrides and base.warmup_steps > decay:  # a smoke run shorter than the warmup
    print(f"note: warmup_steps {base.warmup_steps} -> {decay}, the run's {decay} steps", file=sys.stderr)
    overrides["warmup_steps"] = decay
  return C.get_config(args.config, **overrides), args


def main(argv: list[str] | None = None) -> int:
  try:
    S.maybe_initialize_distributed()  # ValueError if the JAX_* launch variables are incomplete
    cfg, args = parse_args(argv)
    out = train(
      cfg,
      workdir=args.workdir,
      progress=False if args.no_progress else None,
      profile_steps=parse_profile_steps(args.profile_steps),
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except NonFiniteLossError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  h = out["history"]
  if h:
    print(json.dumps({"step": h[-1]["step"], "loss": h[-1]["loss"]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
