"""The layer in a model of one's own (README "FPA in your own model"), dead-tile skipping and matmul
precision reached from configs (CPU, seconds)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _tol import assert_bitwise, assert_close
from flax import nnx

import fpa_jax
from fpa_jax import configs as C
from fpa_jax import ops
from fpa_jax.layers import FirstPassageAttention
from fpa_jax.models import build_model
from fpa_jax.ops import bias, chunked

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- tests/model/test_dropin.py executes the next python block -->"
MARKER_RECIPE = "<!-- tests/model/test_dropin.py executes the next python block after the one above -->"


def _block(marker: str) -> str:
  text = README.read_text()
  assert marker in text, f"README lost the marker {marker}"
  return re.search(r"```python\n(.*?)```", text.split(marker, 1)[1], re.S).group(1)


@nnx.jit
def _layer_out(layer, x, segment_ids=None):
  """A layer's output: one program per layer structure and shape, shared by this file's tests."""
  return layer(x, segment_ids)


@pytest.fixture(scope="module")
def readme_run():
  """The README's block, executed as written: its namespace (model, optimizer, losses, ...)."""
  ns: dict = {}
  exec(compile(_block(MARKER), str(README), "exec"), ns)
  return ns


@pytest.fixture(scope="module")
def readme_recipe_run(readme_run):
  """The README's second block (the LM recipe in the loop, then decoding and evaluation), run after
  the first in a copy of its namespace."""
  ns = dict(readme_run)
  exec(compile(_block(MARKER_RECIPE), str(README), "exec"), ns)
  return ns


def test_readme_model_trains_and_gate_gets_gradient(readme_run):
  ns = readme_run
  losses = ns["losses"]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  model = ns["model"]
  assert isinstance(model.attn, FirstPassageAttention) and fpa_jax.FirstPassageAttention is FirstPassageAttention
  # gradient reaches every read-out of the gate (weights and biases), and the steps moved them
  _, grads = ns["train_step"](model, ns["optimizer"], ns["tokens"])
  gate_grads = nnx.to_flat_state(grads["attn"]["gate"])
  names = {path[0] for path, _ in gate_grads}
  assert names == {"step", "absolute", "offset"}, names
  for path, g in gate_grads:
    assert float(jnp.abs(g.get_value()).max()) > 0, path
  fresh = type(model)(vocab=64, d=32, rngs=nnx.Rngs(0))
  assert not np.array_equal(model.attn.gate.offset.w[...], fresh.attn.gate.offset.w[...])


def test_readme_recipe_trains_then_decodes_with_the_learned_rule(readme_recipe_run):
  """The second block: the layer has the LM gate, the optimizer the recipe's parts (the read-outs
  moved off their zero init once the ramp let them), both phases' losses are finite, and the model
  decoded under `fpa_global` and was evaluated through its cache."""
  ns = readme_recipe_run
  attn = ns["model"].attn
  lm = C.gate_recipe("lm", "model")
  assert {k: getattr(attn.cfg, k) for k in lm} == lm
  assert all(np.isfinite(ns["recipe_losses"])) and all(np.isfinite(ns["retrofit_losses"]))
  assert float(jnp.abs(attn.gate.offset.w[...]).max()) > 0  # zero at init (FoX), moved by the recipe's ramp
  new, stats = ns["new"], ns["stats"]
  assert new.shape == (2, 8) and stats["policy"] == "fpa_global"
  assert stats["cache_fraction"] <= 0.25
  res = ns["res"]
  assert res["cache"]["policy"] == "fpa_global" and res["cache"]["budget"] == 0.25
  assert res["tokens"] == 2 * 32 and np.isfinite(res["nll_mean"])


