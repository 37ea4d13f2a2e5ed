"""Trainer tests: sharding equivalence, exact resume in a new process, overfitting, retracing,
non-finite guard, checkpoint atomicity, config errors before compiling (CPU, 8 simulated devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.checkpoint import Checkpointer, abstract_with_shardings, own_process_state
from fpa_jax.data import SyntheticPipeline
from fpa_jax.train import NonFiniteLossError, TrainStep, create_state, main, train

from _helpers_train import FixedBatch
from _tol import assert_close, assert_trees_close

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _params(state):
  return {"/".join(map(str, k)): np.asarray(jax.device_get(v.get_value())) for k, v in nnx.to_flat_state(state[0])}


def test_sharded_step_matches_single_device():
  """One step on a (data=4, model=2) mesh == one step on one device (fp32, up to the sums' order)."""
  cfg = C.get_config("tiny", task="synthetic", grad_accum=2, n_layers=1)
  batch = next(SyntheticPipeline(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=cfg.batch_size))
  out = {}
  for name, mesh in [("8", S.make_mesh("data=4,model=2")), ("1", S.make_mesh(None, devices=jax.devices()[:1]))]:
    graphdef, state, shardings, _ = create_state(cfg, mesh)
    if name == "8":  # parameters really are sharded: wq [embed, heads, head_dim] -> (data, model, None)
      wq = state[0]["blocks"][0]["attn"]["wq"].get_value()
      assert wq.sharding.spec == jax.sharding.PartitionSpec("data", "model", None)
      assert len(wq.addressable_shards) == 8 and wq.addressable_shards[0].data.shape == (8, 1, 16)
    step = TrainStep(cfg, graphdef, shardings, mesh, None)
    new, metrics = step(state, S.shard_batch(batch, mesh))
    out[name] = (float(metrics["loss"]), _params(new))
  n = cfg.batch_size * cfg.seq_len  # loss and gradients sum over the batch's tokens
  assert_close(out["8"][0], out["1"][0], dtype=np.float32, n=n)
  assert_trees_close(out["8"][1], out["1"][1], n=n)


def _cli(workdir, steps):
  """Start `python -m fpa_jax.train` (tiny, test-only synthetic task) as a new process."""
  cmd = [
    sys.executable,
    "-m",
    "fpa_jax.train",
    "--config",
    "tiny",
    "--task",
    "synthetic",
    "--steps",
    str(steps),
    "--workdir",
    str(workdir),
    "--set",
    "lr_decay_steps=12",
    "--set",
    "ckpt_every=6",
    "--set",
    "n_layers=1",
    "--no-progress",
  ]
  # One simulated device: the resume path is the same on any mesh, and an 8-device step costs each
  # new process a sharded compile (the sharded step has its own test above).
  flags = os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=1")
  return subprocess.Popen(
    cmd, cwd=REPO, env=dict(os.environ, XLA_FLAGS=flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _wait(proc):
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  return err


def _restore(workdir, target, step):
  ck = Checkpointer(os.path.join(workdir, "checkpoints"))
  state, data_state, _ = ck.restore(step, target)
  ck.close()
  return state, data_state


@pytest.mark.slow  # in-process: train/test_checkpoint.py's resume
def test_resume_in_new_process_is_exact(tmp_path):
  """12 steps straight == 6 steps, new process, resume, 6 more: identical losses and parameters."""
  straight, split = tmp_path / "straight", tmp_path / "split"
  p_straight, p_first = _cli(straight, 12), _cli(split, 6)  # run concurrently
  _wait(p_first)
  err = _wait(_cli(split, 12))
  assert "resumed from step 6" in err
  _wait(p_straight)

  recs = {d: [json.loads(line) for line in open(d / "metrics.jsonl")] for d in (straight, split)}
  assert {"step", "loss", "tokens_per_s"} <= set(recs[split][0])
  assert [r["step"] for r in recs[split]] == list(range(1, 13))
  assert [r["loss"] for r in recs[split]] == [r["loss"] for r in recs[straight]]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(split / "tb"))

  cfg = C.get_config("tiny", task="synthetic", steps=12, lr_decay_steps=12, ckpt_every=6, n_layers=1)
  _, _, shardings, abstract = create_state(cfg, S.make_mesh(None))
  target = abstract_with_shardings(abstract, shardings)
  (sa, da), (sb, db) = _restore(str(straight), target, 12), _restore(str(split), target, 12)
  assert da == db == {"step": 12}
  chex.assert_trees_all_equal(_params(sa), _params(sb))
  assert int(sb[1]["step"].get_value()) == 12

  # Atomicity: a stray unfinalised tmp dir (a crash mid-save) is never picked up as a checkpoint.
  stray = split / "checkpoints" / "18.orbax-checkpoint-tmp-1234"
  (stray / "state").mkdir(parents=True)
  (stray / "state" / "garbage").write_text("half-written")
  ck = Checkpointer(split / "checkpoints")
  assert ck.latest_step() == 12 and 18 not in ck.all_steps()
  ck.close()


@pytest.mark.slow  # one trace per program: the inference TRACES tests
def test_no_retracing_in_process(tmp_path):
  cfg = C.get_config("tiny", task="synthetic", steps=5, ckpt_every=3, n_layers=1)
  out = train(cfg, workdir=str(tmp_path), progress=False, mesh=S.make_mesh(None, devices=jax.devices()[:1]))
  assert out["traces"] == 1 and [r["step"] for r in out["history"]] == [1, 2, 3, 4, 5]
  lines: list[str] = []  # the default progress into a pipe (pytest's stderr): a line per logged step
  train(
    C.replace(cfg, steps=7), workdir=str(tmp_path), log=lines.append, mesh=S.make_mesh(None, devices=jax.devices()[:1])
  )
  assert [ln.split()[2] for ln in lines if ln.startswith("[train] step")] == ["6/7", "7/7"]


@pytest.mark.slow
@pytest.mark.parametrize("att", C.ATTENTIONS)
def test_tiny_model_overfits_tiny_batch(att, tmp_path):
  cfg = C.get_config(
    "tiny",
    attention=att,
    task="synthetic",
    steps=60,
    lr=1e-2,
    warmup_steps=5,
    log_every=60,
    ckpt_every=1000,
    n_layers=1,
    batch_size=2,
    seq_len=16,
  )
  out = train(
    cfg,
    workdir=str(tmp_path),
    data=FixedBatch(seq_len=16, batch_size=2),
    progress=False,
    mesh=S.make_mesh(None, devices=jax.devices()[:1]),
  )
  first, last = out["history"][0]["loss"], out["history"][-1]["loss"]
  assert last < first / 8, (first, last)
  assert out["traces"] == 1


@pytest.mark.slow  # ..._step_is_skipped_...
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  cfg = C.get_config("tiny", task="synthetic", steps=6, ckpt_every=1, n_layers=1)
  with pytest.raises(NonFiniteLossError, match="non-finite loss/grad at step 3.*Last good checkpoint: step 2"):
    train(
      cfg,
      workdir=str(tmp_path),
      data=FixedBatch(nan_at=3),
      progress=False,
      mesh=S.make_mesh(None, devices=jax.devices()[:1]),
    )
  ck = Checkpointer(tmp_path / "checkpoints")
  assert ck.latest_step() == 2
  ck.close()


@pytest.mark.parametrize(
  "args, match",
  [
    (["--mesh", "data=3,model=2"], "product is 8"),
    (["--mesh", "data=8", "--set", "batch_size=4"], "not divisible by the data axis"),
    (["--set", "d_model=33"], "not divisible by n_heads"),
    (["--task", "wiki"], "unknown task"),
    (["--set", "lr=fast"], "expected float"),
  ],
)
def test_cli_bad_config_fails_before_compiling(args, match, tmp_path, capsys):
  assert main(["--config", "tiny", "--workdir", str(tmp_path), "--task", "synthetic", *args]) == 2
  assert match in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "checkpoints")


def test_distributed_env_vars(monkeypatch):
  """JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID reach jax.distributed.initialize."""
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS", "FPA_DISTRIBUTED"):
    monkeypatch.delenv(k, raising=False)
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  assert S.maybe_initialize_distributed() is False and calls == []
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  assert S.maybe_initialize_distributed() is False  # one process: nothing to do
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
  with pytest.raises(ValueError, match=r"\['JAX_PROCESS_ID'\] not"):
    S.maybe_initialize_distributed()
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID < JAX_NUM_PROCESSES"):
    S.maybe_initialize_distributed()
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert S.maybe_initialize_distributed() is True
  assert calls == [{"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 1}]
  assert jax.config.jax_cpu_collectives_implementation == "gloo"


def test_data_state_saved_per_process_and_old_checkpoints_restore(tmp_path):
  import orbax.checkpoint as ocp

  mesh = S.make_mesh(None, devices=jax.devices()[:1])
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {"w": jax.device_put(np.arange(4, dtype=np.float32), sh)}
  target = {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sh)}
  ck = Checkpointer(tmp_path / "new", async_save=False)
  ck.save(1, state, {"n": 5}, {"c": 1})
  ck.wait()
  with open(tmp_path / "new" / "1" / "data" / "metadata") as f:
    assert json.load(f) == {"per_process": {"0": {"n": 5}}}
  _, data_state, _ = ck.restore(1, target)
  ck.close()
  assert data_state == {"n": 5}
  # A checkpoint written the old way (one bare JSON state) still restores.
  mgr = ocp.CheckpointManager(tmp_path / "old", item_names=("state", "data", "config"))
  mgr.save(
    3,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"n": 7}), config=ocp.args.JsonSave({"c": 1})
    ),
  )
  mgr.wait_until_finished()
  mgr.close()
  ck = Checkpointer(tmp_path / "old")
  restored, data_state, _ = ck.restore(3, target)
  ck.close()
  assert data_state == {"n": 7}
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4))
  # Written by 2 processes, read by 1: model-only loads work, resuming the data state is refused.
  two = {"per_process": {"0": {"n": 1}, "1": {"n": 2}}}
  assert own_process_state(two, strict=False) == two
  with pytest.raises(ValueError, match="2 processes but this job has 1"):
    own_process_state(two)


