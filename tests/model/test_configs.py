"""Config parts (model / data / train), what the model keeps, and the trainer's resume check (CPU, seconds)."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import sharding as S
from fpa_jax.layers import FirstPassageAttention
from fpa_jax.models import abstract_model, build_model
from fpa_jax.train import _check_resume_config, train

from _helpers_train import FixedBatch

PARTS = (C.ModelConfig, C.DataConfig, C.TrainConfig)


@pytest.mark.parametrize("cls", [C.Config, *C.CONFIGS.values()])
def test_parts_partition_the_fields(cls):
  """Every field of a run config (and of each preset) belongs to exactly one part."""
  names = [set(p.field_names()) for p in PARTS]
  assert set(cls.field_names()) == set.union(*names)
  assert sum(map(len, names)) == len(cls.field_names())  # disjoint
  # a few memberships that decide how runs resume and what the model sees
  assert {"dtype", "attn_impl", "block_size", "scan_layers", "remat", "step_scale"} <= names[0]
  assert {"seq_len", "batch_size", "task", "data_dir", "tokenizer", "small_data"} <= names[1]
  assert {"lr", "steps", "cooldown_steps", "grad_accum", "seed", "mesh", "eval_every", "name"} <= names[2]


def test_parts_round_trip_and_flat_namespace():
  cfg = C.get_config("small", lr=3e-4, seq_len=128, qk_norm=True)
  m, d, t = cfg.model, cfg.data, cfg.train
  assert (type(m), type(d), type(t)) == PARTS
  assert (m.qk_norm, d.seq_len, t.lr) == (True, 128, 3e-4) and (cfg.qk_norm, cfg.seq_len, cfg.lr) == (True, 128, 3e-4)
  assert C.Small(**m.to_dict(), **d.to_dict(), **t.to_dict()) == cfg
  assert cfg.to_dict() == {**m.to_dict(), **d.to_dict(), **t.to_dict()}  # config.json stays flat
  assert m.model is m and d.data is d and t.train is t  # `x.model` narrows a Config or a ModelConfig alike
  assert (m.head_dim, m.ff_dim, m.gate_terms, t.decay_steps) == (cfg.head_dim, cfg.ff_dim, cfg.gate_terms, 2000)
  assert C.replace(m, d_model=256).d_model == 256 and C.parse_overrides(C.ModelConfig, ["dtype=bfloat16"]) == {
    "dtype": "bfloat16"
  }


def test_model_holds_only_the_model_config():
  cfg = C.get_config("tiny", lr=0.5, data_dir="/elsewhere", n_layers=1)
  for model in (build_model(cfg), abstract_model(cfg), build_model(cfg.model)):
    assert type(model.cfg) is C.ModelConfig and model.cfg == cfg.model
    assert not hasattr(model.cfg, "lr") and not hasattr(model.cfg, "data_dir")
  layer = FirstPassageAttention(cfg, rngs=nnx.Rngs(0))  # used on its own (experiments.live_sets)
  assert type(layer.cfg) is C.ModelConfig
  # training / data fields are no part of the model's static structure (one graphdef, one compile)
  assert nnx.graphdef(abstract_model(cfg)) == nnx.graphdef(abstract_model(C.replace(cfg, lr=1e-4, steps=7)))


@pytest.mark.parametrize(
  "part, overrides, field",
  [
    (C.ModelConfig, dict(n_layers=0), "n_layers"),
    (C.ModelConfig, dict(d_ff=-1), "d_ff"),
    (C.ModelConfig, dict(dtype="float16"), "dtype"),
    (C.ModelConfig, dict(param_dtype="int8"), "param_dtype"),
    (C.ModelConfig, dict(attn_impl="flash"), "attn_impl"),
    (C.ModelConfig, dict(remat="always"), "remat"),
    (C.ModelConfig, dict(d_model=30, n_heads=4), "d_model"),
    (C.ModelConfig, dict(gate_terms_override="step,walk"), "gate_terms_override"),
    (C.ModelConfig, dict(block_size=-1), "block_size"),
    (C.DataConfig, dict(seq_len=0), "seq_len"),
    (C.DataConfig, dict(batch_size=0), "batch_size"),
    (C.DataConfig, dict(task="wiki"), "task"),
    (C.DataConfig, dict(tokenizer="sentencepiece"), "tokenizer"),
    (C.TrainConfig, dict(steps=0), "steps"),
    (C.TrainConfig, dict(log_every=0), "log_every"),
    (C.TrainConfig, dict(ckpt_every=0), "ckpt_every"),
    (C.TrainConfig, dict(warmup_steps=-1), "warmup_steps"),
    (C.TrainConfig, dict(steps=10, cooldown_steps=10), "cooldown_steps"),
    (C.Config, dict(batch_size=6, grad_accum=4), "grad_accum"),  # across parts: data vs train
  ],
)
def test_bad_values_raise_naming_the_field(part, overrides, field):
  with pytest.raises(ValueError, match=field):
    part(**overrides).validate()
  with pytest.raises(ValueError, match=field):  # the run config runs its parts' checks
    C.get_config("tiny", **overrides)


def test_resume_fields():
  fields = set(C.resume_fields())
  assert C.FREE_ON_RESUME <= set(C.ModelConfig.field_names())
  assert fields == set(C.ModelConfig.field_names()) - C.FREE_ON_RESUME
  assert {"d_model", "attention", "scan_layers", "gate_terms_override", "step_scale", "param_dtype"} <= fields
  assert not fields & {"attn_impl", "block_size", "dtype", "remat", "step_init_std"}


def test_resume_check_on_saved_dicts():
  """The check on a saved flat config dict: model fields refuse, the rest (and missing keys) pass."""
  cfg = C.get_config("tiny", n_layers=1)
  saved = cfg.to_dict()
  ok = [
    dict(lr=1e-2),
    dict(steps=500),
    dict(attn_impl="quadratic"),
    dict(dtype="bfloat16"),
    dict(remat="full"),
    dict(attn_impl="chunked", block_size=16),
    dict(step_init_std=0.0),
    dict(seq_len=16, batch_size=4),
  ]
  for over in ok:
    _check_resume_config(saved, C.replace(cfg, **over), "wd")
  for over, field in [
    (dict(d_model=64), "d_model"),
    (dict(scan_layers=True), "scan_layers"),
    (dict(attention="fox"), "attention"),
    (dict(gate_forget=True), "gate_forget"),
    (dict(step_scale=1.0), "step_scale"),
  ]:
    with pytest.raises(ValueError, match=f"different model.*{field}"):
      _check_resume_config(saved, C.replace(cfg, **over), "wd")
  # a run older than a field (its config.json lacks it) still resumes
  old = {k: v for k, v in saved.items() if k not in ("scan_layers", "remat", "cooldown_steps", "gate_terms_override")}
  _check_resume_config(old, C.replace(cfg, lr=1e-2), "wd")


@pytest.mark.slow
def test_trainer_resumes_across_train_fields_and_refuses_another_model(tmp_path):
  cfg = C.get_config("tiny", task="synthetic", steps=2, ckpt_every=2, n_layers=1, seq_len=16, batch_size=2)

  def run(c):
    return train(
      c,
      workdir=str(tmp_path),
      data=FixedBatch(seq_len=16, batch_size=2),
      progress=False,
      mesh=S.make_mesh(None, devices=jax.devices()[:1]),
      log=lambda s: None,
    )

  assert run(cfg)["step"] == 2
  out = run(C.replace(cfg, steps=3, ckpt_every=3, lr=1e-2, attn_impl="quadratic"))
  assert (out["start_step"], out["step"]) == (2, 3)
  for over in (dict(d_model=64), dict(scan_layers=True)):
    with pytest.raises(ValueError, match="different model.*" + next(iter(over))):
      run(C.replace(cfg, steps=4, **over))


def test_set_parses_every_part_with_its_type():
  """`--set` parses any field (model, data or train) with its declared type."""
  assert C.parse_overrides(C.Base110M, ["seq_len=512", "lr=1e-4", "rope=true", "mesh=data=2,model=4"]) == {
    "seq_len": 512,
    "lr": 1e-4,
    "rope": True,
    "mesh": "data=2,model=4",
  }


def test_lm_presets_use_the_lm_default_and_the_base_the_single_head_gate():
  """LM_DEFAULT is the LM presets' gate; the base defaults and `tiny` keep the single-head gate, and
  SINGLE_HEAD_GATE is exactly those defaults. Each gate preset sets every gate field (the studies'
  other presets: tests/studies/test_recipes.py)."""
  for preset in (C.SINGLE_HEAD_GATE, C.LM_DEFAULT):
    assert tuple(preset) == C.GATE_PRESET_FIELDS
  assert C.LM_DEFAULT != C.SINGLE_HEAD_GATE
  for name in ("small", "base110m"):
    cfg = C.get_config(name, attention="fpa")
    assert {k: getattr(cfg, k) for k in C.GATE_PRESET_FIELDS} == C.LM_DEFAULT, name
    assert cfg.gate_terms == ("forget", "step", "absolute", "offset")
  for cfg in (C.Config(), C.get_config("tiny")):
    assert {k: getattr(cfg, k) for k in C.GATE_PRESET_FIELDS} == C.SINGLE_HEAD_GATE
  # either set is a plain override: small with the single-head gate is small's other fields + it
  cfg = C.get_config("small", attention="fpa", **C.SINGLE_HEAD_GATE)
  assert cfg.gate_terms == ("step", "absolute", "offset") and cfg.step_scale == 10.0
  assert cfg.gate_lr_warmup_steps == 0 and cfg.step_init_std == C.SINGLE_HEAD_GATE["step_init_std"]
  # the LM default's values (the library's one recommended LM recipe; docs/design.md)
  assert C.LM_DEFAULT == {
    "gate_bias_init": 5.0,
    "gate_forget": True,
    "step_scale": 1.0,
    "step_init_std": 0.0,
    "absolute_scale": 1.0,
    "absolute_init_std": 0.0,
    "offset_scale": 1.0,
    "offset_init_std": 0.0,
    "fox_heads": 0,
    "gate_lr_scale": 0.1,
    "gate_lr_warmup_steps": 1200,
    "gate_clip_apart": True,
  }
  assert not hasattr(C, "LM_GATE") and not hasattr(C, "LM_FOX_HEAD")  # study recipes: experiments.recipes


def test_field_lists_come_from_the_fields():
  """Every field of every part carries its validator, and the field lists are read off the fields'
  metadata (a new field is registered where it is declared)."""
  for part in PARTS:
    for f in dataclasses.fields(part):
      assert callable(f.metadata.get("check")), f"{part.__name__}.{f.name} has no check"
  model = set(C.ModelConfig.field_names())
  assert set(C.GATE_OPTIONS) <= model and set(C.FREE_ON_RESUME) <= model
  assert set(C.GATE_PRESET_FIELDS) <= model | set(C.TrainConfig.field_names())
  assert C.GATE_OPTIONS == (
    "gate_init_std",
    "gate_bias_init",
    "gate_forget",
    "gate_terms_override",
    "step_scale",
    "step_init_std",
    "step_bias_init",
    "absolute_scale",
    "absolute_init_std",
    "offset_scale",
    "offset_init_std",
    "offset_bias_init",
    "fox_heads",
    "head_gates",
    "walk_leak",
  )
  assert set(C.GATE_PRESET_FIELDS) == {
    "gate_bias_init",
    "gate_forget",
    "step_scale",
    "absolute_scale",
    "offset_scale",
    "step_init_std",
    "absolute_init_std",
    "offset_init_std",
    "gate_lr_scale",
    "gate_lr_warmup_steps",
    "gate_clip_apart",
    "fox_heads",
  }
  assert C.FREE_ON_RESUME == {
    "attn_impl",
    "block_size",
    "skip_tolerance",
    "skip",
    "pallas_backend",
    "precision",
    "dtype",
    "remat",
    "init_std",
    "gate_init_std",
    "gate_bias_init",
    "step_init_std",
    "step_bias_init",
    "absolute_init_std",
    "offset_init_std",
    "offset_bias_init",
    "head_gates",
    "walk_leak",
  }
  from fpa_jax import layers

  assert layers.GATE_OPTIONS is C.GATE_OPTIONS
  # a preset class changes defaults only: its checks are the parts'
  assert C.get_config("small").validate() == C.get_config("small")


def test_training_accepts_key_skipping():
  """skip='keys' (and its two schedules) has a backward pass: a valid training config too."""
  for skip in ("keys", "keys_shared", "keys_per_head"):
    cfg = C.get_config("tiny", attn_impl="chunked", skip_tolerance=1e-3, skip=skip)
    assert cfg.validate() is cfg and cfg.validate(training=True) is cfg
  C.get_config("tiny").validate(training=True)


def test_pallas_backend_builds_the_layers_kernels_for_its_target():
  """pallas_backend (a free-on-resume model field) reaches the layer's attention call; it needs
  attn_impl="pallas", and "gpu" has no block-sparse kernels: errors before any trace."""
  from fpa_jax import layers

  cfg = C.get_config("tiny", attn_impl="pallas", pallas_backend="tpu", skip_tolerance=1e-3)
  assert layers.attention_spec(cfg.model).pallas_backend == "tpu"
  assert layers.attention_spec(C.get_config("tiny").model).pallas_backend == "auto"
  with pytest.raises(ValueError, match=r"unknown pallas_backend 'mosaic': the pallas_backend must be one of"):
    C.get_config("tiny", attn_impl="pallas", pallas_backend="mosaic")
  with pytest.raises(
    ValueError, match=r"pallas_backend='tpu' only applies to attn_impl='pallas', which attn_impl='auto'"
  ):
    C.get_config("tiny", pallas_backend="tpu")
  with pytest.raises(ValueError, match=r"Triton on GPU has neither"):
    C.get_config("tiny", attn_impl="pallas", pallas_backend="gpu", skip_tolerance=1e-3)
