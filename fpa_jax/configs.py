"""Typed experiment configs: three frozen parts, combined into one flat run `Config`.

    from fpa_jax.configs import get_config
    from fpa_jax.models import build_model
    cfg = get_config("tiny", attention="fox", steps=100)
    cfg.lr, cfg.d_model                     # one flat namespace over all the fields
    model = build_model(cfg)                # the model keeps only cfg.model

- `ModelConfig`: the network and how it computes (sizes, attention and its gate, RoPE, init,
  attn_impl / block_size / skip_tolerance, matmul precision, dtypes, scan_layers / remat) and derived
  sizes (head_dim, ff_dim, gate_terms). All that the model side (`fpa_jax.models`, `layers`, `gates`,
  `inference`) sees: `DecoderLM(cfg)` keeps `cfg.model`, never the learning rate or the data directory.
- `DataConfig`: what `fpa_jax.data` feeds it (task, data_dir, tokenizer, small_data, seq_len, batch_size).
- `TrainConfig`: the run (preset name, steps, lr schedule incl. cooldown, AdamW, grad_accum, seed, mesh,
  log / checkpoint / eval cadence, the evictability objective `evict_*` (`fpa_jax.losses`), budget in
  the loop `budget_loop_*` (`fpa_jax.ops.budget`)).

`Config` inherits the three (every field belongs to exactly one part); `cfg.model`, `cfg.data`,
`cfg.train` return each part as its own dataclass. Every field carries its validator in its metadata
(`fpa_jax.field_checks`): each part's `validate` runs its fields' checks and those across its fields,
`Config.validate` adds the checks across parts (and, with `training=True`, what only a training run
needs), `validate_mesh` those that need the mesh. A run's `config.json` (and a checkpoint's config
item) is the flat `Config.to_dict()`; resuming compares the model fields of `resume_fields()`.

Presets: `get_config("tiny" | "small" | "base110m", **overrides)`; each preset class's docstring starts
with its launch command. Every field can be overridden on the command line with `--set key=value`
(parsed with the field's type). The gate has two presets, plain dicts of overrides:
`SINGLE_HEAD_GATE` (the base defaults and `tiny`) and `LM_DEFAULT` (the LM presets `small` and
`base110m`), e.g. `get_config("small", **SINGLE_HEAD_GATE)`; the studies' other recipes live in
`experiments/recipes.py`. Why the defaults are what they are: docs/design.md.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Mapping

from fpa_jax import field_checks as V
from fpa_jax.ops import validate as _ops_validate
from fpa_jax.ops.pallas import common as _pallas_common

ATTENTIONS = ("fpa", "stack", "fox", "softmax", "nope")
GATED = ("fpa", "stack", "fox")
GATE_TERMS = ("forget", "step", "absolute", "offset")
# `ModelConfig.head_gates` letters -> the read-outs a head of that kind keeps (of the gate's own terms)
HEAD_GATES: dict[str, tuple[str, ...]] = {
  "p": GATE_TERMS,
  "f": ("forget",),
  "n": ("absolute", "offset"),
  "l": GATE_TERMS,  # as "p", the walk leaking `walk_leak` of itself per token (fpa_jax.gates.leaky_walk)
}
LEAKY = frozenset("l")  # the kinds whose walk leaks
TASKS = ("text", "passkey", "scopes", "dips")
TEST_TASKS = ("synthetic",)  # in-memory, for tests and benchmarks (fpa_jax.data.synthetic); nothing to build
ATTN_IMPLS = _ops_validate.IMPLS  # fpa_jax.ops impl names (one definition: ops.validate.Implementation)
DTYPES = ("float32", "bfloat16")
REMATS = ("none", "full", "dots", "dots_no_batch")  # per-block jax.checkpoint policies (fpa_jax.models.REMAT_POLICIES)
# jax.default_matmul_precision names: "default" is the backend's (bf16 passes for fp32 on TPU, TF32 on
# recent GPUs), "high" 3 bf16 passes (or TF32), "highest" full fp32. CPU computes fp32 exactly under each.
PRECISIONS = ("default", "high", "highest")


def _field(default: Any, check: V.Check, *, gate: bool = False, preset: bool = False, free_on_resume: bool = False):
  """A config field with its validator (`check(name, value)`, `fpa_jax.field_checks`) and the lists it
  belongs to, which are derived from this metadata:
    gate            sets the gate's parameterisation or init (`layers.GATE_OPTIONS`, `from_args`' options)
    preset          set by every gate preset (`GATE_PRESET_FIELDS`: SINGLE_HEAD_GATE, LM_DEFAULT, recipes)
    free_on_resume  a resumed run may change it (`FREE_ON_RESUME`): how the model computes or how its
                    parameters started (a restore replaces them), not their shapes or what they compute
  A preset subclass that only changes a default drops the metadata: checks and lists read the parts'."""
  meta = {"check": check, "gate": gate, "preset": preset, "free_on_resume": free_on_resume}
  return dataclasses.field(default=default, metadata=meta)


def _check_fields(part: Any, cls: type, names: Mapping[str, str]) -> None:
  """Each field's own check, in field order; `names` renames fields in the errors."""
  for f in dataclasses.fields(cls):
    f.metadata["check"](names.get(f.name, f.name), getattr(part, f.name))


def _fields_with(cls: type, key: str) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(key))


