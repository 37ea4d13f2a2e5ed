"""Layer, model and config tests (CPU, seconds)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _fwd import forward as fwd
from _tol import assert_close
from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.layers import apply_rope, segment_positions
from fpa_jax.models import abstract_model, build_model, count_params


@pytest.mark.parametrize("name", sorted(C.CONFIGS))
def test_every_config_instantiates_shapes_only(name):
  cfg = C.get_config(name)
  assert type(cfg).__doc__.startswith("python -m fpa_jax.train --config " + name)
  for att in C.ATTENTIONS:
    model = abstract_model(dataclasses.replace(cfg, attention=att))
    n = count_params(model)
    assert n > 0
    if name == "base110m":
      assert abs(n - 110e6) / 110e6 < 0.03, n
    # every parameter carries logical axis names that the sharding table knows
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      axes = v.get_metadata().get("out_sharding")
      assert axes is not None and len(axes) == v.get_value().ndim, path
      S.logical_to_spec(axes)
  # the tokenizer name is one the data package accepts (configs only regex-check it)
  from fpa_jax.data.tokenizers import parse_tokenizer_name

  parse_tokenizer_name(cfg.tokenizer)


@pytest.mark.parametrize("att", C.ATTENTIONS)
def test_forward_shapes_and_segments(att):
  cfg = C.get_config("tiny", attention=att, qk_norm=True, output_gate=True)
  model = build_model(cfg, seed=0)
  tok = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
  seg = jnp.array([[1] * 8 + [2] * 8, [1] * 16])
  logits = fwd(model, tok, seg)
  assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  # segment 2 of row 0 is independent of segment 1: changing segment 1 leaves it unchanged
  tok2 = tok.at[0, :8].set((tok[0, :8] + 1) % cfg.vocab_size)
  n = cfg.d_model * cfg.n_layers  # logits: reductions over d_model in every layer
  assert_close(fwd(model, tok2, seg)[0, 8:], logits[0, 8:], n=n)
  # causality: changing the last token leaves earlier logits unchanged
  tok3 = tok.at[:, -1].set((tok[:, -1] + 1) % cfg.vocab_size)
  assert_close(fwd(model, tok3, seg)[:, :-1], logits[:, :-1], n=n)


FLAT_GATE = dict(
  step_init_std=0.0, step_bias_init=0.0, absolute_init_std=0.0, offset_init_std=0.0, offset_bias_init=0.0
)


def _copy_shared(src, dst, extra: tuple[str, ...]):
  """Copy src's parameters into dst, except those whose path names one of `extra`."""
  is_extra = lambda path, _: any(n in path for n in extra)
  nnx.update(dst, nnx.filter_state(nnx.state(src, nnx.Param), nnx.Not(is_extra)))


@pytest.mark.parametrize("att", ["stack", "fpa"])
def test_gated_variants_with_a_flat_gate_are_nope(att):
  """Zero read-outs and no step bias: field = level = 0, so stack/fpa equal NoPE with its weights."""
  cfg = C.get_config("tiny", attention=att, **FLAT_GATE)
  model = build_model(cfg, seed=1)
  nope = build_model(C.replace(cfg, attention="nope"), seed=2)
  _copy_shared(model, nope, ("gate",))
  tok = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
  assert_close(fwd(model, tok), fwd(nope, tok), n=cfg.d_model * cfg.n_layers)


@pytest.mark.parametrize("att", [pytest.param("stack", marks=pytest.mark.slow), "fpa"])
def test_default_gate_gets_gradient_at_init(att):
  """A flat field makes every penalty relu(0), whose derivative is 0: the default init must make the
  field move so that every gate read-out (but the absolute bias, a global shift) learns."""
  model = build_model(C.get_config("tiny", attention=att), seed=0)
  tok = jax.random.randint(jax.random.key(0), (2, 24), 0, model.cfg.vocab_size)
  grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(tok) ** 2)))(model)  # jitted: eager is op by op
  flat = {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(grads))}
  gate = {k: float(jnp.max(jnp.abs(v))) for k, v in flat.items() if "/gate/" in k and not k.endswith("absolute/b")}
  assert gate and all(g > 1e-7 for g in gate.values()), gate


