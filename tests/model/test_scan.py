"""Layer scan (`Config.scan_layers`) and rematerialisation (`Config.remat`): same maths as the plain
model, for the forward pass, the gradients, a sharded train step and cached decoding (CPU, tiny)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from _fwd import forward
from _helpers_train import float_shapes
from _tol import assert_close, assert_trees_close, rtol
from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.inference import cached_logits, generate, layer_logit_bounds
from fpa_jax.models import REMAT_POLICIES, abstract_model, build_model, convert_layers, count_params, weight_decay_mask
from fpa_jax.data import SyntheticPipeline
from fpa_jax.train import TrainStep, create_state, lr_schedule, make_optimizer

# A live gate (random read-outs) so the gate's parameters matter; 3 layers so stacking is not trivial.
KW = dict(n_layers=3, step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05)


def _cfg(att="fpa", **kw):
  return C.get_config("tiny", attention=att, **{**KW, **kw})


def _tokens(b, t, vocab, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def _per_layer(state, n_layers: int, under: str | None = None) -> dict[str, np.ndarray]:
  """Flat {path: array} of a model's (or gradient's) state in the unscanned layout (blocks/i/...).
  under: only the leaves below that key, with their paths from there (e.g. "mu" of an optimizer's
  state: Adam's first moment, laid out as the parameters)."""
  out = {}
  for path, v in nnx.to_flat_state(state):
    if under is not None:
      if under not in path:
        continue
      path = path[path.index(under) + 1 :]
    a = np.asarray(jax.device_get(v[...]))
    if path[0] == "blocks" and not isinstance(path[1], int):  # stacked: split the leading [L] axis
      out.update({"/".join(map(str, ("blocks", i) + path[1:])): a[i] for i in range(n_layers)})
    else:
      out["/".join(map(str, path))] = a
  return out


@nnx.jit
def _loss_and_grads(model, tokens, segment_ids):
  return nnx.value_and_grad(lambda m: jnp.mean(m(tokens, segment_ids) ** 2))(model)


def test_stacked_params_layout_and_conversion_round_trip():
  cfg = _cfg(scan_layers=True)
  m = build_model(cfg, seed=0)
  wq = nnx.state(m, nnx.Param)["blocks"]["attn"]["wq"]
  assert wq.shape == (3, 32, 2, 16) and wq.get_metadata()["out_sharding"] == (S.LAYERS, S.EMBED, S.HEADS, S.HEAD_DIM)
  u = convert_layers(m, False)
  assert not u.cfg.scan_layers and len(u.blocks) == 3 and convert_layers(u, False) is u
  back = convert_layers(u, True)
  chex.assert_trees_all_equal(_per_layer(nnx.state(back), 3), _per_layer(nnx.state(m), 3))
  assert back.cfg == cfg.model  # the model keeps only the model part
  # base110m: same parameter count, every stacked parameter has the unsharded layer axis first
  big = C.get_config("base110m")
  stacked = abstract_model(C.replace(big, scan_layers=True))
  assert count_params(stacked) == count_params(abstract_model(big))
  mesh = S.make_mesh("data=4,model=2")
  for path, v in nnx.to_flat_state(nnx.state(stacked, nnx.Param)):
    spec = S.logical_to_spec(v.get_metadata()["out_sharding"], v.shape, mesh)
    assert (path[0] == "blocks") == (v.shape[0] == big.n_layers and spec[0] is None and len(spec) == v.ndim), path


@pytest.mark.parametrize(
  "att", ["fox", pytest.param("fpa", marks=pytest.mark.slow), pytest.param("softmax", marks=pytest.mark.slow)]
)  # fox: the chunked tile kernel FPA shares
def test_scanned_equals_unscanned_logits_and_grads(att):
  m = build_model(_cfg(att, scan_layers=True, qk_norm=True, output_gate=True), seed=0)
  u = convert_layers(m, False)
  tok = _tokens(2, 16, m.cfg.vocab_size)
  seg = jnp.array([[1] * 9 + [2] * 7, [1] * 16])
  (ls, gs), (lu, gu) = _loss_and_grads(m, tok, seg), _loss_and_grads(u, tok, seg)
  n = m.cfg.d_model * m.cfg.n_layers  # logits (and what comes from them): sums over d_model per layer
  assert_close(forward(m, tok, seg), forward(u, tok, seg), n=n)
  assert_close(ls, lu, n=n)
  # the absolute bias shifts field and level alike: its gradient is rounding noise on both sides
  assert_trees_close(_per_layer(gs, 3), _per_layer(gu, 3), n=n, zero_leaves=("absolute/b",))


@pytest.mark.slow
@pytest.mark.parametrize(
  "cases",
  [
    [(True, "full")],
    pytest.param([(False, "full"), (True, "dots"), (True, "dots_no_batch")], id="others"),
  ],
  ids=lambda c: "scanned-full" if c == [(True, "full")] else None,
)
def test_remat_policies_give_the_same_grads(cases):
  """Every policy, scanned and not, gives the plain model's loss and gradients; remat and scan are
  really in the traced program (a `remat` primitive; a top-level scan over the 3 layers)."""
  base = build_model(_cfg(), seed=0)
  tok, seg = _tokens(2, 16, base.cfg.vocab_size), None
  l0, g0 = _loss_and_grads(base, tok, seg)
  g0 = _per_layer(g0, 3)
  assert set(REMAT_POLICIES) | {"none"} == set(C.REMATS)  # every policy: `-m slow` runs the others
  # (scanned, none) is test_scanned_equals_unscanned_logits_and_grads
  for scan, remat in cases:
    m = nnx.clone(convert_layers(base, scan))
    m.cfg = C.replace(m.cfg, remat=remat)  # a static attribute: the policy is read at trace time
    gd = nnx.graphdef(m)
    jaxpr = jax.make_jaxpr(lambda s, gd=gd: nnx.grad(lambda mm: jnp.mean(mm(tok) ** 2))(nnx.merge(gd, s)))(
      nnx.state(m)
    ).jaxpr
    assert "remat" in str(jaxpr), (scan, remat)
    layer_scans = [e for e in jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] == 3]
    assert bool(layer_scans) == scan, (scan, remat)
    loss, g = _loss_and_grads(m, tok, seg)
    n = m.cfg.d_model * m.cfg.n_layers
    assert_close(loss, l0, n=n, err_msg=f"{scan} {remat}")
    assert_trees_close(_per_layer(g, 3), g0, n=n, zero_leaves=("absolute/b",))


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(remat="sometimes"), r"unknown remat policy 'sometimes'; use one of \('none', 'full'"),
    (dict(remat="Full"), "unknown remat policy"),
  ],
)
def test_bad_remat_config(overrides, match):
  with pytest.raises(ValueError, match=match):
    C.get_config("tiny", **overrides)
  assert C.parse_overrides(C.Tiny, ["scan_layers=true", "remat=dots"]) == {"scan_layers": True, "remat": "dots"}