@pytest.mark.slow
def test_no_host_transfer_between_log_steps(tmp_path, monkeypatch):
  """Metrics stay on device: every device->host read of a jax.Array (float(), np.asarray,
  device_get) is recorded with the step in flight; reads happen at log / checkpoint steps only.
  (The transfer guard enforces the same on accelerators; on CPU it does not fire.)"""
  import fpa_jax.train as T
  from jax._src import array as jarray

  cur, reads, fetched = [0], set(), []
  A = jarray.ArrayImpl
  value, to_array, to_float = A._value, A.__array__, A.__float__
  monkeypatch.setattr(A, "_value", property(lambda self: (reads.add(cur[0]), value.fget(self))[1]))
  monkeypatch.setattr(A, "__array__", lambda self, *a, **k: (reads.add(cur[0]), to_array(self, *a, **k))[1])
  monkeypatch.setattr(A, "__float__", lambda self: (reads.add(cur[0]), to_float(self))[1])
  real_get, real_shard, real_fetch = jax.device_get, T.S.shard_batch, T._fetch_metrics
  monkeypatch.setattr(jax, "device_get", lambda x: (reads.add(cur[0]), real_get(x))[1])
  monkeypatch.setattr(T.S, "shard_batch", lambda b, m: (cur.__setitem__(0, cur[0] + 1), real_shard(b, m))[1])
  monkeypatch.setattr(
    T, "_fetch_metrics", lambda pending: fetched.append([d for d, _ in pending]) or real_fetch(pending)
  )
  cfg = C.get_config("tiny", task="synthetic", steps=7, log_every=3, ckpt_every=100, n_layers=1)
  with jax.transfer_guard_device_to_host("disallow_explicit"):
    out = train(cfg, workdir=str(tmp_path), progress=False, mesh=S.make_mesh(None, devices=jax.devices()[:1]))
  assert fetched == [[1], [2, 3], [4, 5, 6], [7]]
  assert reads - {0} <= {1, 3, 6, 7}, sorted(reads)  # 0: before the first step (init, restore)
  assert {1, 3, 6, 7} <= reads  # the counters do see the log-step reads
  assert [r["step"] for r in out["history"]] == [1, 3, 6, 7] and out["traces"] == 1