@pytest.mark.parametrize("att", ["stack", "fpa"])
def test_gated_variants_with_forget_term_start_at_fox(att):
  """`gate_forget=True`: stack/fpa equal FoX given FoX's weights (FoX as a starting point)."""
  cfg = C.get_config("tiny", attention=att, gate_forget=True, **FLAT_GATE)
  model = build_model(cfg, seed=1)
  fox = build_model(C.replace(cfg, attention="fox"), seed=2)
  _copy_shared(model, fox, ("step", "absolute", "offset"))
  tok = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
  assert_close(fwd(model, tok), fwd(fox, tok), n=cfg.d_model * cfg.n_layers)


@pytest.mark.parametrize("att, scan", [("fpa", False), ("stack", True)])
def test_fpa_read_outs_leave_the_other_weights_of_the_seed(att, scan):
  """The FPA read-outs draw from a side stream: every other parameter equals the FoX model's of the
  same seed (with gate_forget) or the NoPE model's (without), so at FoX's init FPA is FoX itself and
  a comparison by seed measures the gate alone."""
  flat = lambda m: {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
  for forget, other in ((True, "fox"), (False, "nope")):
    cfg = C.get_config("tiny", attention=att, gate_forget=forget, scan_layers=scan, **FLAT_GATE)
    mine, theirs = flat(build_model(cfg, seed=3)), flat(build_model(C.replace(cfg, attention=other), seed=3))
    extra = [k for k in mine if k not in theirs]
    assert extra and all(any(f"/{n}/" in k for n in ("step", "absolute", "offset")) for k in extra), extra
    assert all(np.array_equal(theirs[k], mine[k]) for k in theirs), other
  cfg = C.get_config("tiny", attention=att, gate_forget=True, scan_layers=scan, **FLAT_GATE)
  tok = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
  fox = build_model(C.replace(cfg, attention="fox"), seed=3)
  assert_close(fwd(build_model(cfg, seed=3), tok), fwd(fox, tok), n=cfg.d_model * cfg.n_layers)


def test_fox_heads_hold_no_read_outs():
  """`fox_heads=1`: head 0's gate terms are FoX's alone (the read-outs' terms are 0 there whatever
  their weights, and their weights get no gradient); head 1 keeps its read-outs."""
  big = dict(step_init_std=0.3, absolute_init_std=0.3, offset_init_std=0.3)
  cfg = C.get_config("tiny", attention="fpa", gate_forget=True, fox_heads=1, **big)
  model = build_model(cfg, seed=0)
  gate = model.blocks[0].attn.gate
  x = jax.random.normal(jax.random.key(1), (2, 12, cfg.d_model))
  parts = gate.parts(x)
  np.testing.assert_array_equal(parts.increment[..., 0], jax.nn.log_sigmoid(gate.forget(x))[..., 0])
  assert not np.any(parts.absolute[..., 0]) and not np.any(parts.offset[..., 0])
  assert np.all(np.abs(parts.offset[..., 1]) > 0) and np.all(np.abs(parts.absolute[..., 1]) > 0)
  tok = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
  grads = nnx.grad(lambda m: jnp.mean(fwd(m, tok) ** 2))(model)
  flat = {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(grads))}
  read_outs = {k: g for k, g in flat.items() if any(f"/{n}/" in k for n in ("step", "absolute", "offset"))}
  assert len(read_outs) == 2 * 3 * cfg.n_layers
  for k, g in read_outs.items():  # (absolute's bias shifts field and level alike: no gradient on any head)
    assert not np.any(g[..., 0]) and (k.endswith("absolute/b") or np.any(g[..., 1])), k
  before = fwd(model, tok)
  for blk in model.blocks:  # head 0's read-out weights do not enter the model at all
    for name in ("step", "absolute", "offset"):
      r = getattr(blk.attn.gate, name)
      r.w[...] = r.w[...].at[:, 0].set(3.0)
      r.b[...] = r.b[...].at[0].set(-3.0)
  np.testing.assert_array_equal(fwd(model, tok), before)
  # a FoX model ignores the field (every head is a FoX head); at kv_heads it is refused for fpa
  assert C.get_config("tiny", attention="fox", fox_heads=1).fox_heads == 1
  with pytest.raises(ValueError, match="fox_heads=2 must be < kv_heads=2"):
    C.get_config("tiny", attention="fpa", fox_heads=2)


