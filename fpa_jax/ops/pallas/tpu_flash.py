"""Long-sequence Pallas TPU kernels for FPA and FoX: every operand streamed one tile per grid step.

`kernels.py` holds the looped-over operand (k / v in the forward and dQ kernels, q / dO in dK / dV)
as one whole-T block per (batch, head), which must fit in VMEM: at T = 32768 that is tens of MiB,
past the default scoped limit (`whole_vmem_bytes`). These kernels have the form of JAX's Pallas
TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`): a 4-D grid whose last
axis n walks the other side's blocks, one tile fetched per step by the BlockSpec pipeline, with
the running sums in VMEM scratch (`pltpu.VMEM`) initialised at n == 0 and written at the last n:

  forward  grid (B, H, query block I, n): key block J = I at n = 0 (the diagonal first: the online
           softmax's running max is finite from its first tile, as in `kernels.py`), then
           J = 0 .. I - 1; m, l [blk, 1] and acc [blk, Kv] in scratch; out and logsumexp.
  dK / dV  grid (B, KVH, key block J, n): query block I = J + n (the group's G query heads as a
           [G, blk, .] block); dK, dV in scratch, the key-stat cotangents and dR[:, J] summed in
           their resident output blocks.
  dQ       grid (B, H, query block I, n): key blocks as in the forward; dQ in scratch, the
           query-stat cotangents in their resident output block.

n is sequential ("arbitrary"), the other axes parallel. Causal block skipping: the steps past a
program's last causal block do no work (`pl.when`), and their index maps repeat the last block
fetched, so the pipeline issues no copy for them (jax's flash attention prefetches block 0
instead; here the next program starts at its own diagonal). The bias is `kernels.py`'s: per-token
stat tiles (`tile_bias.py`, the bias protocol's `kernel_stats`) and, for FPA off the diagonal,
the between-tile minimum R[I, J] of `first_passage.block_stats`, computed outside the kernels per
block pair ([B, KVH, nb, nb]) and read as the [1, nb] row R[I, :] (R[:, J] in dK / dV) of a small
VMEM block that stays resident along n. FoX's bias c_i - c_j needs no R. Grouped-query heads:
the forward / dQ index maps send query head h to kv head h // G, and dK / dV run over kv heads,
looping over the group inside the program (the tile bodies of `common.py`, shared with
`kernels.py` and `block_sparse.py`). Segment ids: a [blk, 1] / [1, blk] tile per step.

VMEM: every block is one tile, so the footprint does not grow with T except through R's row
(4 nb bytes, padded to 8 sublanes). `vmem_bytes` computes it from the kernels' own block specs
(`_plan`, the one source of the pallas_calls' specs): two buffers per pipelined input and output
block plus the scratch, each padded to the (8 * 4 / itemsize, 128) VMEM tile, plus a margin for the
tile-sized fp32 temporaries of the body. At T = 131072, D = 128 and 128-token tiles that is about
1-2 MiB per kernel, against `SCOPED_VMEM_LIMIT` (tests/ops/pallas/test_tpu_flash.py).

The reference is `chunked.chunked_attention` at the same tile (the same tiles, the same stats);
values and gradients are checked against it in the TPU interpreter (`interpret=pltpu.InterpretParams()`,
which models VMEM / SMEM and the pipeline's DMAs) and the kernels lower for Mosaic on CPU
(`lowering.lower_for`). Status: not run compiled on a TPU. Not done: non-square tiles (the
tiling identity's blocks are shared by queries and keys), the skip_tolerance tile lists
(`block_sparse.py` holds them flat in SMEM, which does not scale to long T), GPU (Triton has no
sequential grid axis with scratch: `kernels.py` there).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fpa_jax.ops.bias import Bias, FoXBias, FPABias
from fpa_jax.ops.common import F32, BlockSizes
from fpa_jax.ops.first_passage import n_levels
from fpa_jax.ops.pallas import common as pc

MiB = 1 << 20
# The default scoped VMEM limit a Mosaic kernel may use unless it sets
# `pltpu.CompilerParams(vmem_limit_bytes=...)` (raised globally by XLA's
# --xla_tpu_scoped_vmem_limit_kib), per TPU generation (`jax.Device.device_kind`). 16 MiB is the
# commonly quoted default for v4, v5e and v5p; newer generations are reported to default higher
# (32 MiB) but we found no source to confirm it, so every entry is the conservative 16 MiB. The
# physical VMEM is larger (jax's `pltpu` TpuInfo: 16 MiB on v4, 128 MiB on v5e / v6e, 64 MiB on
# v5p / 7x).
DEFAULT_SCOPED_VMEM = {
  "TPU v4": 16 * MiB,
  "TPU v5 lite": 16 * MiB,  # v5e
  "TPU v5p": 16 * MiB,
  "TPU v6 lite": 16 * MiB,  # v6e: unconfirmed, see above
  "TPU7x": 16 * MiB,  # unconfirmed, see above
}
SCOPED_VMEM_LIMIT = min(DEFAULT_SCOPED_VMEM.values())
# Tile-sized fp32 temporaries of a kernel body (logits, bias, p, ds, the diagonal's sparse-table
# mins, ...) that Mosaic may spill from vregs to VMEM: a margin counted in `vmem_bytes`.
TEMP_TILES = 16

Pass = Literal["fwd", "dkv", "dq"]
PASSES: tuple[str, ...] = get_args(Pass)
_LANES = 128


# ----------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class _Cfg(pc.Cfg):
  params: Any = None  # a pltpu.InterpretParams: the TPU interpreter, else `interpret` (bool)

  def run(self, kernel, plan, name, args):
    params = None
    if self.backend == "tpu":  # n carries the accumulators: sequential
      params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=0,
      grid=plan.grid,
      in_specs=[s for s, _ in plan.ins],
      out_specs=[s for s, _ in plan.outs],
      scratch_shapes=plan.scratch,
    )
    interpret = self.params if self.params is not None else self.interpret
    return pl.pallas_call(
      kernel,
      grid_spec=spec,
      out_shape=[o for _, o in plan.outs],
      interpret=interpret,
      compiler_params=params,
      name=name,
    )(*args)


# The walks of the n axis (kernels and index maps alike; x the program's own block).
def _kv_walk(x, n):
  """Key block of step n for query block x (forward, dQ): x at n = 0, then n - 1 for n <= x; later
  steps repeat the last one fetched (x - 1, or x for x = 0): no copy."""
  return jnp.where(n == 0, x, jnp.minimum(n - 1, jnp.maximum(x - 1, 0)))


def _q_walk(x, n, nb):
  """Query block of step n for key block x (dK / dV): x + n, held at the last block once past it."""
  return jnp.minimum(x + n, nb - 1)


def _walk(n, live, start, tile, finish):
  """start() and the diagonal tile at n = 0, an off-diagonal tile at each later live step, finish()
  at the last step (the same schedule as `block_sparse._walk`, with the walk computed, not listed)."""

  @pl.when(n == 0)
  def _():
    start()
    tile(True)

  @pl.when((n > 0) & live)
  def _():
    tile(False)

  @pl.when(n == pl.num_programs(3) - 1)
  def _():
    finish()


def _terms(cfg, blk, krow_ref, qcol_ref, r_ref, qseg_ref, kseg_ref, other, diag):
  """The tile's (bias, mask, pull) (`common.tile_terms`) from one-tile stat refs; `other` is the
  walked block, the entry of the resident R row this tile reads off the diagonal."""
  r = pc.pick(r_ref[...], other) if r_ref is not None and not diag else None
  qseg, kseg = (None, None) if qseg_ref is None else (qseg_ref[...], kseg_ref[...])
  kvec, qvec = (lambda m: krow_ref[m : m + 1, :]), (lambda m: qcol_ref[:, m : m + 1])
  return pc.tile_terms(cfg, blk, kvec, qvec, r, qseg, kseg, diag)


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(*refs, cfg, blk, has_r, has_seg):
  # Reference: chunked._forward (one query block's online softmax over its causal key blocks).
  # q, qcol, qseg, r (R[I, :]): query block I; k, v, krow, kseg: key block J = _kv_walk(I, n).
  (q_ref, k_ref, v_ref, krow_ref, qcol_ref), r_ref, qseg_ref, kseg_ref, rest = pc.unpack(refs, 5, has_r, has_seg)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  i, n = pl.program_id(2), pl.program_id(3)
  j = _kv_walk(i, n)

  def tile(diag):
    bias, mask, _ = _terms(cfg, blk, krow_ref, qcol_ref, r_ref, qseg_ref, kseg_ref, j, diag)
    s, v = pc.masked_logits(cfg, q_ref[...], k_ref[...], bias, mask), v_ref[...]
    state = pc.softmax_start(s, v) if diag else pc.softmax_step((m_sc[...], l_sc[...], acc_sc[...]), s, v)
    m_sc[...], l_sc[...], acc_sc[...] = state

  def finish():
    o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
    lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])

  _walk(n, n <= i, lambda: None, tile, finish)


def _dkv_kernel(*refs, cfg, blk, nb, has_r, has_seg):
  # Reference: chunked._core_bwd's k_block (key block J against query blocks I >= J), dK / dV part.
  # Grid (B, KVH, J, n). k, v, krow, kseg, r (R[:, J]): key block J of kv head h; q, dO, lse, delta
  # ([G, blk, .]: the group's query heads), qcol, qseg: query block I = _q_walk(J, n).
  fixed, r_ref, qseg_ref, kseg_ref, outs = pc.unpack(refs, 8, has_r, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, krow_ref, qcol_ref = fixed
  dk_ref, dv_ref, dkrow_ref = outs[:3]
  dr_ref = outs[3] if has_r else None
  dk_sc, dv_sc = outs[-2:]
  j, n = pl.program_id(2), pl.program_id(3)
  i = _q_walk(j, n, nb)

  def start():
    dk_sc[...], dv_sc[...] = jnp.zeros(dk_sc.shape, F32), jnp.zeros(dv_sc.shape, F32)
    dkrow_ref[...] = jnp.zeros(dkrow_ref.shape, F32)  # resident along n: the sum's buffer
    if has_r:
      dr_ref[...] = jnp.zeros(dr_ref.shape, F32)

  def tile(diag):
    terms = _terms(cfg, blk, krow_ref, qcol_ref, r_ref, qseg_ref, kseg_ref, i, diag)
    heads = lambda g: (q_ref[g], do_ref[g], lse_ref[g], delta_ref[g])
    dk, dv, rows, d_r = pc.dkv_tile(cfg, terms, k_ref[...], v_ref[...], heads, dk_sc[...], dv_sc[...])
    dk_sc[...], dv_sc[...] = dk, dv
    for m, x in rows.items():
      dkrow_ref[m : m + 1, :] += x
    if d_r is not None:
      dr_ref[...] = pc.add_r_cotangent(dr_ref[...], d_r, i)

  def finish():
    dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

  _walk(n, j + n < nb, start, tile, finish)


def _dq_kernel(*refs, cfg, blk, has_r, has_seg):
  # Reference: chunked._core_bwd's dq sums (query block I against key blocks J <= I).
  # q, dO, lse, delta, qcol, qseg, r (R[I, :]): query block I; k, v, krow, kseg: J = _kv_walk(I, n).
  fixed, r_ref, qseg_ref, kseg_ref, (dq_ref, dqcol_ref, dq_sc) = pc.unpack(refs, 8, has_r, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, krow_ref, qcol_ref = fixed
  i, n = pl.program_id(2), pl.program_id(3)
  j = _kv_walk(i, n)

  def start():
    dq_sc[...] = jnp.zeros(dq_sc.shape, F32)
    dqcol_ref[...] = jnp.zeros(dqcol_ref.shape, F32)

  def tile(diag):
    terms = _terms(cfg, blk, krow_ref, qcol_ref, r_ref, qseg_ref, kseg_ref, j, diag)
    rows = (q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], delta_ref[...])
    dq, cols = pc.dq_tile(cfg, terms, *rows)
    dq_sc[...] += dq
    for m, x in cols.items():
      dqcol_ref[:, m : m + 1] += x

  def finish():
    dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)

  _walk(n, n <= i, start, tile, finish)


# ----------------------------------------------------------------------------- block specs


class _Dims(NamedTuple):
  """What the block specs depend on: batch, grid heads' source (h query heads, g = H / KVH), the
  padded length, head dims, q / k / v dtype, stat counts (krow rows, qcol columns), optional inputs."""

  b: int
  h: int
  g: int
  tp: int
  d: int
  dv: int
  dtype: Any
  nr: int
  nc: int
  has_r: bool
  has_seg: bool


class _Plan(NamedTuple):
  grid: tuple
  ins: list  # (BlockSpec, dtype) per input, in the kernel's ref order
  outs: list  # (BlockSpec, ShapeDtypeStruct) per output
  scratch: list  # pltpu.VMEM


def _spec(shape, index):
  return pl.BlockSpec((None, None) + shape, index)


def _plan(kind: Pass, dm: _Dims, blk: int) -> _Plan:
  """The grid, BlockSpecs and scratch of one kernel: what `_forward` / `_backward` call and what
  `vmem_bytes` sums. Index maps take (b, h, x, n): x the program's own block, n the walk."""
  b, h, g, tp, d, dv, dt = dm.b, dm.h, dm.g, dm.tp, dm.d, dm.dv, dm.dtype
  nb = tp // blk
  row = pl.BlockSpec((None, None, None, 1, nb), lambda b, h, x, n: (b, h // (1 if kind == "dkv" else g), x, 0, 0))
  if kind in ("fwd", "dq"):
    own = lambda c, gg=1: _spec((blk, c), lambda b, h, x, n: (b, h // gg, x, 0))
    walked = lambda c: _spec((blk, c), lambda b, h, x, n: (b, h // g, _kv_walk(x, n), 0))
    krow = _spec((dm.nr, blk), lambda b, h, x, n: (b, h // g, 0, _kv_walk(x, n)))
    seg = [
      (pl.BlockSpec((None, blk, 1), lambda b, h, x, n: (b, x, 0)), jnp.int32),
      (pl.BlockSpec((None, 1, blk), lambda b, h, x, n: (b, 0, _kv_walk(x, n))), jnp.int32),
    ]
    if kind == "fwd":
      ins = [(own(d), dt), (walked(d), dt), (walked(dv), dt), (krow, F32), (own(dm.nc, g), F32)]
      outs = [(own(dv), jax.ShapeDtypeStruct((b, h, tp, dv), dt)), (own(1), jax.ShapeDtypeStruct((b, h, tp, 1), F32))]
      scratch = [pltpu.VMEM((blk, 1), F32), pltpu.VMEM((blk, 1), F32), pltpu.VMEM((blk, dv), F32)]
    else:
      ins = [(own(d), dt), (walked(d), dt), (walked(dv), dt), (own(dv), dt), (own(1), F32), (own(1), F32)]
      ins += [(krow, F32), (own(dm.nc, g), F32)]
      outs = [
        (own(d), jax.ShapeDtypeStruct((b, h, tp, d), dt)),
        (own(dm.nc), jax.ShapeDtypeStruct((b, h, tp, dm.nc), F32)),
      ]
      scratch = [pltpu.VMEM((blk, d), F32)]
    grid = (b, h, nb, nb)
  else:  # dkv: grid over kv heads; the group's query heads as one [G, blk, .] block
    kvh = h // g
    own = lambda c: _spec((blk, c), lambda b, h, x, n: (b, h, x, 0))
    group = lambda c: pl.BlockSpec((None, g, blk, c), lambda b, h, x, n: (b, h, _q_walk(x, n, nb), 0))
    krow = _spec((dm.nr, blk), lambda b, h, x, n: (b, h, 0, x))
    qcol = _spec((blk, dm.nc), lambda b, h, x, n: (b, h, _q_walk(x, n, nb), 0))
    seg = [
      (pl.BlockSpec((None, blk, 1), lambda b, h, x, n: (b, _q_walk(x, n, nb), 0)), jnp.int32),
      (pl.BlockSpec((None, 1, blk), lambda b, h, x, n: (b, 0, x)), jnp.int32),
    ]
    ins = [(group(d), dt), (own(d), dt), (own(dv), dt), (group(dv), dt), (group(1), F32), (group(1), F32)]
    ins += [(krow, F32), (qcol, F32)]
    outs = [
      (own(d), jax.ShapeDtypeStruct((b, kvh, tp, d), dt)),
      (own(dv), jax.ShapeDtypeStruct((b, kvh, tp, dv), dt)),
      (krow, jax.ShapeDtypeStruct((b, kvh, dm.nr, tp), F32)),
    ]
    if dm.has_r:
      outs.append((row, jax.ShapeDtypeStruct((b, kvh, nb, 1, nb), F32)))
    scratch = [pltpu.VMEM((blk, d), F32), pltpu.VMEM((blk, dv), F32)]
    grid = (b, kvh, nb, nb)
  if dm.has_r:
    ins.append((row, F32))
  if dm.has_seg:
    ins += seg
  return _Plan(grid, ins, outs, scratch)


def _dims(q, k, v, st, seg):
  krow, qcol, r, nr, nc = pc.stats_dims(st)
  b, h, tp, d = q.shape
  return _Dims(b, h, h // k.shape[1], tp, d, v.shape[-1], q.dtype, nr, nc, r is not None, seg is not None)


# ----------------------------------------------------------------------------- pallas_calls


def _args(fixed, r, seg):
  """The operands in `_plan`'s (and `common.unpack`'s) order: fixed, R's rows, the segment ids."""
  return fixed + ([] if r is None else [r]) + ([] if seg is None else list(seg))


def _forward(cfg, q, k, v, st, seg):
  """q [B, H, Tp, K], k [B, KVH, Tp, K], v [B, KVH, Tp, Kv], stats per kv head -> (o [B, H, Tp, Kv],
  lse [B, H, Tp, 1] fp32)."""
  krow, qcol, r, _, _ = pc.stats_dims(st)
  nb = q.shape[2] // cfg.fwd
  args = _args([q, k, v, krow, qcol], None if r is None else pc.r_rows(r, nb), seg)
  kernel = functools.partial(_fwd_kernel, cfg=cfg, blk=cfg.fwd, has_r=r is not None, has_seg=seg is not None)
  return cfg.run(kernel, _plan("fwd", _dims(q, k, v, st, seg), cfg.fwd), f"{cfg.kind}_stream_fwd", args)


def _backward(cfg, q, k, v, do, lse, delta, st, seg):
  """-> dq, dk, dv (input dtypes) and the stat cotangents (dkrow, dqcol, dr), per kv head."""
  blk, g = cfg.bwd, cfg.group
  nb = q.shape[2] // blk
  krow, qcol, r, _, _ = pc.stats_dims(st)
  has_r, has_seg = r is not None, seg is not None
  dm = _dims(q, k, v, st, seg)

  r_t = pc.r_rows(jnp.swapaxes(r, -1, -2), nb) if has_r else None  # R^T: program J reads R[:, J] as a row
  args = _args([q, k, v, do, lse, delta, krow, qcol], r_t, seg)
  kernel = functools.partial(_dkv_kernel, cfg=cfg, blk=blk, nb=nb, has_r=has_r, has_seg=has_seg)
  outs = cfg.run(kernel, _plan("dkv", dm, blk), f"{cfg.kind}_stream_dkv", args)
  dk, dv, dkrow = outs[:3]
  dr = jnp.swapaxes(outs[3][:, :, :, 0, :], -1, -2) if has_r else None

  args = _args([q, k, v, do, lse, delta, krow, qcol], pc.r_rows(r, nb) if has_r else None, seg)
  kernel = functools.partial(_dq_kernel, cfg=cfg, blk=blk, has_r=has_r, has_seg=has_seg)
  dq, dqcol = cfg.run(kernel, _plan("dq", dm, blk), f"{cfg.kind}_stream_dq", args)
  return dq, dk, dv, (dkrow, pc.group_sum(dqcol, g, F32), dr)


# ----------------------------------------------------------------------------- custom VJP


_core = pc.flash_core(_forward, _backward)  # the custom VJP every flash kernel shares


# ----------------------------------------------------------------------------- entry point


def _check_tpu_tile(blk, tp):
  # krow's [nr, blk] tile puts tokens on lanes: Mosaic wants 128 of them, or the whole (padded) T.
  if blk % _LANES and blk != tp:
    raise ValueError(
      f"the streamed TPU kernel's tiles must be multiples of {_LANES} tokens (lanes) or cover all of T "
      f"(padded: {tp}), got {blk}: pass block_sizes={_LANES} (or a multiple)"
    )


def tpu_flash_attention(
  q,
  k,
  v,
  bias: Bias,
  *,
  scale,
  segment_ids=None,
  block_sizes=None,
  interpret=None,
  backend: pc.Backend = "auto",
):
  """Causal attention with an FPA or FoX bias in the long-sequence TPU kernels (module docstring).

  Args:
    q: [batch, seq, heads, head_dim]; k: [batch, seq, kv_heads, head_dim]; v: [batch, seq,
      kv_heads, v_dim]; fp32 or bf16; kv_heads divides heads (query head h reads kv head h // G).
    bias: `ops.bias.FPABias(field, level)` or `FoXBias(c)`, gates [batch, seq, kv_heads].
    scale: logit scale.
    segment_ids: optional [batch, seq] int.
    block_sizes: `BlockSizes`, an int, or None (`BlockSizes.default` of the backend: 128 on TPU).
      On TPU a tile is a multiple of 128 tokens or all of (padded) T.
    interpret: None (the interpreter off TPU), a bool, or a `pltpu.InterpretParams()`: the TPU
      interpreter, which models VMEM / SMEM and the pipeline's DMAs (use it with backend="tpu").
    backend: as in `kernels.pallas_attention`: "auto", "interpret", "tpu"; "gpu" raises.
  Returns:
    [batch, seq, heads, v_dim] in q's dtype: `chunked_attention(..., block_size=tile)` up to
    rounding, values and gradients.
  """
  params = interpret if isinstance(interpret, pltpu.InterpretParams) else None
  if params is None and interpret is not None and not isinstance(interpret, bool):
    raise ValueError(f"interpret must be None, a bool or a pltpu.InterpretParams, got {interpret!r}")
  pc.check_backend(backend, None if params is not None else interpret)
  b, t, h, d = q.shape
  dv = v.shape[-1]
  if b == 0 or t == 0:
    return jnp.zeros((b, t, h, dv), q.dtype)
  run, mode = pc.run_mode(True if params is not None else interpret, backend)
  if mode == "gpu":
    raise ValueError(
      "the streamed kernel (kernel='stream') is a Mosaic TPU kernel: on GPU use kernel='whole' "
      "(Triton has no sequential grid axis with scratch accumulators)"
    )
  if not isinstance(bias, (FPABias, FoXBias)):
    raise TypeError(f"bias must be an ops.bias.FPABias or FoXBias, got {type(bias).__name__}")
  bs = pc.check_blocks(block_sizes, mode)
  bf, bb = (pc.fit(n, t, False) for n in (bs.fwd, bs.backward))  # = chunked.block_for at that size
  tp = -(-t // math.lcm(bf, bb)) * math.lcm(bf, bb)
  if mode == "tpu":
    for blk in (bf, bb):
      _check_tpu_tile(blk, tp)
  fst = bias.kernel_stats(bf, tp)
  bst = None if (bb == bf or bias.kind == "fox") else bias.kernel_stats(bb, tp)
  prep = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), [(0, 0), (0, 0), (0, tp - t), (0, 0)])  # [B, H, Tp, .]
  seg = None
  if segment_ids is not None:
    s = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, tp - t)], constant_values=-1)
    seg = (s[:, :, None], s[:, None, :])  # query column [B, Tp, 1], key row [B, 1, Tp]
  cfg = _Cfg(bias.kind, float(scale), bf, bb, run, mode, h // k.shape[2], params)
  o = _core(cfg, prep(q), prep(k), prep(v), fst, bst, seg)
  return jnp.swapaxes(o[:, :, :t], 1, 2)


# ----------------------------------------------------------------------------- VMEM footprint


def _tile_bytes(shape, dtype) -> int:
  """VMEM bytes of one buffer of a block: squeezed dims dropped, the last two padded to the
  (8 * 4 / itemsize, 128) tile (bf16 packs 16 sublanes)."""
  shape = [s for s in shape if isinstance(s, int)]
  item = np.dtype(dtype).itemsize
  sub = 8 * max(1, 4 // item)
  rows, cols = (shape[-2] if len(shape) > 1 else 1), shape[-1]
  lead = math.prod(shape[:-2])
  return lead * (-(-rows // sub) * sub) * (-(-cols // _LANES) * _LANES) * item


def _blocks(block_q, block_k, t):
  blk = BlockSizes.default("tpu").fwd if block_q is None else int(block_q)
  if (block_k if block_k is not None else blk) != blk:
    raise ValueError(
      f"the kernels' tiles are square (the tiling identity's blocks are shared by queries and keys): "
      f"block_q={block_q} and block_k={block_k} must be equal"
    )
  return blk, -(-t // blk) * blk


def _stat_counts(bias, blk):
  if bias not in ("fpa", "fox"):
    raise ValueError(f"bias must be 'fpa' or 'fox', got {bias!r}")
  lv = n_levels(blk)
  return (2 + lv, 1 + lv) if bias == "fpa" else (1, 1)


def vmem_bytes(
  t: int,
  d: int,
  block_q: int | None = None,
  block_k: int | None = None,
  dtype=jnp.bfloat16,
  kind: Pass = "fwd",
  *,
  group: int = 1,
  bias: Literal["fpa", "fox"] = "fpa",
  segments: bool = True,
  temporaries: bool = True,
) -> int:
  """VMEM bytes one program of the streamed kernel `kind` ("fwd", "dkv", "dq") holds, from its block
  specs (`_plan`): 2 buffers per pipelined input and output block, the scratch, each padded to the
  VMEM tile, plus (temporaries=True) TEMP_TILES [block, block] fp32 tiles for the body's values.

  t: sequence length; d: head dim (= v_dim); block_q = block_k: the tile (default 128, the TPU's);
  dtype: q / k / v; group: query heads per kv head (dK / dV read the group's q / dO at once);
  bias: "fpa" (the sparse-table stats and R's row) or "fox"; segments: with segment ids.
  """
  if kind not in PASSES:
    raise ValueError(f"kind must be one of {PASSES}, got {kind!r}")
  blk, tp = _blocks(block_q, block_k, t)
  nr, nc = _stat_counts(bias, blk)
  dm = _Dims(1, group, group, tp, d, d, dtype, nr, nc, bias == "fpa", segments)
  plan = _plan(kind, dm, blk)
  total = 2 * sum(_tile_bytes(s.block_shape, dt) for s, dt in plan.ins)
  total += 2 * sum(_tile_bytes(s.block_shape, o.dtype) for s, o in plan.outs)
  total += sum(_tile_bytes(m.shape, m.dtype) for m in plan.scratch)
  return total + (TEMP_TILES * _tile_bytes((blk, blk), F32) if temporaries else 0)


def whole_vmem_bytes(
  t: int,
  d: int,
  block: int | None = None,
  dtype=jnp.bfloat16,
  kind: Pass = "fwd",
  *,
  group: int = 1,
  bias: Literal["fpa", "fox"] = "fpa",
  segments: bool = True,
) -> int:
  """The same count (without temporaries) for `kernels.py`'s whole-length kernels, from the block
  shapes of its specs: the looped-over operand is a whole-Tp block per (batch, head), so this grows
  linearly in T (k / v in the forward and dQ; the group's q / dO / lse / delta in dK / dV)."""
  if kind not in PASSES:
    raise ValueError(f"kind must be one of {PASSES}, got {kind!r}")
  blk, tp = _blocks(block, None, t)
  nr, nc = _stat_counts(bias, blk)
  nb, g, i32 = tp // blk, group, jnp.int32
  tile, whole = (lambda c: (blk, c)), (lambda c: (tp, c))
  if kind == "fwd":
    ins = [(tile(d), dtype), (whole(d), dtype), (whole(d), dtype), ((nr, tp), F32), (tile(nc), F32)]
    segs, outs = [((blk, 1), i32), ((1, tp), i32)], [(tile(d), dtype), (tile(1), F32)]
  elif kind == "dq":
    ins = [(tile(d), dtype), (whole(d), dtype), (whole(d), dtype), (tile(d), dtype), (tile(1), F32)]
    ins += [(tile(1), F32), ((nr, tp), F32), (tile(nc), F32)]
    segs, outs = [((blk, 1), i32), ((1, tp), i32)], [(tile(d), dtype), (tile(nc), F32)]
  else:
    ins = [((g, tp, d), dtype), (tile(d), dtype), (tile(d), dtype), ((g, tp, d), dtype), ((g, tp, 1), F32)]
    ins += [((g, tp, 1), F32), ((nr, blk), F32), (whole(nc), F32)]
    segs, outs = [((tp, 1), i32), ((1, blk), i32)], [(tile(d), dtype), (tile(d), dtype), ((nr, blk), F32)]
    outs += [((1, nb), F32)] if bias == "fpa" else []
  ins += ([((1, nb), F32)] if bias == "fpa" else []) + (segs if segments else [])
  return 2 * sum(_tile_bytes(s, dt) for s, dt in ins + outs)