def test_nonfinite_step_is_skipped_and_stops_within_log_every(tmp_path):
  """First bad step 5: no checkpoint after it (last good: 3), stopped at the next sync (step 6)."""
  cfg = C.get_config("tiny", task="synthetic", steps=20, log_every=4, ckpt_every=3, n_layers=1)
  data = FixedBatch(nan_at=5)
  with pytest.raises(NonFiniteLossError, match="non-finite loss/grad at step 5.*Last good checkpoint: step 3"):
    train(cfg, workdir=str(tmp_path), data=data, progress=False, mesh=S.make_mesh(None, devices=jax.devices()[:1]))
  assert data.n == 6
  ck = Checkpointer(tmp_path / "checkpoints")
  assert ck.latest_step() == 3
  ck.close()


@pytest.mark.slow
def test_cli_profile_steps_writes_trace(tmp_path):
  assert (
    main(
      [
        "--config",
        "tiny",
        "--task",
        "synthetic",
        "--steps",
        "3",
        "--workdir",
        str(tmp_path),
        "--set",
        "n_layers=1",
        "--no-progress",
        "--profile-steps",
        "2:3",
      ]
    )
    == 0
  )
  files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "profile") for f in fs]
  assert files and any(os.path.getsize(f) > 0 for f in files), files
  assert main(["--config", "tiny", "--workdir", str(tmp_path / "x"), "--profile-steps", "3:2"]) == 2


