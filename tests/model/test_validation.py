"""Bad input raises before tracing, naming what to change; under jit a documented defined result.

Configs: every numeric field of every part is checked (an audit over the dataclass fields, so a new
field without a check fails here), on every path that makes a config or a model: the parts'
`validate`, `get_config`, the CLI's `--set`, `FirstPassageAttention(cfg)` and `DecoderLM(cfg)`.
Tokens: `fpa_jax.models.check_tokens` (the model's and decoding's one check) and `embed_tokens` (a
zero embedding for an out-of-range id under jit). CPU, seconds.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fpa_jax import configs as C
from fpa_jax.inference import cached_logits
from fpa_jax.layers import FirstPassageAttention
from fpa_jax.models import DecoderLM, build_model, check_tokens
from fpa_jax.train import parse_args

from _tol import assert_bitwise, assert_close

PARTS = (C.ModelConfig, C.DataConfig, C.TrainConfig)

# (field, bad value): out-of-range hyperparameters first, then one per constrained numeric field.
BAD = [
  ("lr", -1.0),
  ("b2", 1.5),
  ("min_lr_ratio", 5.0),
  ("warmup_steps", 10_000),  # > steps (and lr_decay_steps unset): the warmup would be cut short
  ("norm_eps", 0.0),
  ("lr", 0.0),
  ("lr", float("nan")),
  ("b1", 1.0),
  ("b2", -0.1),
  ("min_lr_ratio", -0.1),
  ("weight_decay", -0.1),
  ("clip_norm", -1.0),
  ("seed", -1),
  ("cooldown_steps", -1),
  ("rope_theta", 0.0),
  ("init_std", 0.0),
  ("gate_init_std", -0.1),
  ("step_init_std", -1e-3),
  ("absolute_init_std", float("inf")),
  ("offset_init_std", -1.0),
  ("step_scale", 0.0),
  ("absolute_scale", -10.0),
  ("offset_scale", 0.0),
  ("gate_bias_init", float("nan")),
  ("step_bias_init", float("-inf")),
  ("offset_bias_init", float("inf")),
  ("steps", "100"),  # not an int (get_config takes Python values as they are)
  ("qk_norm", "false"),  # a non-empty string would be truthy
  ("rope", 1),
  ("fox_heads", -1),
  ("fox_heads", True),
]


def _part_of(field: str):
  return next(p for p in PARTS if field in p.field_names())


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_naming_field_and_value(field, value):
  with pytest.raises(ValueError, match=field) as e:
    _part_of(field)(**{field: value}).validate()
  assert repr(value) in str(e.value) or str(value) in str(e.value), str(e.value)
  with pytest.raises(ValueError, match=field):  # the run config runs its parts' checks
    C.get_config("tiny", **{field: value})


def test_warmup_longer_than_the_schedule_says_what_to_change():
  with pytest.raises(ValueError, match=r"warmup_steps=30 is longer than the lr schedule \(steps=20\).*<= 20"):
    C.get_config("tiny", warmup_steps=30)
  with pytest.raises(ValueError, match=r"lr_decay_steps=5"):
    C.get_config("tiny", warmup_steps=6, lr_decay_steps=5)
  # A fixed horizon longer than this run's steps is how a run is extended: its warmup may outlast steps.
  assert C.get_config("tiny", steps=10, warmup_steps=50, lr_decay_steps=1000).warmup_steps == 50
  assert C.get_config("tiny", steps=4, warmup_steps=4).warmup_steps == 4  # the whole run warming up


def _hint_kind(tp) -> str | None:
  args = set(typing.get_args(tp)) - {type(None)}
  base = next(iter(args)) if args else tp
  return {bool: "bool", int: "int", float: "float"}.get(base)


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.__name__)
def test_every_numeric_field_is_checked(part):
  """A value of the wrong kind in any bool / int / float field of a part (NaN for a float, a string
  for an int or bool) raises ValueError naming that field: every numeric field has a check."""
  hints = typing.get_type_hints(part)
  checked = 0
  for f in part.field_names():
    kind = _hint_kind(hints[f])
    if kind is None:
      continue  # strings: their own checks (names, tokenizer, mesh) in test_configs / test_train
    for bad in (float("nan"), "1") if kind == "float" else ("1",):
      with pytest.raises(ValueError, match=f):
        dataclasses.replace(part(), **{f: bad}).validate()
    checked += 1
  assert checked >= {"ModelConfig": 20, "DataConfig": 3, "TrainConfig": 15}[part.__name__]


@pytest.mark.parametrize("name", sorted(C.CONFIGS))
def test_presets_are_valid(name):
  cfg = C.get_config(name)
  assert cfg.validate() is cfg and math.isfinite(cfg.lr)


def test_cli_set_validates():
  with pytest.raises(ValueError, match="b2=1.5"):
    parse_args(["--config", "tiny", "--workdir", "/tmp/unused", "--set", "b2=1.5"])
  with pytest.raises(ValueError, match="norm_eps=0.0"):
    parse_args(["--config", "small", "--workdir", "/tmp/unused", "--set", "norm_eps=0"])


def test_one_check_per_field_names_the_argument():
  """The config, the layer's plain-argument constructor and the ops run the same check of a setting;
  each error names what its caller wrote: the field, the Python argument (`gate` for `attention`) or
  the op's argument, never the CLI's `--set`."""
  mk = lambda **kw: FirstPassageAttention.from_args(**{"d_model": 32, "n_heads": 4, **kw}, rngs=nnx.Rngs(0))
  cases = [  # (from_args kwargs, the ModelConfig fields, what both errors say)
    (dict(d_model=30), dict(d_model=30, n_heads=4), r"d_model=30 is not divisible by n_heads=4; .*\(e\.g\. n_heads="),
    (dict(n_heads=3), dict(d_model=32, n_heads=3), r"d_model=32 is not divisible by n_heads=3"),
    (dict(block_size=-1), dict(block_size=-1), r"block_size=-1: use an int >= 0"),
    (dict(rope_theta=0.0), dict(rope_theta=0.0), r"rope_theta=0.0: use a finite number in \(0, inf\)"),
    (dict(attn_impl="flash"), dict(attn_impl="flash"), r"unknown attn_impl 'flash'"),
    (dict(skip="rows"), dict(skip="rows"), r"skip='rows': the skip must be one of"),
    (dict(attn_impl="quadratic", block_size=8), dict(attn_impl="quadratic", block_size=8), "block_size only applies"),
  ]
  for kw, fields, match in cases:
    with pytest.raises(ValueError, match=match) as from_args:
      mk(**kw)
    with pytest.raises(ValueError, match=match) as config:
      C.ModelConfig(**{"d_model": 32, "n_heads": 4, **fields}).validate()
    for e in (from_args, config):
      assert "--set" not in str(e.value) and "from_args:" not in str(e.value), str(e.value)
  # the argument's own name where it differs from the field's
  with pytest.raises(ValueError, match=r"unknown gate 'FPA'"):
    mk(gate="FPA")
  with pytest.raises(ValueError, match=r"or gate='fox' for every head"):
    mk(n_kv_heads=1, fox_heads=1)
  # the op's check is the same function, naming the op's argument
  from fpa_jax import ops

  q = jnp.zeros((1, 4, 1, 8))
  f = jnp.zeros((1, 4, 1))
  with pytest.raises(ValueError, match=r"unknown impl 'flash': the impl must be one of"):
    ops.fpa_attention(q, q, q, f, f, impl="flash")
  with pytest.raises(ValueError, match=r"unknown attn_impl 'flash': the attn_impl must be one of"):
    C.ModelConfig(attn_impl="flash").validate()
  with pytest.raises(ValueError, match=r"skip_tolerance only applies to the tiled kernels \(impl="):
    ops.fpa_attention(q, q, q, f, f, impl="quadratic", skip_tolerance=1e-3)
  with pytest.raises(ValueError, match=r"skip_tolerance only applies to the tiled kernels \(attn_impl="):
    C.ModelConfig(attn_impl="quadratic", skip_tolerance=1e-3).validate()


def test_layer_and_model_constructors_validate():
  """`ModelConfig(attention="FPA")` used to build a gateless NoPE layer silently."""
  with pytest.raises(ValueError, match="unknown attention 'FPA'"):
    FirstPassageAttention(C.ModelConfig(attention="FPA"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm_eps"):
    FirstPassageAttention(C.ModelConfig(norm_eps=0.0), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="step_scale"):
    DecoderLM(C.ModelConfig(step_scale=-1.0), rngs=nnx.Rngs(0))
  # Given a run Config, a model checks (and keeps) only its model part; the lr is the trainer's.
  with pytest.raises(ValueError, match="lr=-1.0"):
    C.Config(lr=-1.0).validate()
  DecoderLM(C.Config(lr=-1.0), rngs=nnx.Rngs(0))


# ---- tokens ----


@pytest.fixture(scope="module")
def model():
  return build_model(C.get_config("tiny", n_layers=1), seed=0)  # vocab 64, untied head


@pytest.mark.parametrize(
  "tokens, match",
  [
    ([[1, 64]], r"token ids must be in \[0, vocab_size=64\), got ids in \[1, 64\]"),
    ([[-1, 2]], r"got ids in \[-1, 2\]"),
    (np.array([[1, 2**40]]), r"\[1, 1099511627776\]"),  # checked before any int64 -> int32 cast
    ([[1.0, 2.0]], "tokens must be integers"),
    ([1, 2], r"int \[batch, seq\]"),
    (np.zeros((0, 4), np.int32), "batch, seq >= 1"),
    (np.zeros((2, 0), np.int32), "batch, seq >= 1"),
  ],
)
def test_bad_tokens_raise_before_tracing(model, tokens, match):
  with pytest.raises(ValueError, match=match):
    model(tokens)
  with pytest.raises(ValueError, match=match):
    check_tokens(tokens, 64)


def test_inference_uses_the_same_check(model):
  with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=64\), got ids in \[0, 99\]"):
    cached_logits(model, [[0, 99]])


def test_out_of_range_ids_under_jit_embed_as_zero(model):
  """Under jit the values are unknown: an id < 0 or >= vocab embeds as the zero vector (finite logits),
  exactly what an in-range id whose embedding row is zero gives (the same program on the same
  embedded inputs), and the same in every attn_impl."""
  fwd = nnx.jit(lambda m, t: m(t))
  toks = np.array([[3, 7, 5, 9, 2, 5]], np.int32)
  zeroed = build_model(C.get_config("tiny", n_layers=1), seed=0)
  zeroed.embed[...] = zeroed.embed[...].at[5].set(0.0)
  want = np.asarray(fwd(zeroed, jnp.asarray(toks)))
  assert np.isfinite(want).all()
  for bad in (64, 1000, -1, -64):
    got = np.asarray(fwd(model, jnp.asarray(np.where(toks == 5, bad, toks))))
    assert_bitwise(got, want, err_msg=f"id {bad}")
  quad = build_model(C.get_config("tiny", n_layers=1, attn_impl="quadratic"), seed=0)
  bad = jnp.asarray(np.where(toks == 5, 64, toks))
  assert_close(np.asarray(fwd(quad, bad)), np.asarray(fwd(model, bad)), n=32 * 6)


def test_embedding_gets_no_gradient_from_out_of_range_ids(model):
  toks = jnp.asarray([[3, 64, -1]], jnp.int32)

  def loss(embed):
    from fpa_jax.models import embed_tokens

    return jnp.sum(embed_tokens(embed, toks) ** 2 + embed_tokens(embed, toks))

  g = np.asarray(jax.jit(jax.grad(loss))(model.embed[...]))
  assert np.isfinite(g).all() and np.count_nonzero(np.abs(g).sum(1)) == 1 and np.abs(g[3]).sum() > 0