# Checks shared by several fields.
_GATE_INIT_STD = V.real(0, why="std of a gate read-out's init; 0 = zero weights")
_GATE_SCALE = V.real(0, lo_open=True, why="a gate term's scale: 10 single-head, 1 in the LM presets (docs/design.md)")
_GATE_BIAS = V.real(why="a gate read-out's initial bias")
_impl = lambda name, v: _ops_validate.check_impl(v, name=name)
_skip_tolerance = lambda name, v: _ops_validate.check_skip_tolerance(v, name=name)
_skip = lambda name, v: _ops_validate.check_skip_name(v, name=name)
_pallas_backend = lambda name, v: _pallas_common.check_backend(v, name=name)


def _tokenizer(name: str, v: Any) -> None:
  if not isinstance(v, str) or not re.fullmatch(r"bytes|spm(:\d+)?", v):
    raise ValueError(f"unknown {name} {v!r}; use 'bytes', 'spm' or 'spm:N' (see fpa_jax.data)")


class _Part:
  """What every config part shares: its fields as a flat dict."""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Part):
  """The network and how it computes: all that `fpa_jax.models.DecoderLM` stores (as `model.cfg`)."""

  vocab_size: int = _field(256, V.integer(1))
  d_model: int = _field(64, V.integer(1))
  n_layers: int = _field(2, V.integer(1))
  n_heads: int = _field(2, V.integer(1))
  # k/v heads and gates (grouped-query attention); 0 -> n_heads; divides n_heads
  n_kv_heads: int = _field(0, V.integer(0, "0 = n_heads"))
  d_ff: int = _field(0, V.integer(0, "0 = round_up(8/3 * d_model, 64)"))  # SwiGLU hidden dim
  attention: str = _field("fpa", V.choice(ATTENTIONS))
  # one of ATTN_IMPLS; auto = chunked on every backend (pallas is opt-in until its compiled path has passed on an
  # accelerator: docs/ops.md, "Verifying the Pallas kernels"); quadratic for debugging
  attn_impl: str = _field("auto", _impl, free_on_resume=True)
  # chunked tile size; 0 -> ops default (shrinks for short sequences)
  block_size: int = _field(0, V.integer(0, "0 = the ops default"), free_on_resume=True)
  # None: exact. eps in (0, 1): the chunked kernel drops tiles whose every weight is <= eps / T
  # (each row loses <= eps of its attention, `fpa_jax.ops.chunked`); attn_impl chunked (or auto) or
  # pallas (the block-sparse kernels, `fpa_jax.ops.pallas.block_sparse`).
  skip_tolerance: float | None = _field(None, _skip_tolerance, free_on_resume=True)
  # what skip_tolerance drops: "tiles" (forward and backward) or "keys" (per query block, each key the
  # bound rules out, forward and backward, `fpa_jax.ops.sparse`)
  skip: str = _field("tiles", _skip, free_on_resume=True)
  # what attn_impl="pallas" builds its kernels for (`fpa_jax.ops.pallas.BACKENDS`): "auto" JAX's backend
  # (the interpreter off TPU / GPU); "tpu" / "gpu" that target's kernels whatever JAX runs on, to lower a
  # step for it without the hardware (`ops.pallas.lower_for`; docs/ops.md, "Lowering without the hardware")
  pallas_backend: str = _field("auto", _pallas_backend, free_on_resume=True)
  # one of PRECISIONS: fp32 matmul passes (TPU: default = bf16 passes)
  precision: str = _field("default", V.choice(PRECISIONS), free_on_resume=True)
  rope: bool | None = _field(None, V.flag(optional=True))  # None -> RoPE for softmax only (the gates give position)
  rope_theta: float = _field(10000.0, V.real(0, lo_open=True, why="RoPE's base wavelength, e.g. 10000"))
  qk_norm: bool = _field(False, V.flag())  # FoX "Pro": RMSNorm on q and k per head
  output_gate: bool = _field(False, V.flag())  # FoX "Pro": o = o * sigmoid(W_g x) per head before W_o
  tie_embeddings: bool = _field(False, V.flag())
  norm_eps: float = _field(
    1e-6, V.real(0, lo_open=True, why="RMSNorm's epsilon keeps an all-zero row finite, e.g. 1e-6")
  )
  init_std: float = _field(
    0.02, V.real(0, lo_open=True, why="std of the weights' init; 0 gives a model with no gradient"), free_on_resume=True
  )
  # gate parameterisation / init (fpa_jax.gates; the defaults: docs/design.md); exposed for ablations
  gate_init_std: float = _field(0.02, _GATE_INIT_STD, gate=True, free_on_resume=True)  # fox term: w_f ~ N(0, std)
  gate_bias_init: float = _field(
    0.0, _GATE_BIAS, gate=True, preset=True, free_on_resume=True
  )  # fox term: b_f (FoX's init: 0)
  gate_forget: bool = _field(False, V.flag(), gate=True, preset=True)  # stack/fpa: add FoX's log-sigmoid term
  # ablations: comma-separated read-outs from GATE_TERMS, replacing the default (checked with `attention`)
  gate_terms_override: str = _field("", V.text(), gate=True)
  step_scale: float = _field(10.0, _GATE_SCALE, gate=True, preset=True)  # stack/fpa: step_scale * (w_s.x + b_s)
  # > 0: a live gate at init (an all-zero gate gets no gradient; docs/design.md)
  step_init_std: float = _field(1e-3, _GATE_INIT_STD, gate=True, preset=True, free_on_resume=True)
  step_bias_init: float = _field(0.0, _GATE_BIAS, gate=True, free_on_resume=True)
  absolute_scale: float = _field(10.0, _GATE_SCALE, gate=True, preset=True)  # fpa: field += scale * (w_a.x + b_a)
  absolute_init_std: float = _field(1e-3, _GATE_INIT_STD, gate=True, preset=True, free_on_resume=True)
  offset_scale: float = _field(10.0, _GATE_SCALE, gate=True, preset=True)  # fpa: level = field + scale * (w_o.x + b_o)
  offset_init_std: float = _field(1e-3, _GATE_INIT_STD, gate=True, preset=True, free_on_resume=True)
  offset_bias_init: float = _field(0.0, _GATE_BIAS, gate=True, free_on_resume=True)
  # stack/fpa: the first N kv heads of every layer have no extremum read-outs (step, absolute and
  # offset held at 0): FoX heads with gate_forget, NoPE heads without; < kv_heads. A head the read-outs
  # cannot turn into a forgetting one, which passkey retrieval keeps using (docs/design.md). 0 = every
  # head has them; no effect on fox / softmax / nope.
  fox_heads: int = _field(0, V.integer(0, "0 = every head has the read-outs"), gate=True, preset=True)
  # per-layer, per-kv-head gate kinds (`head_gate_kinds`), "" = fox_heads' split on every layer. One
  # group of kv_heads letters per layer, comma-separated (or one group for every layer), each letter a
  # HEAD_GATES kind: "p" every read-out of gate_terms (FPA), "f" FoX's term only, "n" no walk (absolute
  # and offset only: a bounded field that cannot drift, so a penalty can only come from content, a
  # level above a later dip). E.g. "pppp,nnnn": the upper layer's heads cannot forget by age. It sets
  # which read-outs feed each head, no shape: a retrofit may change it on a trained checkpoint.
  head_gates: str = _field("", V.text(), gate=True, free_on_resume=True)
  # the "l" (leaky) heads' walk: walk_t = (1 - walk_leak) * walk_{t-1} + increment_t, held within
  # |increment| / walk_leak of 0 (a walk that keeps its local order but cannot drift by age; 1/64: a
  # memory of ~64 tokens). 0 = no leaky head; > 0 needs an "l" in head_gates, and "l" needs it > 0.
  walk_leak: float = _field(
    0.0,
    V.real(0, 1, hi_open=True, why="the share a leaky walk loses per token, e.g. 1/64"),
    gate=True,
    free_on_resume=True,
  )
  # compute dtype (bfloat16 for speed); params stay param_dtype
  dtype: str = _field("float32", V.choice(DTYPES), free_on_resume=True)
  param_dtype: str = _field("float32", V.choice(DTYPES))
  # layer stacking / rematerialisation (docs/design.md, "Depth"): neither changes the maths
  scan_layers: bool = _field(False, V.flag())  # blocks as one [n_layers, ...]-stacked Block run by nnx.scan
  remat: str = _field(  # what a block keeps for the backward pass
    "none",
    V.choice(REMATS, what="{name} policy", why="'none' keeps every activation, 'full' only each block's input"),
    free_on_resume=True,
  )

  @property
  def model(self) -> ModelConfig:
    """Itself: code that takes a ModelConfig or a run Config narrows either with `cfg.model`."""
    return self

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def kv_heads(self) -> int:
    """Heads of k, v and the gates (field / level per kv head, shared by its n_heads / kv_heads
    query heads: one penalty per key and kv head; see `fpa_jax.ops.attention`)."""
    return self.n_kv_heads or self.n_heads

  @property
  def ff_dim(self) -> int:
    return self.d_ff or -(-int(8 * self.d_model / 3) // 64) * 64

  @property
  def use_rope(self) -> bool:
    return (self.attention == "softmax") if self.rope is None else bool(self.rope)

  def head_gate_kinds(self, layer: int) -> str:
    """The gate kind of each kv head of `layer` (`head_gates`' letters, HEAD_GATES), kv_heads long:
    `head_gates`' group for the layer, else fox_heads' "f" heads before "p" heads."""
    if not self.head_gates:
      return "f" * self.fox_heads + "p" * (self.kv_heads - self.fox_heads)
    groups = self.head_gates.split(",")
    return groups[0] if len(groups) == 1 else groups[layer]

  def _check_head_gates(self, n) -> None:
    groups = self.head_gates.split(",")
    eg = f"e.g. {n('head_gates')}={'p' * self.kv_heads!r} (every layer) or {','.join(['p' * self.kv_heads] * self.n_layers)!r}"
    if self.fox_heads:
      raise ValueError(
        f"{n('head_gates')}={self.head_gates!r} and {n('fox_heads')}={self.fox_heads} both split the heads: "
        f"set {n('fox_heads')}=0 and write the FoX heads as 'f' in {n('head_gates')}"
      )
    if len(groups) not in (1, self.n_layers) or any(len(g) != self.kv_heads for g in groups):
      raise ValueError(
        f"{n('head_gates')}={self.head_gates!r}: one group of kv_heads={self.kv_heads} letters for every layer, "
        f"or one per layer (n_layers={self.n_layers}), comma-separated; {eg}"
      )
    bad = set("".join(groups)) - set(HEAD_GATES)
    if bad:
      raise ValueError(f"{n('head_gates')}={self.head_gates!r}: unknown kind(s) {sorted(bad)}; use {tuple(HEAD_GATES)}")
    for kind in set("".join(groups)) - {"f"}:  # "f" without FoX's term is a NoPE head, as with fox_heads
      if not set(HEAD_GATES[kind]) & set(self.gate_terms):
        raise ValueError(
          f"{n('head_gates')} kind {kind!r} keeps {HEAD_GATES[kind]}, none of which the gate has "
          f"(gate_terms {self.gate_terms}, attention={self.attention!r}): use another kind or "
          f"{n('attention')}='fpa'"
        )
    if self.scan_layers and len(set(groups)) > 1:
      raise ValueError(
        f"{n('head_gates')}={self.head_gates!r} differs across layers, which a scanned stack (one Block "
        f"for every layer) cannot hold: set {n('scan_layers')}=False"
      )

  @property
  def gate_terms(self) -> tuple[str, ...]:
    """The read-outs of this attention's gate (`fpa_jax.gates`); () for softmax / nope."""
    if self.gate_terms_override and self.attention in GATED:
      return tuple(self.gate_terms_override.split(","))
    forget = ("forget",) if self.gate_forget else ()
    return {"fox": ("forget",), "stack": forget + ("step",), "fpa": forget + ("step", "absolute", "offset")}.get(
      self.attention, ()
    )

  def validate(self, arg_names: Mapping[str, str] | None = None) -> ModelConfig:
    """Static checks (no devices needed): each field's own, then those across fields; raises
    ValueError naming the field and what to change. `arg_names` renames fields in the errors, for a
    caller whose arguments set them under other names (`FirstPassageAttention.from_args`: `gate`)."""
    names = dict(arg_names or {})
    n = lambda f: names.get(f, f)
    _check_fields(self, ModelConfig, names)
    if self.n_heads % self.kv_heads:
      raise ValueError(
        f"{n('n_kv_heads')}={self.n_kv_heads} must divide {n('n_heads')}={self.n_heads} (each kv head serves "
        f"n_heads / n_kv_heads query heads); use a divisor of {self.n_heads}, or 0 for n_heads"
      )
    if self.d_model % self.n_heads:
      raise ValueError(
        f"{n('d_model')}={self.d_model} is not divisible by {n('n_heads')}={self.n_heads}; "
        f"change one of them (e.g. {n('n_heads')}={_divisor_hint(self.d_model, self.n_heads)})"
      )
    if self.use_rope and self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}; change {n('d_model')} or {n('n_heads')}")
    bad_terms = set(self.gate_terms) - set(GATE_TERMS)
    if bad_terms or (self.attention in GATED and not self.gate_terms):
      raise ValueError(
        f"{n('gate_terms_override')}={self.gate_terms_override!r}: use a comma-separated subset of "
        f"{GATE_TERMS}, e.g. 'step,offset'"
      )
    # without extremum read-outs (fox, softmax, nope) there is nothing to hold: fox_heads has no effect,
    # so a preset's value does not stop `attention="fox"`
    if set(self.gate_terms) - {"forget"} and self.fox_heads >= self.kv_heads:
      raise ValueError(
        f"{n('fox_heads')}={self.fox_heads} must be < kv_heads={self.kv_heads} (at least one head with the "
        f"read-outs): set {n('fox_heads')}={max(self.kv_heads - 1, 0)} (the LM presets hold one head), or "
        f"{n('attention')}='fox' for every head at FoX's term"
      )
    if self.head_gates:
      self._check_head_gates(n)
    leaky = bool(LEAKY & set(self.head_gates)) and self.attention in GATED
    if leaky != (self.walk_leak > 0):
      raise ValueError(
        f"{n('walk_leak')}={self.walk_leak} with head_gates={self.head_gates!r}: a leaky head ('l') needs "
        f"{n('walk_leak')} in (0, 1), e.g. 1/64, and {n('walk_leak')} > 0 needs an 'l' head in {n('head_gates')}"
      )
    if leaky and not set(self.gate_terms) - {"forget"}:
      raise ValueError(
        f"head_gates={self.head_gates!r}: a leaky head ('l') needs the FPA kernel, which reads the field; "
        f"{n('attention')}={self.attention!r} runs FoX's, which sums the increments itself: set "
        f"{n('attention')}='fpa'"
      )
    _ops_validate.check_impl(self.attn_impl, self.block_size or None, name=n("attn_impl"), block_name=n("block_size"))
    _ops_validate.check_skip_tolerance(
      self.skip_tolerance, self.attn_impl, name=n("skip_tolerance"), impl_name=n("attn_impl")
    )
    _ops_validate.check_skip(
      self.skip,
      self.skip_tolerance,
      self.attn_impl,
      name=n("skip"),
      tolerance_name=n("skip_tolerance"),
      impl_name=n("attn_impl"),
    )
    if self.pallas_backend != "auto" and _ops_validate.resolve_impl(self.attn_impl) != "pallas":
      raise ValueError(
        f"{n('pallas_backend')}={self.pallas_backend!r} only applies to {n('attn_impl')}='pallas', which "
        f"{n('attn_impl')}={self.attn_impl!r} does not run: set {n('attn_impl')}='pallas' or "
        f"{n('pallas_backend')}='auto'"
      )
    # the device-free half of `check_pallas_skip` ("auto" is decided by JAX's backend, at the op)
    if self.pallas_backend == "gpu" and self.skip_tolerance is not None:
      raise ValueError(_ops_validate.PALLAS_SKIP_GPU)
    return self