@pytest.mark.parametrize(
  "policy, kw",
  [
    ("full", {}),
    pytest.param("window", dict(budget=4), marks=pytest.mark.slow),
    pytest.param("sink_window", dict(budget=6), marks=pytest.mark.slow),
    ("h2o", dict(budget=4)),
    ("snapkv", dict(budget=4)),
    ("fpa_budget", dict(compression_ratio=0.75)),
    ("fpa_global", dict(budget=4)),
    ("fpa", dict(tolerance=1e-3)),
    pytest.param("fpa_threshold", dict(threshold=2.0), marks=pytest.mark.slow),
  ],
)
def test_readme_model_decodes_under_every_policy(readme_run, policy, kw):
  """The README's MyLM under every policy: generation (snapkv needs the parallel prefill, h2o the
  token-by-token one) and teacher-forced evaluation through the cache (snapkv: generation only)."""
  from fpa_jax import eval as ev
  from fpa_jax.inference import generate

  model, tokens = readme_run["model"], np.asarray(readme_run["tokens"])
  new, stats = generate(model, tokens[:, :12], 4, policy=policy, **kw)
  assert new.shape == (2, 4) and stats["policy"] == policy and not stats["overflow"]
  if policy != "snapkv":
    res = ev.loss_by_position(model, tokens[:, :17], bucket=4, policy=policy, show_progress=False, **kw)
    assert np.isfinite(res["nll_mean"]) and res["cache"]["policy"] == policy


@pytest.mark.parametrize(
  "kw",
  [
    dict(attention="fpa"),
    dict(attention="fpa", gate_forget=True, fox_heads=1),
    dict(attention="fox", n_kv_heads=1, qk_norm=True),
    dict(attention="softmax", output_gate=True, step_scale=5.0),
  ],
  ids=lambda kw: kw["attention"] + ("_fox_heads" if "fox_heads" in kw else ""),
)
def test_from_args_equals_model_config(kw):
  """Same fields, same seed: the same parameters and (the same program) the same outputs, bit for bit."""
  kw = dict(kw)
  gate = kw.pop("attention")
  n_layers = 3
  cfg = C.ModelConfig(d_model=32, n_heads=2, n_layers=n_layers, attention=gate, attn_impl="chunked", **kw).validate()
  a = FirstPassageAttention(cfg, rngs=nnx.Rngs(params=7))
  b = FirstPassageAttention.from_args(
    d_model=32, n_heads=2, gate=gate, attn_impl="chunked", out_init_std=0.02 / (2 * n_layers) ** 0.5,
    rngs=nnx.Rngs(params=7), **kw,
  )  # fmt: skip
  sa, sb = nnx.to_flat_state(nnx.state(a, nnx.Param)), nnx.to_flat_state(nnx.state(b, nnx.Param))
  assert [p for p, _ in sa] == [p for p, _ in sb]
  for (path, va), (_, vb) in zip(sa, sb):
    assert_bitwise(va.get_value(), vb.get_value(), err_msg=str(path))
  x = jax.random.normal(jax.random.key(0), (2, 24, 32))
  seg = jnp.array([[0] * 10 + [1] * 14, [0] * 24])
  assert_bitwise(_layer_out(b, x, seg), _layer_out(a, x, seg))
  # out_init_std defaults to init_std: a layer needs no depth
  c = FirstPassageAttention.from_args(d_model=32, n_heads=2, gate=gate, rngs=nnx.Rngs(params=7), **kw)
  assert_bitwise(c.wq[...], a.wq[...])
  assert not np.array_equal(c.wo[...], a.wo[...])


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(gate="FPA"), "unknown gate"),
    (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
    (dict(n_kv_heads=3), "must divide n_heads"),
    (dict(n_kv_heads=-1), "n_kv_heads=-1: use an int >= 0"),
    (dict(n_kv_heads=1, fox_heads=1), "fox_heads=1 must be < kv_heads=1"),
    (dict(d_model=32.0), "d_model=32.0: use an int"),
    (dict(dtype="float16"), "unknown dtype 'float16'"),
    (dict(step_scal=1.0), "unknown argument"),
    (dict(vocab_size=10), "unknown argument"),
    (dict(attn_impl="flash"), "unknown attn_impl"),
    (dict(skip_tolerance=1e-3, attn_impl="quadratic"), "skip_tolerance only applies"),
    (dict(skip_tolerance=1.5), "skip_tolerance="),
    (dict(precision="fp32"), "unknown precision"),
    (dict(block_size=-1), "block_size=-1: use an int >= 0"),
    (dict(out_init_std=-1.0), "out_init_std=-1.0"),
  ],
)
def test_from_args_errors(kw, match):
  args = dict(d_model=32, n_heads=4) | kw
  with pytest.raises(ValueError, match=match):
    FirstPassageAttention.from_args(**args, rngs=nnx.Rngs(0))