def test_bf16_compute_fp32_params():
  cfg = C.get_config("tiny", dtype="bfloat16", attn_impl="quadratic")
  model = build_model(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  logits = fwd(model, jnp.zeros((2, 8), jnp.int32))
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_segment_positions_and_rope():
  seg = jnp.array([[1, 1, 1, 2, 2, 3]])
  np.testing.assert_array_equal(segment_positions(seg, 1, 6), [[0, 1, 2, 0, 1, 0]])
  x = jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
  y = apply_rope(x, segment_positions(None, 1, 6), 1e4)
  assert_close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), n=8)  # head_dim 8
  assert_close(y[:, 0], x[:, 0])  # position 0 is the identity (cos 0 = 1, sin 0 = 0; up to the backend's sin/cos)


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
    (dict(attention="linear"), "unknown attention"),
    (dict(task="wiki"), "unknown task"),
    (dict(batch_size=6, grad_accum=4), "not divisible by grad_accum"),
    (dict(attn_impl="quadratic", block_size=16), "block_size only applies"),
    (dict(tokenizer="sentencepiece"), "unknown tokenizer"),
  ],
)
def test_bad_configs(overrides, match):
  with pytest.raises(ValueError, match=match):
    C.get_config("tiny", **overrides)


def test_unknown_config_and_field():
  with pytest.raises(ValueError, match="unknown config"):
    C.get_config("huge")
  with pytest.raises(ValueError, match="unknown config field"):
    C.get_config("tiny", d_modle=3)
  assert C.parse_overrides(C.Tiny, ["lr=3e-4", "qk_norm=true", "rope=none"]) == {
    "lr": 3e-4,
    "qk_norm": True,
    "rope": None,
  }


def test_mesh_parsing_and_rules():
  assert S.parse_mesh("data=4,model=2", 8) == {"data": 4, "model": 2}
  assert S.parse_mesh(None, 8) == {"data": 8, "model": 1}
  with pytest.raises(ValueError, match="product is 8"):
    S.parse_mesh("data=3,model=2", 8)
  with pytest.raises(ValueError, match="bad --mesh"):
    S.parse_mesh("dp=8", 8)
  mesh = S.make_mesh("data=4,model=2")
  assert S.logical_to_spec((S.EMBED, S.HEADS, S.HEAD_DIM), (32, 2, 16), mesh) == jax.sharding.PartitionSpec(
    "data", "model", None
  )
  # a dim the mesh axis does not divide is replicated
  assert S.logical_to_spec((S.EMBED, S.HEADS), (32, 3), mesh) == jax.sharding.PartitionSpec("data", None)
  with pytest.raises(ValueError, match="batch_size/grad_accum"):
    C.get_config("tiny", batch_size=6).validate_mesh({"data": 4, "model": 2})


@pytest.mark.parametrize("name", sorted(C.CONFIGS))
def test_config_docstring_launch_command_parses(name):
  """The launch command in each preset's docstring is a valid `fpa_jax.train` command line."""
  import shlex

  from fpa_jax.train import parse_args

  line = C.CONFIGS[name].__doc__.strip().splitlines()[0]
  argv = shlex.split(line)
  assert argv[:3] == ["python", "-m", "fpa_jax.train"], line
  cfg, _ = parse_args(argv[3:])
  assert cfg.name == name


def test_gate_without_accumulating_terms():
  """`absolute,offset` alone (no forget or step term): the field is the absolute read-out."""
  model = build_model(C.get_config("tiny", attention="fpa", gate_terms_override="absolute,offset"), seed=0)
  tok = jax.random.randint(jax.random.key(0), (2, 12), 0, model.cfg.vocab_size)
  assert fwd(model, tok).shape == (2, 12, model.cfg.vocab_size)