@pytest.mark.slow
def test_cached_decoding_of_a_scanned_model():
  """The per-layer cache path slices the stack: full-cache decoding equals the parallel logits, the
  fpa policy's bounds equal the unscanned model's, and greedy generation is the same."""
  m = build_model(_cfg(scan_layers=True, remat="full"), seed=0)
  u = convert_layers(m, False)
  tok = _tokens(2, 13, m.cfg.vocab_size)
  logits, stats = cached_logits(m, tok)
  assert_close(logits, forward(m, tok), n=m.cfg.d_model * m.cfg.n_layers)
  assert stats["cache_fraction"] == 1.0
  for a, b in zip(layer_logit_bounds(m), layer_logit_bounds(u), strict=True):
    assert_close(a, b, n=m.cfg.d_model)  # norms of one layer's weights
  prompts = [np.asarray(_tokens(1, n, m.cfg.vocab_size, seed=n))[0] for n in (5, 9)]
  out_m, _ = generate(m, prompts, 5, policy="fpa", tolerance=1e-3)
  out_u, _ = generate(u, prompts, 5, policy="fpa", tolerance=1e-3)
  np.testing.assert_array_equal(out_m, out_u)


def _tx(cfg):
  """`train.make_optimizer` with a layout-aware decay mask (`models.weight_decay_mask`)."""
  adamw = optax.adamw(
    lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=weight_decay_mask(cfg)
  )
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)


