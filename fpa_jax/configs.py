"""Typed experiment configs: three frozen parts, combined into one flat run `Config`.

    from fpa_jax.configs import get_config
    from fpa_jax.models import build_model
    cfg = get_config("tiny", attention="fox", steps=100)
    cfg.lr, cfg.d_model                     # one flat namespace over all the fields
    model = build_model(cfg)                # the model keeps only cfg.model

- `ModelConfig`: the network and how it computes (sizes, attention and its gate, RoPE, init,
  attn_impl / block_size / skip_tolerance, matmul precision, dtypes, scan_layers / remat) and derived sizes (head_dim, ff_dim,
  gate_terms). It is all that the model side (`fpa_jax.models`, `layers`, `gates`, `inference`)
  sees: `DecoderLM(cfg)` keeps `cfg.model`, never the learning rate or the data directory.
- `DataConfig`: what `fpa_jax.data` feeds it (task, data_dir, tokenizer, small_data, seq_len,
  batch_size).
- `TrainConfig`: the run (preset name, steps, lr schedule incl. cooldown, AdamW, grad_accum, seed,
  mesh, log / checkpoint / eval cadence, the evictability objective `evict_*` (`fpa_jax.losses`), budget in the loop
  `budget_loop_*` (`fpa_jax.ops.budget`)).

`Config` inherits the three (every field belongs to exactly one part, `tests/test_configs.py`);
`cfg.model`, `cfg.data`, `cfg.train` return each part as its own dataclass. Each part validates its
own fields, `Config.validate` adds the checks across parts (batch_size vs grad_accum) and
`validate_mesh` those that need the mesh. A run's `config.json` (and a checkpoint's config item) is
the flat `Config.to_dict()`. Resuming compares the model fields in `resume_fields()`: all but
`FREE_ON_RESUME` (attn_impl, block_size, skip_tolerance, precision, dtype, remat and the init-only
fields may change).

Every field can be overridden on the command line with `--set key=value` (parsed with the field's
type) and the most common ones have their own flags (`--attention`, `--task`, `--steps`, `--mesh`).
The presets (`Tiny`, `Small`, `Base110M`) are `Config` subclasses with other defaults; each one's
docstring starts with its launch command.

Gate parameterisation (`fpa_jax.gates`), per head h and token t, from linear read-outs of x_t:
    field_t = cumsum(increment)_t + absolute_t,        level_t = field_t + offset_t
    fox   : increment = log sigmoid(w_f.x + b_f)              (<= 0: FoX; field = level, monotone)
    stack : increment = step_scale * (w_s.x + b_s)            (free sign: a shared walk)
    fpa   : as stack, + absolute = absolute_scale * (w_a.x + b_a), offset = offset_scale * (w_o.x + b_o)
    `gate_forget=True` adds FoX's log-sigmoid term to the stack/fpa increment (FoX as a start).

Why these defaults (issue 11's single-head studies, reproduced by `experiments.live_sets`):
- Free-sign increments, not "log sigmoid + bounded rise": a log-sigmoid term is strictly negative,
  so every token lowers the field a little and old live keys never get the weight of new ones;
  a nested-scope walk needs increments that are exactly 0 on content tokens, +/- on brackets.
- An absolute term: a cumulative field alone cannot say "this dip reaches value v" whatever came
  before, which the general case (levels set per key, dips set per token) needs in principle.
  At study 1's budget (head dim 16, 1500 steps) no gated head reaches coverage 0.95 on `dips`,
  and fpa without the absolute term scores about the same (`results/dips.md`, ablations); what
  limits FPA there is the head dim and the steps, not the parameterisation: at head dim 64 and
  3000 steps FPA reaches it on every seed while stack, FoX and softmax heads of that size reach
  it on none (`results/dips_limits.md`).
- Scales of 10 with near-zero initial weights: Adam moves the read-outs ~10x faster than a
  unit-scale weight, so penalties of tens of nats (hard forgetting) are reachable in a few hundred
  steps, while attention starts close to NoPE.
- Small random read-out weights (std 1e-3, all biases 0): with an all-zero gate the field is flat,
  every penalty is relu(0) and relu'(0) = 0, so no gradient ever reaches the gate (it stays NoPE
  forever). Random weights make the field a small random walk (10 * 1e-3 * sqrt(d_model) nats per
  token on RMS-normed inputs: 0.04 at d=16, 0.11 at d=128, 0.28 at d=768, all below FoX's initial
  0.69 = -log sigmoid(0)), so about half the pairs are active and every read-out learns from the
  first step. A uniform downward slope (step_bias_init < 0) breaks the tie too, but is a recency
  prior the walk must unlearn: with -1e-3 and zero weights, stack seed 1 of 5 stayed at coverage
  0.74 / 0.62 (1x / 2x) on scopes; random weights: 5/5 (`results/scopes.md`; both inits side by
  side in `results/ablations_live_sets.md`).

The language-model gate (`LM_GATE`, the basis of the LM presets `small` and `base110m`; issue 20,
`results/lm_ablations.md`): FoX's log-sigmoid term in the increment (`gate_forget`: the gate starts
as FoX at FoX's init) and the step / absolute / offset read-outs at scale 1. Byte LMs with the
single-head defaults above trained several percent worse than FoX, also when started at FoX's
init: the scale-10 read-outs move 10x faster under Adam, and in a language model that speed hurts
(most of all the step read-out, whose errors the cumulative sum carries forward). Scale 1 (or the
scale-10 read-outs at a tenth of the learning rate, `gate_lr_scale`) closes the gap; an all-zero
read-out init (relu's kink) does not (one row per hypothesis in the ablation table). The base defaults (and
`tiny`) stay the single-head ones (`SINGLE_HEAD_GATE`): hard forgetting within a few hundred steps
is what the synthetic live-set tasks need. Either set is a plain dict of overrides.
Those ablations predate the read-outs' side stream (`fpa_jax.gates`): an FPA model's other weights
then differed from the FoX model's of the same seed. `LM_WARM` is LM_GATE started as FoX exactly, with
the read-outs' learning rate ramped up from 0 (`gate_lr_warmup_steps`). On 3 seeds it trains to at or
below FoX's bits per byte, paired by seed (`perplexity`'s fpa_lm_warm), but on passkey it learned
retrieval well behind FoX. Part of the reason was the optimizer, not the gate: global-norm clipping
over all weights lets the read-outs' gradient (large from step 0, even at zero read-outs) shrink every
other weight's update, so FPA with still read-outs trained another trajectory than FoX
(`experiments.clip_coupling`). `LM_WARM_CLIP` clips the read-outs by their own norm
(`gate_clip_apart`), and `LM_FOX_FIRST` also ramps their lr to a tenth of the lr, not all of it. As
a language model it trains below FoX's bits per byte on every seed; on passkey its retrieval kept
FoX's pace until the read-outs learned to forget in the heads retrieval used (one seed of four
never learned it). `LM_FOX_HEAD`, the LM presets' default (`LM_DEFAULT`), holds the first kv head of
every layer at FoX's term alone (`fox_heads=1`: a head the read-outs cannot make forget): on passkey
its validation curve averaged over stages and seeds is at FoX's level, and as a language model at FoX's
bits per byte (README: Study 2's passkey pace, Study 4). It needs kv_heads >= 2; with one kv head
set fox_heads=0. Every gate preset is a dict of all of `GATE_PRESET_FIELDS`, so the study rows that
spread one keep the gate they were trained with when the presets' defaults change.

Depth (`scan_layers`, `remat`; same logits and gradients either way, `tests/test_scan.py`):
- scan_layers=True stores the blocks as one Block whose parameters have a leading [n_layers] axis
  (logical axis `layers`, never sharded) and runs them with `nnx.scan`: the step is traced and
  compiled once per block, not once per layer, so compile time stays flat in depth. Checkpoints
  differ in layout; `fpa_jax.models.convert_layers` moves weights between the two. Cached decoding
  (`fpa_jax.inference`) works on either (it loops over per-layer slices of the stack).
- remat wraps each block in `jax.checkpoint` with a policy: "none" (keep every activation),
  "full" (keep only the block input, recompute the rest in the backward pass), "dots" (keep
  matmul outputs, recompute elementwise work), "dots_no_batch" (keep only the weight matmuls'
  outputs, recompute the attention). Trades backward-pass FLOPs for activation memory. Use it with
  scan_layers: in an unrolled model XLA (CPU at least) schedules the recomputation back into the
  forward pass and the compiled memory does not drop; inside the scan's backward loop it must wait.
  Compile seconds and compiled temp memory of the base110m step for each combination:
  `python -m experiments.bench_train --scan` (results/bench_train.md, "Layer scan and remat").
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import typing
from typing import Any

from fpa_jax.ops import validate as _ops_validate

ATTENTIONS = ("fpa", "stack", "fox", "softmax", "nope")
GATED = ("fpa", "stack", "fox")
GATE_TERMS = ("forget", "step", "absolute", "offset")
TASKS = ("text", "passkey", "scopes", "dips")
TEST_TASKS = ("synthetic",)  # in-memory, for tests and benchmarks (fpa_jax.data.synthetic); nothing to build
ATTN_IMPLS = _ops_validate.IMPLS  # fpa_jax.ops impl names (one definition: ops.validate.Implementation)
DTYPES = ("float32", "bfloat16")
REMATS = ("none", "full", "dots", "dots_no_batch")  # per-block jax.checkpoint policies (fpa_jax.models.REMAT_POLICIES)
# jax.default_matmul_precision names: "default" is the backend's (bf16 passes for fp32 on TPU, TF32 on
# recent GPUs), "high" 3 bf16 passes (or TF32), "highest" full fp32. CPU computes fp32 exactly under each.
PRECISIONS = ("default", "high", "highest")


class _Part:
  """What every config part shares: its fields as a flat dict."""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _at_least(cfg, minimum: int, *names: str) -> None:
  """Integer fields >= minimum (a bool, float or string is an error too: `--set` parses ints, but
  `get_config(steps="10")` or a hand-edited config.json need not)."""
  for f in names:
    v = getattr(cfg, f)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      raise ValueError(f"{f}={v!r} must be an int >= {minimum}")
    if v < minimum:
      raise ValueError(f"{f} must be >= {minimum}, got {v}")


def _number(cfg, name: str, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False, why: str = "") -> None:
  """A finite real field in the interval [lo, hi] (open ends with lo_open / hi_open; None: unbounded);
  the error names the field, its value, the interval and `why` (what the field does / a usual value)."""
  v = getattr(cfg, name)
  ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
  if ok and lo is not None:
    ok = v > lo if lo_open else v >= lo
  if ok and hi is not None:
    ok = v < hi if hi_open else v <= hi
  if not ok:
    a, b = ("-inf" if lo is None else lo), ("inf" if hi is None else hi)
    interval = f"{'(' if lo_open or lo is None else '['}{a}, {b}{')' if hi_open or hi is None else ']'}"
    raise ValueError(f"{name}={v!r}: use a finite number in {interval}" + (f" ({why})" if why else ""))


def _flags(cfg, *names: str, optional: tuple[str, ...] = ()) -> None:
  """Bool fields (`optional`: bool or None); a string such as "false" would otherwise be truthy."""
  for f in names + optional:
    v = getattr(cfg, f)
    if not (isinstance(v, bool) or (v is None and f in optional)):
      raise ValueError(f"{f}={v!r} must be True or False" + (" (or None)" if f in optional else ""))


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Part):
  """The network and how it computes: all that `fpa_jax.models.DecoderLM` stores (as `model.cfg`)."""

  vocab_size: int = 256
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 2
  n_kv_heads: int = 0  # k/v heads and gates (grouped-query attention); 0 -> n_heads; divides n_heads
  d_ff: int = 0  # SwiGLU hidden dim; 0 -> round_up(8/3 * d_model, 64)
  attention: str = "fpa"  # one of ATTENTIONS
  # one of ATTN_IMPLS; auto = chunked on every backend (pallas is opt-in until its compiled path has passed on an
  # accelerator: README, "Verifying the Pallas kernels"); quadratic for debugging
  attn_impl: str = "auto"
  block_size: int = 0  # chunked tile size; 0 -> ops default (shrinks for short sequences)
  # None: exact. eps in (0, 1): the chunked kernel drops tiles whose every weight is <= eps / T
  # (each row loses <= eps of its attention, `fpa_jax.ops.chunked`); attn_impl chunked (or auto) only.
  skip_tolerance: float | None = None
  # what skip_tolerance drops: "tiles" (forward and backward) or "keys" (per query block, each key the
  # bound rules out; forward only: prefill and evaluation, `fpa_jax.ops.sparse`; training refuses it)
  skip: str = "tiles"
  precision: str = "default"  # one of PRECISIONS: fp32 matmul passes (TPU: default = bf16 passes)
  rope: bool | None = None  # None -> RoPE for softmax only (FoX/FPA gates give position info)
  rope_theta: float = 10000.0
  qk_norm: bool = False  # FoX "Pro": RMSNorm on q and k per head
  output_gate: bool = False  # FoX "Pro": o = o * sigmoid(W_g x) per head before W_o
  tie_embeddings: bool = False
  norm_eps: float = 1e-6
  init_std: float = 0.02
  # gate parameterisation / init (see module docstring and fpa_jax.gates); exposed for ablations
  gate_init_std: float = 0.02  # fox forget term: w_f ~ N(0, std) (FoX's init)
  gate_bias_init: float = 0.0  # fox forget term: b_f (FoX's init: 0)
  gate_forget: bool = False  # stack/fpa: add FoX's log-sigmoid term to the increment
  gate_terms_override: str = ""  # ablations: comma-separated read-outs from GATE_TERMS, replacing the default
  step_scale: float = 10.0  # stack/fpa increment = step_scale * (w_s.x + b_s)
  step_init_std: float = 1e-3  # > 0: a live gate at init (an all-zero gate gets no gradient; module docstring)
  step_bias_init: float = 0.0
  absolute_scale: float = 10.0  # fpa: field += absolute_scale * (w_a.x + b_a)
  absolute_init_std: float = 1e-3
  offset_scale: float = 10.0  # fpa: level = field + offset_scale * (w_o.x + b_o)
  offset_init_std: float = 1e-3
  offset_bias_init: float = 0.0
  # stack/fpa: the first N kv heads of every layer have no extremum read-outs (step, absolute and
  # offset held at 0): FoX heads with gate_forget, NoPE heads without; < kv_heads. A head the read-outs
  # cannot turn into a forgetting one, for retrieval (issue 20, passkey). 0 = every head has them;
  # no effect on fox / softmax / nope.
  fox_heads: int = 0
  dtype: str = "float32"  # compute dtype (bfloat16 for speed); params stay param_dtype
  param_dtype: str = "float32"
  # layer stacking / rematerialisation (module docstring, "Depth"): neither changes the maths
  scan_layers: bool = False  # blocks as one [n_layers, ...]-stacked Block run by nnx.scan
  remat: str = "none"  # one of REMATS: what a block keeps for the backward pass

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

  @property
  def gate_terms(self) -> tuple[str, ...]:
    """The read-outs of this attention's gate (`fpa_jax.gates`); () for softmax / nope."""
    if self.gate_terms_override and self.attention in GATED:
      return tuple(self.gate_terms_override.split(","))
    forget = ("forget",) if self.gate_forget else ()
    return {"fox": ("forget",), "stack": forget + ("step",), "fpa": forget + ("step", "absolute", "offset")}.get(
      self.attention, ()
    )

  def validate(self) -> ModelConfig:
    """Static checks (no devices needed); raises ValueError naming the field and what to change."""
    _at_least(self, 1, "vocab_size", "d_model", "n_layers", "n_heads")
    _at_least(self, 0, "d_ff", "block_size", "n_kv_heads")
    _flags(self, "qk_norm", "output_gate", "tie_embeddings", "gate_forget", "scan_layers", optional=("rope",))
    _number(self, "rope_theta", 0, lo_open=True, why="RoPE's base wavelength, e.g. 10000")
    _number(self, "norm_eps", 0, lo_open=True, why="RMSNorm's epsilon keeps an all-zero row finite, e.g. 1e-6")
    _number(self, "init_std", 0, lo_open=True, why="std of the weights' init; 0 gives a model with no gradient")
    for f in ("gate_init_std", "step_init_std", "absolute_init_std", "offset_init_std"):
      _number(self, f, 0, why="std of a gate read-out's init; 0 = zero weights")
    for f in ("step_scale", "absolute_scale", "offset_scale"):
      _number(
        self, f, 0, lo_open=True, why="a gate term's scale: 10 single-head, 1 in the LM presets (module docstring)"
      )
    for f in ("gate_bias_init", "step_bias_init", "offset_bias_init"):
      _number(self, f, why="a gate read-out's initial bias")
    if self.n_heads % self.kv_heads:
      raise ValueError(
        f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (each kv head serves "
        f"n_heads / n_kv_heads query heads); use a divisor of {self.n_heads}, or 0 for n_heads"
      )
    if self.attention not in ATTENTIONS:
      raise ValueError(f"unknown attention {self.attention!r}; use one of {ATTENTIONS}")
    if self.attn_impl not in ATTN_IMPLS:
      raise ValueError(f"unknown attn_impl {self.attn_impl!r}; use one of {ATTN_IMPLS}")
    if self.d_model % self.n_heads:
      raise ValueError(
        f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
        f"change one of them (e.g. --set n_heads={_divisor_hint(self.d_model, self.n_heads)})"
      )
    if self.use_rope and self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}; change d_model or n_heads")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in DTYPES:
        raise ValueError(f"{f}={getattr(self, f)!r}; use one of {DTYPES}")
    if self.remat not in REMATS:
      raise ValueError(
        f"unknown remat policy {self.remat!r}; use one of {REMATS} "
        "('none' keeps every activation, 'full' only each block's input)"
      )
    bad_terms = set(self.gate_terms) - set(GATE_TERMS)
    if bad_terms or (self.attention in GATED and not self.gate_terms):
      raise ValueError(
        f"gate_terms_override={self.gate_terms_override!r}: use a comma-separated subset of "
        f"{GATE_TERMS}, e.g. 'step,offset'"
      )
    if isinstance(self.fox_heads, bool) or not isinstance(self.fox_heads, int) or self.fox_heads < 0:
      raise ValueError(f"fox_heads={self.fox_heads!r}: use an int >= 0 (0 = every head has the read-outs)")
    # without extremum read-outs (fox, softmax, nope) there is nothing to hold: fox_heads has no effect,
    # so a preset's value does not stop `--set attention=fox`
    if set(self.gate_terms) - {"forget"} and self.fox_heads >= self.kv_heads:
      raise ValueError(
        f"fox_heads={self.fox_heads} must be < kv_heads={self.kv_heads} (at least one head with the "
        f"read-outs): set fox_heads={max(self.kv_heads - 1, 0)} (the LM presets hold one head), or "
        "attention='fox' for every head at FoX's term"
      )
    if self.block_size and self.attn_impl not in _ops_validate.BLOCKED:
      raise ValueError(f"block_size only applies to attn_impl in {_ops_validate.BLOCKED}; set block_size=0")
    if self.skip_tolerance is not None:
      eps = self.skip_tolerance
      if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < eps < 1.0:
        raise ValueError(f"skip_tolerance={eps!r}: use None (exact) or a float in (0, 1), e.g. 1e-3")
      if self.attn_impl not in ("chunked", "auto"):
        raise ValueError(
          f"skip_tolerance only applies to the chunked kernel, got attn_impl={self.attn_impl!r}; "
          "set attn_impl='chunked' or skip_tolerance=None"
        )
    if self.skip not in _ops_validate.SKIPS:
      raise ValueError(f"skip={self.skip!r}: use one of {_ops_validate.SKIPS}")
    if self.skip == "keys" and self.skip_tolerance is None:
      raise ValueError("skip='keys' drops keys under a tolerance: set skip_tolerance (e.g. 1e-3) or skip='tiles'")
    if self.precision not in PRECISIONS:
      raise ValueError(f"unknown precision {self.precision!r}; use one of {PRECISIONS}")
    return self