def test_cooldown_schedule_decays_linearly_to_zero():
  """WSD: constant lr, then the last `cooldown_steps` updates decay linearly to 0; bad values refused."""
  from fpa_jax.train import lr_schedule

  cfg = C.get_config(
    "tiny", steps=100, lr=1.0, min_lr_ratio=1.0, warmup_steps=10, lr_decay_steps=1000, cooldown_steps=20
  )
  lr = [float(lr_schedule(cfg)(t)) for t in range(101)]
  np.testing.assert_allclose(lr[10:81], 1.0)
  assert_close(lr[80:101], np.linspace(1.0, 0.0, 21), dtype=np.float32)
  plain = C.get_config("tiny", steps=100, lr=1.0, min_lr_ratio=1.0, warmup_steps=10, lr_decay_steps=1000)
  assert [float(lr_schedule(plain)(t)) for t in range(80)] == lr[:80]
  with pytest.raises(ValueError, match="cooldown_steps"):
    C.get_config("tiny", steps=10, cooldown_steps=10)


@pytest.mark.slow  # make_heldout: data/test_pipeline.py
def test_periodic_eval_scores_the_fixed_heldout_set(tmp_path):
  """Text: the periodic eval scores the held-out windows over every validation document
  (`heldout_batches`), the same set at every eval, padded to whole per-process batches."""
  cfg = C.get_config(
    "tiny", task="text", small_data=True, data_dir=str(tmp_path / "data"), seq_len=32, batch_size=4,
    steps=2, eval_every=1, heldout_windows=6, n_layers=1, vocab_size=259,
  )  # fmt: skip
  from fpa_jax.train import heldout_batches

  held = heldout_batches(cfg)
  assert [len(b["inputs"]) for b in held] == [4, 4] and held[1]["loss_mask"][2:].sum() == 0
  again = heldout_batches(cfg)
  assert all((a["inputs"] == b["inputs"]).all() for a, b in zip(held, again))
  out = train(cfg, workdir=str(tmp_path / "run"), progress=False, mesh=S.make_mesh(None, devices=jax.devices()[:1]))
  evals = [r for r in out["history"] if "eval_loss" in r]
  assert len(evals) == 2 and all(np.isfinite(r["eval_loss"]) for r in evals)
  # the gate statistics of a gated model come with each eval (`losses.gate_stats`)
  assert all(0.0 <= r["gate_active_l0"] <= 1.0 and r["gate_field_range_l0"] >= 0.0 for r in evals)


def test_gate_lr_scale_scales_only_the_gate_readouts():
  """`gate_lr_scale` multiplies the AdamW update of the step / absolute / offset read-outs (the lm_ablations
  study's effective-lr rows) and leaves every other leaf's update (FoX's forget term included) as it was."""
  from flax import nnx

  from fpa_jax.models import build_model
  from fpa_jax.train import gate_readout_mask, make_optimizer

  kw = dict(attention="fpa", gate_forget=True, n_layers=1, warmup_steps=0)
  params = nnx.state(build_model(C.get_config("tiny", **kw)), nnx.Param)
  grads = jax.tree_util.tree_map(lambda p: jax.numpy.ones_like(p) * 0.3, params)
  upd = {}
  for s in (1.0, 0.1):
    tx = make_optimizer(C.get_config("tiny", gate_lr_scale=s, **kw))
    upd[s], _ = tx.update(grads, tx.init(params), params)
  mask = gate_readout_mask(params)
  flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
  n_gate = 0
  for (path, a), (_, b), (_, m) in zip(flat(upd[1.0]), flat(upd[0.1]), flat(mask)):
    name = jax.tree_util.keystr(path)
    if m:
      n_gate += 1
      np.testing.assert_allclose(np.asarray(b), 0.1 * np.asarray(a), rtol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
  assert n_gate == 6  # (w, b) of step, absolute, offset; forget's read-out is not scaled
  with pytest.raises(ValueError, match="gate_lr_scale"):
    C.get_config("tiny", gate_lr_scale=0.0).validate()
  # gate_lr_warmup_steps: the read-outs' multiplier ramps 0 -> gate_lr_scale over 4 steps (0 at the
  # first update); the scale acts after AdamW, so each update is the constant-scale one times the ramp
  ramped = make_optimizer(C.get_config("tiny", gate_lr_scale=0.5, gate_lr_warmup_steps=4, **kw))
  const = make_optimizer(C.get_config("tiny", gate_lr_scale=0.5, **kw))
  sr, sc = ramped.init(params), const.init(params)
  for step in range(6):
    ur, sr = ramped.update(grads, sr, params)
    uc, sc = const.update(grads, sc, params)
    for (path, a), (_, b), (_, m) in zip(flat(uc), flat(ur), flat(mask)):
      f = min(step, 4) / 4 if m else 1.0
      np.testing.assert_allclose(np.asarray(b), f * np.asarray(a), rtol=1e-6, err_msg=jax.tree_util.keystr(path))
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="gate_lr_warmup_steps"):
      C.get_config("tiny", gate_lr_warmup_steps=bad).validate()