@pytest.mark.slow  # remat grads + sharded step tests
def test_scanned_remat_train_step_on_the_8_device_mesh():
  """One step of a scanned + remat model on (data=4, model=2): sharded params (layer axis whole),
  and the unscanned model's loss, gradient norm, the gradient the optimizer got and the updated
  parameters.

  The gradient is read from Adam's first moment, (1 - b1) * the clipped gradient after one step from
  zero, and compared at the gradients' tolerance. The updated parameters are compared as far as
  Adam's normalisation allows: its first step moves an entry by lr * g / (|g| + eps_adam), whose
  slope eps_adam / (|g| + eps_adam)^2 turns a rounding difference of g into a step difference of
  up to 2 lr where g is ~0 (the absolute bias shifts field and level alike, so its gradient is
  rounding noise, which differs between the two programs, e.g. at XLA's backend optimisation level
  0), and of almost nothing where |g| >> eps_adam."""
  cfg_s = C.get_config("tiny", task="synthetic", scan_layers=True, remat="dots", warmup_steps=0, **KW)
  cfg_u = C.replace(cfg_s, scan_layers=False, remat="none")
  mesh = S.make_mesh("data=4,model=2")
  batch = S.shard_batch(
    next(SyntheticPipeline(vocab_size=cfg_s.vocab_size, seq_len=cfg_s.seq_len, batch_size=cfg_s.batch_size)), mesh
  )
  gd_s, st_s, sh_s, _ = create_state(cfg_s, mesh, _tx(cfg_s))
  wq = st_s[0]["blocks"]["attn"]["wq"].get_value()
  assert wq.shape == (3, 32, 2, 16) and wq.sharding.spec == jax.sharding.PartitionSpec(None, "data", "model", None)
  assert wq.addressable_shards[0].data.shape == (3, 8, 1, 16)
  # the unscanned run starts from the scanned run's weights
  gd_u, st_u, sh_u, _ = create_state(cfg_u, mesh, _tx(cfg_u))
  model_u, opt_u = nnx.merge(gd_u, st_u)
  nnx.update(model_u, nnx.state(convert_layers(nnx.merge(gd_s, st_s)[0], False)))
  st_u = jax.device_put(nnx.state((model_u, opt_u)), sh_u, may_alias=False)  # the steps donate their state
  out = {}
  for name, cfg, gd, st, sh in (("s", cfg_s, gd_s, st_s, sh_s), ("u", cfg_u, gd_u, st_u, sh_u)):
    step = TrainStep(cfg, gd, sh, mesh, None)
    new, metrics = step(st, batch)
    assert step.traces == 1 and int(metrics["nonfinite"]) == 0
    m = {k: float(metrics[k]) for k in ("loss", "grad_norm", "lr")}
    out[name] = (m, _per_layer(new[1], 3, under="mu"), _per_layer(new[0], 3))
  (ms, mu_s, p_s), (mu_, mu_u, p_u) = out["s"], out["u"]
  n = cfg_s.batch_size * cfg_s.seq_len  # loss, gradients (and their norm) sum over the batch's tokens
  assert_close(ms["loss"], mu_["loss"], dtype=np.float32, n=n)
  assert_close(ms["grad_norm"], mu_["grad_norm"], dtype=np.float32, n=n)
  zero = ("absolute/b",)  # gradient zero up to rounding by construction
  assert set(mu_s) == set(p_s) and any(z in k for k in mu_s for z in zero)
  assert_trees_close(mu_s, mu_u, n=n, zero_leaves=zero)
  eps_adam, lr = 1e-8, ms["lr"]  # optax.adamw's eps; the step's learning rate
  for k in p_s:
    g_s, g_u = mu_s[k] / (1 - cfg_s.b1), mu_u[k] / (1 - cfg_s.b1)
    near = np.where(np.sign(g_s) == np.sign(g_u), np.minimum(np.abs(g_s), np.abs(g_u)), 0.0)  # min |g| between
    adam = lr * np.minimum(2.0, np.abs(g_s - g_u) * eps_adam / (near + eps_adam) ** 2)
    rounding = rtol(np.float32, n) * np.max(np.abs(p_u[k]))
    np.testing.assert_array_less(np.abs(p_s[k] - p_u[k]), adam + rounding + 1e-30, err_msg=k)


def _decayed(cfg, tx) -> set[str]:
  """Per-layer names of the parameters `tx` moves when the gradient is zero (weight decay only)."""
  params = nnx.as_pure(nnx.state(build_model(cfg, seed=0), nnx.Param))
  # jitted: eager optax ops dispatch one small compile per op and leaf (over a minute on 2 cores)
  updates, _ = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p))(params)
  moved = _per_layer(updates, cfg.n_layers)
  return {k for k, v in moved.items() if np.any(v != 0)}


@pytest.mark.slow
def test_weight_decay_mask_is_layout_independent():
  cfg = _cfg(warmup_steps=0)
  decayed = _decayed(cfg, _tx(cfg))
  assert decayed == _decayed(C.replace(cfg, scan_layers=True), _tx(C.replace(cfg, scan_layers=True)))
  assert "blocks/0/attn/wq" in decayed and "blocks/0/attn_norm/scale" not in decayed


def test_make_optimizer_decays_the_same_parameters_in_both_layouts():
  cfg = _cfg(warmup_steps=0)
  scanned = C.replace(cfg, scan_layers=True)
  assert _decayed(cfg, make_optimizer(cfg)) == _decayed(scanned, make_optimizer(scanned))


@pytest.mark.slow
def test_scanned_step_keeps_activations_sharded():
  """The activation constraints inside the scanned block still apply (no whole-batch activations on
  a device) and the compiled step carries the stacked params' per-device shards."""
  from experiments.bench_train import compile_train_step

  b, t, d, v = 24, 32, 64, 4096  # as test_sharding's: 24 and 24 * 32 appear in no other dim
  cfg = C.get_config(
    "tiny",
    task="synthetic",
    batch_size=b,
    seq_len=t,
    n_layers=3,
    vocab_size=v,
    d_model=d,
    tie_embeddings=True,
    scan_layers=True,
    remat="full",
  )
  shapes = float_shapes(compile_train_step(cfg, S.make_mesh("data=8")).as_text())
  whole_batch = [s for s in shapes if (b in s or b * t in s) and np.prod(s) > b * t * d // 8]
  assert not whole_batch, f"activations not sharded over data=8 (per-device shapes): {sorted(whole_batch)}"
  assert (b // 8, t, v) in shapes and (3, d // 8, 2, d // 2) in shapes  # logits; wq [L, D/8, H, K]