# Model fields a resumed run may change (`_field`'s free_on_resume): every other model field sets the
# parameters' shapes, layout (scan_layers) or what they compute (scales, RoPE, norm eps), so
# `fpa_jax.train` refuses to resume a checkpoint across it (`resume_fields`).
FREE_ON_RESUME = frozenset(_fields_with(ModelConfig, "free_on_resume"))


# ModelConfig fields that set the gate's parameterisation and init (`_field`'s gate): the layer's
# plain-argument constructor takes them as **gate_options (`FirstPassageAttention.from_args`).
GATE_OPTIONS: tuple[str, ...] = _fields_with(ModelConfig, "gate")


def resume_fields() -> tuple[str, ...]:
  """The ModelConfig fields a checkpoint must agree on to resume (every new field is, by default)."""
  return tuple(f for f in ModelConfig.field_names() if f not in FREE_ON_RESUME)


@dataclasses.dataclass(frozen=True)
class DataConfig(_Part):
  """What the model is trained on: `fpa_jax.data.make_pipeline`'s task, source and batch shape."""

  task: str = _field("text", V.choice(TASKS + TEST_TASKS, shown=TASKS))
  data_dir: str = _field("data", V.text())
  tokenizer: str = _field("bytes", _tokenizer)  # bytes | spm | spm:N (fpa_jax.data.tokenizers)
  small_data: bool = _field(False, V.flag())
  seq_len: int = _field(64, V.integer(1))
  batch_size: int = _field(8, V.integer(1))  # global batch (sequences per optimizer step)
  # text only: "stdlib" (offline default), a local directory of UTF-8 files, or "tfds:NAME" (prepared)
  text_source: str = _field("stdlib", V.text(nonempty=True, why="'stdlib', a directory path, or 'tfds:NAME'"))
  # text only: windows of the fixed held-out set (fpa_jax.data.make_heldout): one inside every
  # validation document, the rest spread by length; the trainer's periodic eval scores all of them
  heldout_windows: int = _field(256, V.integer(1))

  @property
  def data(self) -> DataConfig:
    return self

  def validate(self) -> DataConfig:
    _check_fields(self, DataConfig, {})
    return self


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Part):
  """The run: its preset name, optimisation (AdamW, lr schedule), loop cadence, mesh and seed."""

  name: str = _field("base", V.text())  # the preset (CONFIGS key) the run started from
  # ---- optimisation ----
  steps: int = _field(100, V.integer(1))
  lr: float = _field(1e-3, V.real(0, lo_open=True, why="the peak learning rate, e.g. 1e-3"))
  # cosine decays to lr * min_lr_ratio
  min_lr_ratio: float = _field(0.1, V.real(0, 1, why="the cosine ends at lr * min_lr_ratio; 1 = constant after warmup"))
  warmup_steps: int = _field(10, V.integer(0))
  # cosine horizon; 0 -> `steps`. Fix it to extend runs exactly.
  lr_decay_steps: int = _field(0, V.integer(0, "0 = steps"))
  # WSD: the last N of `steps` decay linearly to 0 (anneal a constant-lr run)
  cooldown_steps: int = _field(0, V.integer(0))
  b1: float = _field(0.9, V.real(0, 1, hi_open=True, why="AdamW's first-moment decay, e.g. 0.9"))
  b2: float = _field(0.95, V.real(0, 1, hi_open=True, why="AdamW's second-moment decay, e.g. 0.95"))
  weight_decay: float = _field(0.1, V.real(0, why="AdamW's decoupled weight decay; 0 disables"))
  clip_norm: float = _field(1.0, V.real(0, why="global-norm gradient clipping; 0 disables"))
  # multiplies the lr of the FPA gate's step / absolute / offset read-outs (not FoX's forget term):
  # they are scale * (w.x + b) with scale 10, so Adam moves their output ~10x faster (docs/design.md)
  gate_lr_scale: float = _field(
    1.0, V.real(0, lo_open=True, why="the gate read-outs' lr multiplier; 1 = the same lr"), preset=True
  )
  # the read-outs' lr multiplier ramps linearly from 0 to gate_lr_scale over these steps; 0 = none.
  # With read-outs started at 0 (FoX's init) the model is FoX until the read-outs move
  gate_lr_warmup_steps: int = _field(0, V.integer(0, "0 = no ramp"), preset=True)
  # clip the read-outs' gradient by its own global norm, apart from the other weights': with one norm
  # their gradient shrinks every other update, so even frozen read-outs change the run (docs/design.md)
  gate_clip_apart: bool = _field(False, V.flag(), preset=True)
  grad_accum: int = _field(1, V.integer(1))  # micro-batches per step (batch_size must divide)
  seed: int = _field(0, V.integer(0))  # parameter init and data order
  # ---- loop ----
  mesh: str = _field("", V.text())  # e.g. "data=4,model=2"; "" -> all devices on data (fpa_jax.sharding)
  log_every: int = _field(10, V.integer(1))
  ckpt_every: int = _field(100, V.integer(1))
  keep_checkpoints: int = _field(3, V.integer(1))
  eval_every: int = _field(0, V.integer(0, "0 disables periodic validation"))
  # batches per eval for tasks other than text (text: the held-out windows, `heldout_windows`)
  eval_batches: int = _field(4, V.integer(1))
  # ---- evictability objective (fpa_jax.losses; off at evict_weight 0: the exact LM loss) ----
  # (its fields are checked whether the objective is on or not: a bad value is a typo)
  # weight of the hinge on the soft live fraction of old keys
  evict_weight: float = _field(0.0, V.real(0, why="0 turns the objective off"))
  # final kept fraction of the keys outside the window
  evict_target: float = _field(0.25, V.real(0, 1, lo_open=True, hi_open=True, why="the kept fraction of old keys"))
  evict_ramp_steps: int = _field(0, V.integer(0))  # DMS ramp of the compression ratio 1 -> 1/evict_target; 0 = no ramp
  # optimizer step the ramp starts at (retrofitting a trained run: its step)
  evict_ramp_start: int = _field(0, V.integer(0))
  evict_window: int = _field(16, V.integer(0))  # recent window W: keys j > i - W are never counted (always kept)
  evict_tau: float = _field(4.0, V.real(why="the penalty (nats) at which a key counts as half evicted"))
  evict_temp: float = _field(1.0, V.real(0, lo_open=True, why="the soft count's width in nats"))
  # softplus temperature of the penalty in the objective
  evict_soft: float = _field(0.5, V.real(0, why="0 = exact relu penalty"))
  evict_queries: int = _field(8, V.integer(1))  # sampled queries per sequence and step (stratified over the positions)
  # one kept-fraction budget for all pressed heads together (fpa_global's), not one per (layer, kv head)
  evict_shared: bool = _field(False, V.flag())
  # ---- utility-supervised levels (fpa_jax.losses, fpa_jax.ops.utility; off at utility_weight 0) ----
  # Old keys (outside evict_window, at evict_queries sampled queries) are labelled keep / evict by the
  # attention later queries give them (the top utility_keep share kept) and the soft live indicator
  # (evict_tau, evict_temp, evict_soft) is fit to the labels: a rank of the keys by content.
  utility_weight: float = _field(0.0, V.real(0, why="0 turns the utility objective off"))
  utility_keep: float = _field(
    0.1, V.real(0, 1, lo_open=True, why="the share of old keys labelled keep (the most-read ones)")
  )
  # the layers the evictability and utility objectives press: comma-separated indices ("1"), "" = every
  # layer (a lower layer may then keep its keys while an upper one learns what to drop)
  objective_layers: str = _field("", V.text())
  # ---- budget in the loop (fpa_jax.ops.budget; off at budget_loop_prob 0) ----
  # A share of the steps trains through the cache an `fpa_budget` decode of a random size would keep:
  # capacity round(rho * seq_len), rho ~ U[budget_loop_min, budget_loop_max], recent = capacity // 8.
  # Those steps run the quadratic attention (O(T^2) memory) whatever attn_impl says.
  budget_loop_prob: float = _field(
    0.0, V.real(0, 1, why="the share of steps trained with a random cache budget; 0 = off")
  )
  budget_loop_min: float = _field(0.1, V.real(0, 1, lo_open=True, why="the smallest budget, a fraction of seq_len"))
  budget_loop_max: float = _field(0.5, V.real(0, 1, lo_open=True, why="the largest budget, a fraction of seq_len"))
  # 0: the hard cut (evicted keys get no weight, no gradient); > 0: evicted keys are kept at a soft bias
  # of this width (nats) beyond the cache's threshold, so the loss can teach the gate what to keep
  budget_loop_soft: float = _field(0.0, V.real(0, why="0 = the hard cut; > 0 = its soft ramp's width in nats"))
  # False: a cache of the drawn capacity per (row, kv head), fpa_budget's. True: one cache of capacity * KVH
  # keys per (row, layer) for all its kv heads, the largest penalties of every head out first (fpa_global's
  # rule within a layer): the heads that forget leave their share to the heads that keep
  budget_loop_shared: bool = _field(False, V.flag())
  # optimizer step from which budgeted steps are drawn (before it every step is the plain one)
  budget_loop_start: int = _field(0, V.integer(0))
  # 0: a budgeted step's LM loss is taken through the cut. > 0: self-distillation through the cut (DMS's
  # objective, the model's own full-cache forward its teacher): the LM loss on the full forward, plus this
  # weight times KL(full forward, no gradient || the cut forward) per target token (`losses.distill_kl`)
  distill_weight: float = _field(0.0, V.real(0, why="0 = off; > 0 needs budget_loop_prob > 0"))

  @property
  def train(self) -> TrainConfig:
    return self

  @property
  def decay_steps(self) -> int:
    return self.lr_decay_steps or self.steps

  def validate(self) -> TrainConfig:
    _check_fields(self, TrainConfig, {})
    if self.warmup_steps > self.decay_steps:
      horizon = "lr_decay_steps" if self.lr_decay_steps else "steps"
      raise ValueError(
        f"warmup_steps={self.warmup_steps} is longer than the lr schedule ({horizon}={self.decay_steps}), "
        f"so the warmup would be cut short: use warmup_steps <= {self.decay_steps} (e.g. "
        f"warmup_steps={self.decay_steps // 10}), or a larger {horizon}"
      )
    if self.cooldown_steps >= self.steps:
      raise ValueError(f"cooldown_steps={self.cooldown_steps} must be in [0, steps={self.steps})")
    if self.budget_loop_min > self.budget_loop_max:
      raise ValueError(
        f"budget_loop_min={self.budget_loop_min} > budget_loop_max={self.budget_loop_max}: the budget is drawn "
        "uniformly between them, so use min <= max"
      )
    return self


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig, DataConfig, ModelConfig):
  """A run: the fields of ModelConfig, DataConfig and TrainConfig in one flat namespace (the CLI's
  `--set key=value`, `get_config(name, key=value)`, `cfg.lr`), with `.model` / `.data` / `.train`
  returning each part on its own. Base defaults; use a named preset: `get_config('tiny' | 'small' |
  'base110m')`."""

  def _part(self, cls):
    return cls(**{f: getattr(self, f) for f in cls.field_names()})

  @property
  def model(self) -> ModelConfig:
    """The model part: what `DecoderLM` is built from and stores (no lr, no data_dir)."""
    return self._part(ModelConfig)

  @property
  def data(self) -> DataConfig:
    return self._part(DataConfig)

  @property
  def train(self) -> TrainConfig:
    return self._part(TrainConfig)

  @property
  def objective_layer_ids(self) -> tuple[int, ...] | None:
    """`objective_layers` as sorted layer indices; None: every layer."""
    return tuple(sorted({int(x) for x in self.objective_layers.split(",")})) if self.objective_layers else None

  def validate(self, *, training: bool = False) -> Config:
    """Each part's checks, then those across parts (no devices needed); raises ValueError.
    `training=True` (`fpa_jax.train`) adds what only a training run needs (nothing today: both
    skips, tiles and keys, have a backward pass)."""
    for part in (self.model, self.data, self.train):
      part.validate()
    if self.batch_size % self.grad_accum:
      raise ValueError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
    if self.evict_weight > 0 and self.attention not in GATED:
      raise ValueError(f"evict_weight > 0 needs a gated attention {GATED}, got {self.attention!r}; set evict_weight=0")
    if self.utility_weight > 0 and self.attention not in GATED:
      raise ValueError(
        f"utility_weight > 0 needs a gated attention {GATED}, got {self.attention!r}; set utility_weight=0"
      )
    if self.utility_weight > 0 and self.evict_window >= self.seq_len:
      raise ValueError(
        f"evict_window={self.evict_window} >= seq_len={self.seq_len} leaves no old key to label for the utility "
        "objective; use a smaller window"
      )
    if self.objective_layers:
      bad = [x for x in self.objective_layers.split(",") if not x.strip().isdigit() or int(x) >= self.n_layers]
      if bad:
        raise ValueError(
          f"objective_layers={self.objective_layers!r}: comma-separated layer indices in [0, n_layers="
          f"{self.n_layers}), e.g. objective_layers='{self.n_layers - 1}' (the top layer), or '' for every layer"
        )
    if self.distill_weight > 0 and self.budget_loop_prob == 0:
      raise ValueError(
        f"distill_weight={self.distill_weight} distils the full forward into the budgeted one, but budget_loop_prob=0 "
        "draws no budget: set budget_loop_prob > 0 (1.0: every step) or distill_weight=0"
      )
    if self.budget_loop_prob > 0 and self.attention not in GATED:
      raise ValueError(
        f"budget_loop_prob > 0 (training through an fpa_budget cache) needs a gated attention {GATED}, got "
        f"{self.attention!r}; set budget_loop_prob=0"
      )
    if self.evict_weight > 0 and self.evict_window >= self.seq_len:
      raise ValueError(
        f"evict_window={self.evict_window} >= seq_len={self.seq_len} leaves no old key to evict; use a smaller window"
      )
    return self

  def validate_mesh(self, mesh_sizes: dict[str, int]) -> None:
    """Checks that need the mesh: the per-micro-batch batch must split over `data`."""
    data = mesh_sizes["data"]
    micro = self.batch_size // self.grad_accum
    if micro % data:
      raise ValueError(
        f"batch_size/grad_accum = {self.batch_size}/{self.grad_accum} = {micro} sequences per "
        f"micro-batch is not divisible by the data axis ({data}); use a batch_size that is a "
        f"multiple of {data * self.grad_accum} or a smaller data axis in --mesh"
      )