def test_gate_clip_apart_keeps_the_other_weights_updates_foxs():
  """gate_clip_apart clips the read-outs' gradient and the other weights' each by its own global norm
  (checked against numpy), so at FoX's init (zero read-outs, the other weights FoX's) every other
  weight's optimizer update is FoX's own. With one global norm the read-outs' gradient (nonzero at
  zero read-outs) shrinks those updates: FPA with frozen read-outs would train another trajectory."""
  import optax
  from flax import nnx

  from fpa_jax.models import build_model
  from fpa_jax.train import clip_by_global_norm_apart, gate_readout_mask, make_optimizer

  flat_gate = dict(step_init_std=0.0, absolute_init_std=0.0, offset_init_std=0.0, gate_bias_init=5.0)
  kw = dict(n_layers=1, warmup_steps=0, clip_norm=0.1, gate_lr_warmup_steps=4, **flat_gate)
  tok = jax.random.randint(jax.random.key(1), (2, 33), 0, 64)

  def grads(cfg):
    model = build_model(cfg, seed=2)
    loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(tok[:, :-1]), tok[:, 1:]).mean()
    return nnx.state(model, nnx.Param), nnx.grad(loss)(model)

  flat = lambda t: {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
  fpa_cfg = C.get_config("tiny", attention="fpa", gate_forget=True, gate_clip_apart=True, **kw)
  params, g = grads(fpa_cfg)
  fox_params, fox_g = grads(C.replace(fpa_cfg, attention="fox", gate_clip_apart=False))
  mask, gf = flat(gate_readout_mask(params)), flat(g)
  assert sum(mask.values()) == 6 and all(np.any(gf[k] != 0) for k in mask if mask[k])  # a live read-out gradient
  # the clip alone, against numpy: each group scaled by min(1, c / its norm)
  clipped, _ = clip_by_global_norm_apart(0.1, gate_readout_mask).update(g, optax.EmptyState())
  for group in (True, False):
    norm = np.sqrt(sum(np.sum(gf[k].astype(np.float64) ** 2) for k in gf if mask[k] == group))
    assert norm > 0.1  # both groups are clipped here
    for k in (k for k in gf if mask[k] == group):
      np.testing.assert_allclose(flat(clipped)[k], gf[k] * (0.1 / norm), rtol=1e-5, atol=1e-9, err_msg=k)
  same, _ = clip_by_global_norm_apart(1e3, gate_readout_mask).update(g, optax.EmptyState())
  assert all(np.array_equal(flat(same)[k], gf[k]) for k in gf)  # under the norm: untouched
  # whole optimizer steps: apart, the shared weights' updates are FoX's; with one norm they are not
  fox_tx = make_optimizer(C.replace(fpa_cfg, attention="fox", gate_clip_apart=False))
  fox_u = flat(fox_tx.update(fox_g, fox_tx.init(fox_params), fox_params)[0])
  for apart in (True, False):
    tx = make_optimizer(C.replace(fpa_cfg, gate_clip_apart=apart))
    state = tx.init(params)
    # stateless like clip_by_global_norm: either optimizer restores the other's state
    assert jax.tree.structure(state) == jax.tree.structure(
      make_optimizer(C.replace(fpa_cfg, gate_clip_apart=not apart)).init(params)
    )
    u = flat(tx.update(g, state, params)[0])
    shared = [k for k in fox_u]
    assert set(shared) < set(u)
    gaps = [np.max(np.abs(u[k] - fox_u[k])) / (np.max(np.abs(fox_u[k])) + 1e-30) for k in shared]
    if apart:
      assert max(gaps) < 1e-4, max(gaps)
    else:
      assert max(gaps) > 1e-2, max(gaps)
  with pytest.raises(ValueError, match="gate_clip_apart"):
    C.get_config("tiny", gate_clip_apart="yes").validate()