# Model fields a resumed run may change: how the model computes (kernel, tiles, compute dtype, remat)
# or how its parameters started (a restore replaces them). Every other model field sets the
# parameters' shapes, layout (scan_layers) or what they compute (scales, RoPE, norm eps), so
# `fpa_jax.train` refuses to resume a checkpoint across it (`resume_fields`).
FREE_ON_RESUME = frozenset(
  {
    "attn_impl",
    "block_size",
    "skip_tolerance",
    "skip",
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
  }
)


def resume_fields() -> tuple[str, ...]:
  """The ModelConfig fields a checkpoint must agree on to resume (every new field is, by default)."""
  return tuple(f for f in ModelConfig.field_names() if f not in FREE_ON_RESUME)


@dataclasses.dataclass(frozen=True)
class DataConfig(_Part):
  """What the model is trained on: `fpa_jax.data.make_pipeline`'s task, source and batch shape."""

  task: str = "text"  # one of TASKS
  data_dir: str = "data"
  tokenizer: str = "bytes"  # bytes | spm | spm:N (fpa_jax.data.tokenizers)
  small_data: bool = False
  seq_len: int = 64
  batch_size: int = 8  # global batch (sequences per optimizer step)
  # text only: "stdlib" (offline default), a local directory of UTF-8 files, or "tfds:NAME" (prepared)
  text_source: str = "stdlib"
  # text only: windows of the fixed held-out set (fpa_jax.data.make_heldout): one inside every
  # validation document, the rest spread by length; the trainer's periodic eval scores all of them
  heldout_windows: int = 256

  @property
  def data(self) -> DataConfig:
    return self

  def validate(self) -> DataConfig:
    if self.task not in TASKS + TEST_TASKS:
      raise ValueError(f"unknown task {self.task!r}; use one of {TASKS}")
    if not re.fullmatch(r"bytes|spm(:\d+)?", self.tokenizer):
      raise ValueError(f"unknown tokenizer {self.tokenizer!r}; use 'bytes', 'spm' or 'spm:N' (see fpa_jax.data)")
    _at_least(self, 1, "seq_len", "batch_size", "heldout_windows")
    _flags(self, "small_data")
    if not self.text_source:
      raise ValueError("text_source is empty; use 'stdlib', a directory path, or 'tfds:NAME'")
    return self


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Part):
  """The run: its preset name, optimisation (AdamW, lr schedule), loop cadence, mesh and seed."""

  name: str = "base"  # the preset (CONFIGS key) the run started from
  # ---- optimisation ----
  steps: int = 100
  lr: float = 1e-3
  min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
  warmup_steps: int = 10
  lr_decay_steps: int = 0  # cosine horizon; 0 -> `steps`. Fix it to extend runs exactly.
  cooldown_steps: int = 0  # WSD: the last N of `steps` decay linearly to 0 (anneal a constant-lr run)
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  clip_norm: float = 1.0  # global-norm clipping; 0 disables
  # multiplies the lr of the FPA gate's step / absolute / offset read-outs (not FoX's forget term):
  # they are scale * (w.x + b) with scale 10, so Adam moves their output ~10x faster (issue 20)
  gate_lr_scale: float = 1.0
  # the read-outs' lr multiplier ramps linearly from 0 to gate_lr_scale over these steps; 0 = none.
  # With read-outs started at 0 (FoX's init) the model is FoX until the read-outs move (issue 20)
  gate_lr_warmup_steps: int = 0
  # clip the read-outs' gradient by its own global norm, apart from the other weights': with one
  # norm their gradient shrinks every other update, so even frozen read-outs change the run (issue 20)
  gate_clip_apart: bool = False
  grad_accum: int = 1  # micro-batches per step (batch_size must divide)
  seed: int = 0  # parameter init and data order
  # ---- loop ----
  mesh: str = ""  # e.g. "data=4,model=2"; "" -> all devices on data
  log_every: int = 10
  ckpt_every: int = 100
  keep_checkpoints: int = 3
  eval_every: int = 0  # 0 disables periodic validation loss
  eval_batches: int = 4  # batches per eval for tasks other than text (text: the held-out windows, `heldout_windows`)
  # ---- evictability objective (fpa_jax.losses; off at evict_weight 0: the exact LM loss) ----
  evict_weight: float = 0.0  # weight of the hinge on the soft live fraction of old keys
  evict_target: float = 0.25  # final kept fraction of the keys outside the window, in (0, 1)
  evict_ramp_steps: int = 0  # DMS ramp of the compression ratio 1 -> 1/evict_target; 0 = no ramp
  evict_ramp_start: int = 0  # optimizer step the ramp starts at (retrofitting a trained run: its step)
  evict_window: int = 16  # recent window W: keys j > i - W are never counted (always kept)
  evict_tau: float = 4.0  # penalty (nats) at which a key counts as half evicted
  evict_temp: float = 1.0  # sigmoid width (nats) of the soft count
  evict_soft: float = 0.5  # softplus temperature of the penalty in the objective (0 = exact relu)
  evict_queries: int = 8  # sampled queries per sequence and step (stratified over the positions)
  # ---- budget in the loop (fpa_jax.ops.budget; off at budget_loop_prob 0) ----
  # A share of the steps trains through the cache an `fpa_budget` decode of a random size would keep:
  # capacity round(rho * seq_len), rho ~ U[budget_loop_min, budget_loop_max], recent = capacity // 8.
  # Those steps run the quadratic attention (O(T^2) memory) whatever attn_impl says.
  budget_loop_prob: float = 0.0  # share of the steps with a random cache budget; 0 = off
  budget_loop_min: float = 0.1  # smallest budget, a fraction of the training length, in (0, 1]
  budget_loop_max: float = 0.5  # largest budget, in [budget_loop_min, 1]

  @property
  def train(self) -> TrainConfig:
    return self

  @property
  def decay_steps(self) -> int:
    return self.lr_decay_steps or self.steps

  def validate(self) -> TrainConfig:
    _at_least(self, 1, "steps", "grad_accum", "log_every", "ckpt_every", "keep_checkpoints", "eval_batches")
    _at_least(self, 0, "warmup_steps", "lr_decay_steps", "eval_every", "cooldown_steps", "seed")
    _number(self, "lr", 0, lo_open=True, why="the peak learning rate, e.g. 1e-3")
    _number(self, "min_lr_ratio", 0, 1, why="the cosine ends at lr * min_lr_ratio; 1 = constant after warmup")
    _number(self, "b1", 0, 1, hi_open=True, why="AdamW's first-moment decay, e.g. 0.9")
    _number(self, "b2", 0, 1, hi_open=True, why="AdamW's second-moment decay, e.g. 0.95")
    _number(self, "weight_decay", 0, why="AdamW's decoupled weight decay; 0 disables")
    _number(self, "clip_norm", 0, why="global-norm gradient clipping; 0 disables")
    _number(self, "gate_lr_scale", 0, lo_open=True, why="the gate read-outs' lr multiplier; 1 = the same lr")
    if isinstance(self.gate_lr_warmup_steps, bool) or not isinstance(self.gate_lr_warmup_steps, int):
      raise ValueError(f"gate_lr_warmup_steps={self.gate_lr_warmup_steps!r}: use an int >= 0 (0 = no ramp)")
    if self.gate_lr_warmup_steps < 0:
      raise ValueError(f"gate_lr_warmup_steps={self.gate_lr_warmup_steps}: use an int >= 0 (0 = no ramp)")
    if not isinstance(self.gate_clip_apart, bool):
      raise ValueError(f"gate_clip_apart={self.gate_clip_apart!r}: use True or False")
    if self.warmup_steps > self.decay_steps:
      horizon = "lr_decay_steps" if self.lr_decay_steps else "steps"
      raise ValueError(
        f"warmup_steps={self.warmup_steps} is longer than the lr schedule ({horizon}={self.decay_steps}), "
        f"so the warmup would be cut short: use warmup_steps <= {self.decay_steps} (e.g. --set "
        f"warmup_steps={self.decay_steps // 10}), or a larger {horizon}"
      )
    if not 0 <= self.cooldown_steps < self.steps:
      raise ValueError(f"cooldown_steps={self.cooldown_steps} must be in [0, steps={self.steps})")
    self._validate_evict()
    return self

  def _validate_evict(self) -> None:
    """The evict_* block (checked whether the objective is on or not: a bad value is a typo)."""
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    for f in ("evict_weight", "evict_target", "evict_tau", "evict_temp", "evict_soft"):
      if not num(getattr(self, f)):
        raise ValueError(f"{f}={getattr(self, f)!r} must be a finite number")
    if self.evict_weight < 0:
      raise ValueError(f"evict_weight={self.evict_weight} must be >= 0 (0 turns the objective off)")
    if not 0.0 < self.evict_target < 1.0:
      raise ValueError(f"evict_target={self.evict_target} is the kept fraction of old keys: use a value in (0, 1)")
    if not self.evict_temp > 0:
      raise ValueError(f"evict_temp={self.evict_temp} must be > 0 (the soft count's width in nats)")
    if self.evict_soft < 0:
      raise ValueError(f"evict_soft={self.evict_soft} must be >= 0 (0 = exact relu penalty)")
    _at_least(self, 0, "evict_window", "evict_ramp_steps", "evict_ramp_start")
    _at_least(self, 1, "evict_queries")
    _number(self, "budget_loop_prob", 0, 1, why="the share of steps trained with a random cache budget; 0 = off")
    _number(self, "budget_loop_min", 0, 1, lo_open=True, why="the smallest budget, a fraction of seq_len")
    _number(self, "budget_loop_max", 0, 1, lo_open=True, why="the largest budget, a fraction of seq_len")
    if self.budget_loop_min > self.budget_loop_max:
      raise ValueError(
        f"budget_loop_min={self.budget_loop_min} > budget_loop_max={self.budget_loop_max}: the budget is drawn "
        "uniformly between them, so use min <= max"
      )


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

  def validate(self) -> Config:
    """Each part's checks, then those across parts (no devices needed); raises ValueError."""
    for part in (self.model, self.data, self.train):
      part.validate()
    if self.batch_size % self.grad_accum:
      raise ValueError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
    if self.evict_weight > 0 and self.attention not in GATED:
      raise ValueError(f"evict_weight > 0 needs a gated attention {GATED}, got {self.attention!r}; set evict_weight=0")
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