def test_from_args_dtypes():
  layer = FirstPassageAttention.from_args(d_model=16, n_heads=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert layer.cfg.dtype == "bfloat16" and layer.wq[...].dtype == jnp.float32
  assert jax.eval_shape(layer, jnp.ones((1, 8, 16), jnp.bfloat16)).dtype == jnp.bfloat16


# ---- skip_tolerance from a config -------------------------------------------------------------------


def test_skip_tolerance_config_fields():
  over = C.parse_overrides(C.Tiny, ["skip_tolerance=1e-3", "attn_impl=chunked", "precision=highest"])
  assert over == {"skip_tolerance": 1e-3, "attn_impl": "chunked", "precision": "highest"}
  assert C.parse_overrides(C.Tiny, ["skip_tolerance=none"]) == {"skip_tolerance": None}
  cfg = C.get_config("tiny", **over)
  assert cfg.model.skip_tolerance == 1e-3 and cfg.model.precision == "highest"
  for bad, match in [(0.0, "skip_tolerance="), (1.0, "skip_tolerance="), (True, "skip_tolerance=")]:
    with pytest.raises(ValueError, match=match):
      C.get_config("tiny", skip_tolerance=bad)
  for impl in ("quadratic", "recurrent"):
    with pytest.raises(ValueError, match="skip_tolerance only applies to the tiled kernels"):
      C.get_config("tiny", skip_tolerance=1e-3, attn_impl=impl)
  # pallas skips tiles (the block-sparse kernels), not keys
  assert C.get_config("tiny", skip_tolerance=1e-3, attn_impl="pallas").model.skip_tolerance == 1e-3
  with pytest.raises(ValueError, match="attn_impl='chunked'"):
    C.get_config("tiny", skip_tolerance=1e-3, attn_impl="pallas", skip="keys")
  with pytest.raises(ValueError, match="unknown precision"):
    C.get_config("tiny", precision="bf16")
  # neither changes the parameters: a run may resume with another value
  assert "skip_tolerance" not in C.resume_fields() and "precision" not in C.resume_fields()


SKIP_EPS = 0.5  # large, so that the dropped weights (<= eps / T each) are visible in fp32


def _skip_layer(gate, skip_tolerance, **kw):
  cfg = C.ModelConfig(
    d_model=32, n_heads=2, attention=gate, attn_impl="chunked", block_size=4, skip_tolerance=skip_tolerance, **kw
  )
  return FirstPassageAttention(cfg.validate(), rngs=nnx.Rngs(params=3))


# A downward fpa walk, step bias -0.07: 0.7 nats per token, like FoX's init (FoX: test_model_skip_tolerance_loss)
FPA_DOWN = dict(step_bias_init=-0.07)


@pytest.mark.slow  # the op's bound: ops/test_skip.py
def test_layer_skip_tolerance_within_the_ops_bound():
  """skip_tolerance reaches the op: tiles are dropped, and the layer output moves by no more than the
  op's bound (each output component <= 2 eps max|v|) carried through W_o."""
  exact, skip = _skip_layer("fpa", None, **FPA_DOWN), _skip_layer("fpa", SKIP_EPS, **FPA_DOWN)
  t = 64
  x = jax.random.normal(jax.random.key(1), (2, t, 32))
  y0, y1 = _layer_out(exact, x), _layer_out(skip, x)
  # the tiles the op drops for these q, k and gates
  q, k, v = exact.project(x, jnp.broadcast_to(jnp.arange(t), (2, t)))
  per_head, _ = chunked.skipped_tile_fraction(q, k, bias.FPABias(*exact.gate(x)), skip_tolerance=SKIP_EPS, block_size=4)
  assert per_head > 0.3, per_head
  assert not np.array_equal(y0, y1)
  # |dy_d| <= sum_{h,k} |do_hk| |W_o[h,k,d]| <= 2 eps max|v| sum_{h,k} |W_o[h,k,d]|
  bound = 2 * SKIP_EPS * float(jnp.abs(v).max()) * np.abs(np.asarray(exact.wo[...])).sum((0, 1))
  err = np.abs(np.asarray(y1) - np.asarray(y0)).max((0, 1))
  assert np.all(err <= bound), (err, bound)


def test_layer_without_skip_tolerance_is_the_exact_op():
  """skip_tolerance=None runs today's program: the exact op, bit for bit."""
  layer = _skip_layer("fpa", None, **FPA_DOWN)
  x = jax.random.normal(jax.random.key(2), (2, 40, 32))

  def by_hand(m, x):
    q, k, v = m.project(x, jnp.broadcast_to(jnp.arange(40), (2, 40)))
    return m.output(ops.fpa_attention(q, k, v, *m.gate(x), impl="chunked", block_size=4), x)

  assert_bitwise(_layer_out(layer, x), nnx.jit(by_hand)(layer, x))


def test_model_skip_tolerance_loss():
  """skip_tolerance from a run config reaches DecoderLM's layers: the loss stays within eps of exact."""
  base = C.get_config("tiny", attention="fox", attn_impl="chunked", block_size=8, n_layers=1)
  tok = jax.random.randint(jax.random.key(0), (2, 64), 0, base.vocab_size)

  def loss(model, tok):
    logits = model(tok[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))

  run = nnx.jit(loss)
  l0, l1 = (run(build_model(C.replace(base, skip_tolerance=e), seed=0), tok) for e in (None, 1e-3))
  assert np.isfinite(float(l1))
  # every dropped weight is <= eps / T: the loss moves by far less than eps
  assert abs(float(l1) - float(l0)) <= 1e-3 * abs(float(l0))


# ---- matmul precision ---------------------------------------------------------------------------------


def _dot_precisions(jaxpr) -> list:
  """The precision of every dot_general in a closed jaxpr, sub-jaxprs (scan, custom_vjp, pjit) included."""
  out = []

  def walk(jpr):
    for eqn in jpr.eqns:
      if eqn.primitive.name == "dot_general":
        out.append(eqn.params["precision"])
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return out


def test_model_precision_reaches_every_matmul_forward_and_backward():
  """Traced only (no compile): every dot_general of the loss's gradient carries the precision."""
  cfg = C.get_config("tiny", attention="fpa", attn_impl="chunked", output_gate=True, n_layers=1)
  tok = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
  for prec in ("default", "highest"):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(C.replace(cfg, precision=prec), seed=0)))
    f = jax.grad(lambda s, tok: jnp.mean(nnx.merge(graphdef, s)(tok) ** 2))
    precs = _dot_precisions(jax.make_jaxpr(f)(state, tok))
    assert len(precs) > 20
    if prec == "default":  # the program without any precision: the one before this option existed
      assert all(p is None for p in precs), set(precs)
    else:  # the chunked kernel's hand-written (custom_vjp) backward included
      assert all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in precs), set(precs)