def _divisor_hint(d: int, h: int) -> int:
  divs = [k for k in range(1, d + 1) if d % k == 0]
  return min(divs, key=lambda k: abs(k - h))


# The fields a gate preset sets (`_field`'s preset): the gate's terms and scales, the read-outs' init
# and their learning rate. Every gate preset is a plain dict of all of them, so a study row that
# spreads one is pinned whatever the presets' defaults become.
GATE_PRESET_FIELDS: tuple[str, ...] = _fields_with(ModelConfig, "preset") + _fields_with(TrainConfig, "preset")
_BASE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
# The base defaults (and `tiny`'s): the gate of the single-head live-set studies (docs/design.md).
SINGLE_HEAD_GATE: dict[str, Any] = {k: _BASE_DEFAULTS[k] for k in GATE_PRESET_FIELDS}
# The one recommended language-model gate, the LM presets' default (`small`, `base110m`;
# docs/design.md): FoX's term in the increment at bias 5 (weak decay at init: sigmoid(5) = 0.993)
# and the step / absolute / offset read-outs at scale 1, started at 0 (the model is FoX at step 0)
# with their lr ramped from 0 to a tenth of the lr over 1200 steps and their gradient clipped by its
# own norm, on every kv head (`fox_heads=0`).
LM_DEFAULT: dict[str, Any] = {
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


# The gate recipes by name, for code outside a run Config (`FirstPassageAttention.from_args(recipe=...)`,
# `fpa_jax.optim.gate_optimizer(recipe=...)`): "lm" the recommended one, "single_head" the studies'.
GATE_RECIPES: dict[str, dict[str, Any]] = {"lm": LM_DEFAULT, "single_head": SINGLE_HEAD_GATE}


def gate_recipe(name: str, part: str | None = None) -> dict[str, Any]:
  """The fields of the gate recipe `name` (`GATE_RECIPES`): all of them, or only those of one part,
  "model" (the layer's gate options, `GATE_OPTIONS`) or "train" (the optimizer's: `gate_lr_scale`,
  `gate_lr_warmup_steps`, `gate_clip_apart`). A copy; ValueError on an unknown name or part."""
  if name not in GATE_RECIPES:
    raise ValueError(f"unknown recipe {name!r}; use one of {tuple(GATE_RECIPES)}")
  fields = {None: None, "model": ModelConfig.field_names(), "train": TrainConfig.field_names()}
  if part not in fields:
    raise ValueError(f"unknown part {part!r}; use 'model', 'train' or None")
  keep = fields[part]
  return {k: v for k, v in GATE_RECIPES[name].items() if keep is None or k in keep}


def _preset_base(name: str, base: type, defaults: Mapping[str, Any], doc: str) -> type:
  """A frozen dataclass subclass of `base` whose fields in `defaults` default to those values (their
  metadata kept)."""
  hints = typing.get_type_hints(base)
  fields = {f.name: f for f in dataclasses.fields(base)}
  spec = [(k, hints[k], dataclasses.field(default=v, metadata=fields[k].metadata)) for k, v in defaults.items()]
  ns = {"__module__": __name__, "__doc__": doc}
  return dataclasses.make_dataclass(name, spec, bases=(base,), frozen=True, namespace=ns)


_LMPreset = _preset_base("_LMPreset", Config, LM_DEFAULT, "The LM presets' gate: LM_DEFAULT.")


@dataclasses.dataclass(frozen=True)
class Tiny(Config):
  """python -m fpa_jax.train --config tiny --task text --steps 50 --workdir /tmp/fpa_tiny

  Tests and smoke runs: 2 layers, d_model 32, 2 heads, 64-token sequences; compiles and runs
  a step in seconds on CPU. Loss drops but nothing meaningful is learned.
  """

  name: str = "tiny"
  vocab_size: int = 64
  d_model: int = 32
  n_layers: int = 2
  n_heads: int = 2
  d_ff: int = 64
  seq_len: int = 32
  batch_size: int = 8
  steps: int = 20
  lr: float = 3e-3
  warmup_steps: int = 2
  log_every: int = 1
  ckpt_every: int = 10
  small_data: bool = True


@dataclasses.dataclass(frozen=True)
class Small(_LMPreset):
  """python -m fpa_jax.train --config small --attention fpa --task text --steps 2000 --workdir runs/small_fpa

  CPU studies: 4 layers, d_model 128, 4 heads, 256-token sequences, batch 16 (~1M params);
  a few hundred steps take minutes on a laptop CPU. Passkey prompts are 1024 tokens: add
  `--task passkey --set seq_len=1024 --set batch_size=8` (a shorter seq_len is an error), or use
  `python -m experiments.passkey`, which mixes text in and weights the answers (plain passkey LM
  loss is too sparse a signal at this scale). Also the `experiments.bench_train` throughput config.
  """

  name: str = "small"
  vocab_size: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 384
  seq_len: int = 256
  batch_size: int = 16
  block_size: int = 64
  steps: int = 2000
  lr: float = 1e-3
  warmup_steps: int = 100
  log_every: int = 20
  ckpt_every: int = 500


@dataclasses.dataclass(frozen=True)
class Base110M(_LMPreset):
  """python -m fpa_jax.train --config base110m --attention fpa --task text --steps 20000 --mesh data=8,model=1 --workdir runs/base_fpa

  The paper's scale: d_model 768, 12 layers, 12 heads, SwiGLU 2048, vocab 32000, tied embeddings
  (~110M parameters), 2048-token sequences, bf16 compute with fp32 params. Needs accelerators:
  expect ~20k steps x 0.5M tokens for a meaningful text run (accelerator-days). Not run on CPU.
  """

  name: str = "base110m"
  vocab_size: int = 32000
  d_model: int = 768
  n_layers: int = 12
  n_heads: int = 12
  d_ff: int = 2048
  tie_embeddings: bool = True
  seq_len: int = 2048
  batch_size: int = 256
  block_size: int = 256
  dtype: str = "bfloat16"
  tokenizer: str = "spm:32000"  # SentencePiece trained offline on fpa_text
  small_data: bool = False
  steps: int = 20000
  lr: float = 2e-3
  warmup_steps: int = 1000
  log_every: int = 50
  ckpt_every: int = 1000
  eval_every: int = 1000


CONFIGS: dict[str, type[Config]] = {"tiny": Tiny, "small": Small, "base110m": Base110M}


def get_config(name: str, **overrides: Any) -> Config:
  """A named preset with field overrides, validated. Unknown names/fields raise ValueError."""
  if name not in CONFIGS:
    raise ValueError(f"unknown config {name!r}; use one of {tuple(CONFIGS)}")
  cls = CONFIGS[name]
  fields = {f.name for f in dataclasses.fields(cls)}
  bad = sorted(set(overrides) - fields)
  if bad:
    raise ValueError(f"unknown config field(s) {bad}; valid fields: {sorted(fields)}")
  return cls(**overrides).validate()


def replace(config: Config, **overrides: Any) -> Config:
  return dataclasses.replace(config, **overrides).validate()


def parse_overrides(config_cls: type[Config], items: list[str]) -> dict[str, Any]:
  """['lr=3e-4', 'qk_norm=true'] -> typed dict using the dataclass field types."""
  hints = typing.get_type_hints(config_cls)
  out: dict[str, Any] = {}
  for item in items:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep:
      raise ValueError(f"--set expects key=value, got {item!r}")
    if key not in hints or key.startswith("_"):
      raise ValueError(
        f"unknown config field {key!r} in --set {item!r}; valid: {sorted(f.name for f in dataclasses.fields(config_cls))}"
      )
    out[key] = _parse_value(hints[key], raw.strip(), key)
  return out


def _parse_value(tp: Any, raw: str, key: str) -> Any:
  args = typing.get_args(tp)
  if type(None) in args:
    if raw.lower() in ("none", "null", ""):
      return None
    tp = next(a for a in args if a is not type(None))
  try:
    if tp is bool:
      if raw.lower() in ("1", "true", "yes", "on"):
        return True
      if raw.lower() in ("0", "false", "no", "off"):
        return False
      raise ValueError(raw)
    if tp is int:
      return int(raw)
    if tp is float:
      return float(raw)
    return raw
  except ValueError:
    raise ValueError(f"--set {key}={raw!r}: expected {getattr(tp, '__name__', tp)}") from None