# The fields a gate preset sets (module docstring): the gate's terms and scales, the read-outs' init
# and their learning rate. Every preset below is a plain dict of all of them, so a study row that
# spreads one is pinned whatever the presets' defaults become.
GATE_PRESET_FIELDS = (
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
)
_BASE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
# the base defaults (and `tiny`'s): the single-head studies' gate
SINGLE_HEAD_GATE: dict[str, Any] = {k: _BASE_DEFAULTS[k] for k in GATE_PRESET_FIELDS}
# FoX's term + read-outs at scale 1 (small random read-outs, the full lr): the gate the lm_ablations
# table led to, and every LM study row trained before LM_WARM (issue 20)
LM_GATE: dict[str, Any] = {
  **SINGLE_HEAD_GATE,
  "gate_forget": True,
  "step_scale": 1.0,
  "absolute_scale": 1.0,
  "offset_scale": 1.0,
}
# LM_GATE started as FoX exactly (zero read-outs; the other weights are FoX's since the read-outs'
# side stream) with the read-outs' learning rate ramped up from 0 over 1200 steps: FoX first
# (`perplexity`'s fpa_lm_warm, `passkey`'s fpa_lm5_warm).
LM_WARM: dict[str, Any] = {
  **LM_GATE,
  "step_init_std": 0.0,
  "absolute_init_std": 0.0,
  "offset_init_std": 0.0,
  "gate_lr_warmup_steps": 1200,
}
# ... with the read-outs' gradient clipped by its own norm (`gate_clip_apart`): under one global norm
# it shrank every other weight's update, so even FPA with still read-outs trained unlike FoX.
LM_WARM_CLIP: dict[str, Any] = {**LM_WARM, "gate_clip_apart": True}
# ... and the read-outs' lr ramped to a tenth of the lr, not all of it: FoX first, the extremum
# read-outs after and slower.
LM_FOX_FIRST: dict[str, Any] = {**LM_WARM_CLIP, "gate_lr_scale": 0.1}
# ... with the first kv head of every layer held at FoX's term (`fox_heads`): a head the read-outs
# cannot make forget, for retrieval. The LM presets' default (module docstring).
LM_FOX_HEAD: dict[str, Any] = {**LM_FOX_FIRST, "fox_heads": 1}
# The LM presets' default (`small`, `base110m`; module docstring).
LM_DEFAULT: dict[str, Any] = LM_FOX_HEAD


@dataclasses.dataclass(frozen=True)
class _LMPreset(Config):
  """The LM presets' gate: LM_DEFAULT (module docstring)."""

  gate_forget: bool = LM_DEFAULT["gate_forget"]
  step_scale: float = LM_DEFAULT["step_scale"]
  absolute_scale: float = LM_DEFAULT["absolute_scale"]
  offset_scale: float = LM_DEFAULT["offset_scale"]
  step_init_std: float = LM_DEFAULT["step_init_std"]
  absolute_init_std: float = LM_DEFAULT["absolute_init_std"]
  offset_init_std: float = LM_DEFAULT["offset_init_std"]
  gate_lr_scale: float = LM_DEFAULT["gate_lr_scale"]
  gate_lr_warmup_steps: int = LM_DEFAULT["gate_lr_warmup_steps"]
  gate_clip_apart: bool = LM_DEFAULT["gate_clip_apart"]
  fox_heads: int = LM_DEFAULT["fox_heads"]


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