def test_precision_values_on_cpu():
  """CPU computes fp32 matmuls in full precision under every setting: "highest" changes no value."""
  x = jax.random.normal(jax.random.key(0), (1, 16, 16))
  make = lambda p: FirstPassageAttention.from_args(d_model=16, n_heads=2, precision=p, rngs=nnx.Rngs(0))
  assert_close(_layer_out(make("highest"), x), _layer_out(make("default"), x), n=16 * 16)


def test_quadratic_reference_runs_at_highest():
  q = jnp.ones((1, 8, 2, 4))
  g = jnp.zeros((1, 8, 2))
  f = lambda q: ops.fpa_attention(q, q, q, g, g, impl="quadratic").sum()
  precs = _dot_precisions(jax.make_jaxpr(jax.grad(f))(q))
  assert precs and all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in precs), precs


def test_precision_field_is_a_model_field():
  assert "precision" in C.ModelConfig.field_names() and "skip_tolerance" in C.ModelConfig.field_names()
  layer = nnx.eval_shape(
    lambda: FirstPassageAttention.from_args(d_model=16, n_heads=2, precision="high", rngs=nnx.Rngs(0))
  )
  assert layer.cfg.precision == "high" == layer.precision
  assert dataclasses.replace(layer.cfg, precision="default").validate()
