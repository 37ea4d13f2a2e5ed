"""FlashAttention-2-style Pallas kernels for First Passage Attention and FoX.

  forward  grid (B, H, query block I): the diagonal tile, then key blocks J < I with an online
           softmax; stores out and logsumexp. Tiles above the diagonal are never visited.
  dK / dV  grid (B, H, key block J): the diagonal tile, then query blocks I > J; dK, dV and the
           key-side stat cotangents (and dR[:, J]) stay local to the program.
  dQ       grid (B, H, query block I): the diagonal tile, then J < I; dQ and the query-side stat
           cotangents. Two backward kernels instead of atomics: every output block has one writer.

Each tile's bias is computed in the kernel from small per-token stat vectors (`tile_bias.py`;
the bias protocol's `kernel_stats`, `ops.bias`); the stats are built outside the custom VJP by
differentiable JAX, so the kernels only return stat cotangents and autodiff carries them to
field / level / log_fgate (as in `fpa_jax.ops.chunked`). The looped-over operand (k / v in the
forward and dQ kernels, q / dO in dK / dV) is one whole-T block per (batch, head), sliced with
`pl.ds` inside the loop: the portable form for Mosaic and Triton alike, which needs it to fit in
VMEM / be addressable (long T on TPU: `tpu_flash.py`, a 4-D grid with scratch accumulators,
`pallas_attention(..., kernel="stream")`).

Grouped-query attention (k, v, gates with KVH = H / G heads): the forward and dQ grids run over
query heads, and their BlockSpec index maps send query head h to kv head h // G for k, v and the
bias stats, so k / v are never repeated. The dK / dV grid runs over kv heads: each program reads
the [G, Tp, .] block of its group's q / dO / logsumexp / delta and loops over the G query heads,
computing the tile bias once and pulling back the group's summed cotangent, so dK / dV and the
key-stat cotangents are written once, in their own dtype (only the small query-stat cotangents
of the dQ kernel are summed over the group outside).

Status: run and tested in interpret mode on CPU (`interpret=True`, the default there). Built with
backend="tpu" / "gpu" they lower for Mosaic / Triton on CPU too (`lowering.lower_for`,
tests/ops/pallas/test_lowering.py); the compiled kernels have not run on a device.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fpa_jax.ops.bias import Bias, FoXBias, FPABias
from fpa_jax.ops.common import F32
from fpa_jax.ops.pallas.common import (
  Backend,
  Cfg,
  add_r_cotangent,
  check_backend,
  check_blocks,
  dkv_tile,
  dq_tile,
  fit,
  flash_core,
  group_sum,
  masked_logits,
  pick,
  r_rows,
  run_mode,
  softmax_start,
  softmax_step,
  stats_dims,
  tile_terms,
  unpack,
  with_optional,
)


# ----------------------------------------------------------------------------- tile helpers


def _rows(j, blk):
  return pl.ds(pl.multiple_of(j * blk, blk), blk)


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(*refs, cfg, blk, has_r, has_seg):
  # q, qcol, qseg: this query block; k, v, krow, kseg: all of T; r: R[I, :].
  (q_ref, k_ref, v_ref, krow_ref, qcol_ref), r_ref, qseg_ref, kseg_ref, (o_ref, lse_ref) = unpack(
    refs, 5, has_r, has_seg
  )
  i = pl.program_id(2)
  q = q_ref[...]
  qvec = lambda n: qcol_ref[:, n : n + 1]
  qseg = qseg_ref[...] if has_seg else None

  def logits(j, diag):
    ks = _rows(j, blk)
    r = pick(r_ref[...], j) if has_r and not diag else None
    kseg = kseg_ref[:, ks] if has_seg else None
    bias, mask, _ = tile_terms(cfg, blk, lambda n: krow_ref[n : n + 1, ks], qvec, r, qseg, kseg, diag)
    return masked_logits(cfg, q, k_ref[ks, :], bias, mask), v_ref[ks, :]

  state = softmax_start(*logits(i, True))  # the diagonal first: its running max is finite
  m, l, acc = jax.lax.fori_loop(0, i, lambda j, c: softmax_step(c, *logits(j, False)), state)
  o_ref[...] = (acc / l).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(*refs, cfg, blk, nb, has_r, has_seg):
  # Grid (B, KVH, J). k, v, krow, kseg: this key block of kv head h; q, dO, lse, delta: all of T
  # for the G query heads reading h ([G, Tp, .]); qcol, qseg: all of T; r: R[:, J].
  fixed, r_ref, qseg_ref, kseg_ref, outs = unpack(refs, 8, has_r, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, krow_ref, qcol_ref = fixed
  dk_ref, dv_ref, dkrow_ref = outs[:3]
  j = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kvec = lambda n: krow_ref[n : n + 1, :]
  kseg = kseg_ref[...] if has_seg else None
  r_col = r_ref[...] if has_r else None

  def tile(i, carry, diag):
    dk, dv, dkrow, dr = carry
    qs = _rows(i, blk)
    r = pick(r_col, i) if has_r and not diag else None
    qseg = qseg_ref[qs, :] if has_seg else None
    terms = tile_terms(cfg, blk, kvec, lambda n: qcol_ref[qs, n : n + 1], r, qseg, kseg, diag)
    heads = lambda g: (q_ref[g, qs, :], do_ref[g, qs, :], lse_ref[g, qs, :], delta_ref[g, qs, :])
    dk, dv, rows, d_r = dkv_tile(cfg, terms, k, v, heads, dk, dv)
    dkrow = tuple(x + rows[n] if n in rows else x for n, x in enumerate(dkrow))
    return dk, dv, dkrow, dr if d_r is None else add_r_cotangent(dr, d_r, i)

  nr = krow_ref.shape[0]
  carry = (
    jnp.zeros(k.shape, F32),
    jnp.zeros(v.shape, F32),
    tuple(jnp.zeros((1, blk), F32) for _ in range(nr)),
    jnp.zeros(r_col.shape, F32) if has_r else None,
  )
  carry = tile(j, carry, True)
  dk, dv, dkrow, dr = jax.lax.fori_loop(j + 1, nb, lambda i, c: tile(i, c, False), carry)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  for n, x in enumerate(dkrow):
    dkrow_ref[n : n + 1, :] = x
  if has_r:
    outs[3][...] = dr


def _dq_kernel(*refs, cfg, blk, has_r, has_seg):
  # q, dO, lse, delta, qcol, qseg: this query block; k, v, krow, kseg: all of T; r: R[I, :].
  fixed, r_ref, qseg_ref, kseg_ref, (dq_ref, dqcol_ref) = unpack(refs, 8, has_r, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, krow_ref, qcol_ref = fixed
  i = pl.program_id(2)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  qvec = lambda n: qcol_ref[:, n : n + 1]
  qseg = qseg_ref[...] if has_seg else None

  def tile(j, carry, diag):
    dq, dqcol = carry
    ks = _rows(j, blk)
    k, v = k_ref[ks, :], v_ref[ks, :]
    r = pick(r_ref[...], j) if has_r and not diag else None
    kseg = kseg_ref[:, ks] if has_seg else None
    terms = tile_terms(cfg, blk, lambda n: krow_ref[n : n + 1, ks], qvec, r, qseg, kseg, diag)
    dq_t, cols = dq_tile(cfg, terms, q, k, v, do, lse, delta)
    return dq + dq_t, tuple(x + cols[n] if n in cols else x for n, x in enumerate(dqcol))

  nc = qcol_ref.shape[1]
  carry = tile(i, (jnp.zeros(q.shape, F32), tuple(jnp.zeros((blk, 1), F32) for _ in range(nc))), True)
  dq, dqcol = jax.lax.fori_loop(0, i, lambda j, c: tile(j, c, False), carry)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  for n, x in enumerate(dqcol):
    dqcol_ref[:, n : n + 1] = x


# ----------------------------------------------------------------------------- pallas_calls


# g: the grid runs over query heads h; an array with kv heads (k, v, bias stats) is read at h // g.
def _tiled(blk, cols, g=1):  # [B, H, Tp, cols] in row tiles of T, indexed by the grid's third axis
  return pl.BlockSpec((None, None, blk, cols), lambda b, h, x: (b, h // g, x, 0))


def _whole(rows, cols, g=1):  # all of a [B, H, rows, cols] per (batch, head)
  return pl.BlockSpec((None, None, rows, cols), lambda b, h, x: (b, h // g, 0, 0))


_R_SPEC = lambda nbp, g=1: pl.BlockSpec((None, None, None, 1, nbp), lambda b, h, x: (b, h // g, x, 0, 0))


def _seg_specs(blk, tp, q_tiled):
  """(qseg [B, Tp, 1], kseg [B, 1, Tp]) specs: the query side tiled or whole, the key side the other."""
  qt = pl.BlockSpec((None, blk, 1), lambda b, h, x: (b, x, 0))
  qw = pl.BlockSpec((None, tp, 1), lambda b, h, x: (b, 0, 0))
  kt = pl.BlockSpec((None, 1, blk), lambda b, h, x: (b, 0, x))
  kw = pl.BlockSpec((None, 1, tp), lambda b, h, x: (b, 0, 0))
  return [qt, kw] if q_tiled else [qw, kt]


def _nbp(cfg, nb):
  return pl.next_power_of_2(nb) if cfg.backend == "gpu" else nb  # Triton: power-of-2 vectors


def _forward(cfg, q, k, v, st, seg):
  """q [B, H, Tp, K], k [B, KVH, Tp, K], v [B, KVH, Tp, Kv], stats per kv head -> (o [B, H, Tp, Kv],
  lse [B, H, Tp, 1] fp32)."""
  b, h, tp, d = q.shape
  dv, blk, g = v.shape[-1], cfg.fwd, cfg.group
  nb = tp // blk
  krow, qcol, r, nr, nc = stats_dims(st)
  args = [q, k, v, krow, qcol]
  specs = [_tiled(blk, d), _whole(tp, d, g), _whole(tp, dv, g), _whole(nr, tp, g), _tiled(blk, nc, g)]
  r = None if r is None else r_rows(r, _nbp(cfg, nb))
  args, specs = with_optional(args, specs, r, _R_SPEC(_nbp(cfg, nb), g), seg, _seg_specs(blk, tp, q_tiled=True))
  kernel = functools.partial(_fwd_kernel, cfg=cfg, blk=blk, has_r=r is not None, has_seg=seg is not None)
  return cfg.call(
    kernel,
    grid=(b, h, nb),
    in_specs=specs,
    out_specs=[_tiled(blk, dv), _tiled(blk, 1)],
    out_shape=[jax.ShapeDtypeStruct((b, h, tp, dv), q.dtype), jax.ShapeDtypeStruct((b, h, tp, 1), F32)],
    name=f"{cfg.kind}_attention_fwd",
  )(*args)


def _backward(cfg, q, k, v, do, lse, delta, st, seg):
  """-> dq, dk, dv (input dtypes) and the stat cotangents (dkrow, dqcol, dr), per kv head (dK / dV,
  dkrow, dr summed over the group in the kernel; dqcol from per-query-head partials)."""
  b, h, tp, d = q.shape
  dv_, blk, g = v.shape[-1], cfg.bwd, cfg.group
  nb = tp // blk
  krow, qcol, r, nr, nc = stats_dims(st)
  has_r, has_seg = r is not None, seg is not None
  nbp = _nbp(cfg, nb)
  grid = (b, h, nb)
  row_tile = pl.BlockSpec((None, None, nr, blk), lambda b, h, x: (b, h, 0, x))  # krow's tile of key block J

  # dK / dV: grid over kv heads, key block J per program, looping over the G query heads that
  # read the kv head (a [G, Tp, .] block of heads h G .. h G + G - 1): one writer per dK / dV block.
  group = lambda cols: pl.BlockSpec((None, g, tp, cols), lambda b, h, x: (b, h, 0, 0))
  args = [q, k, v, do, lse, delta, krow, qcol]
  specs = [group(d), _tiled(blk, d), _tiled(blk, dv_), group(dv_), group(1), group(1), row_tile, _whole(tp, nc)]
  out_specs = [_tiled(blk, d), _tiled(blk, dv_), row_tile]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_shape.append(jax.ShapeDtypeStruct(krow.shape, F32))
  r_t = r_rows(jnp.swapaxes(r, -1, -2), nbp) if has_r else None  # R^T: program J reads R[:, J] as a row
  args, specs = with_optional(args, specs, r_t, _R_SPEC(nbp), seg, _seg_specs(blk, tp, q_tiled=False))
  if has_r:
    out_specs.append(_R_SPEC(nbp))
    out_shape.append(jax.ShapeDtypeStruct(r.shape[:2] + (nb, 1, nbp), F32))
  kernel = functools.partial(_dkv_kernel, cfg=cfg, blk=blk, nb=nb, has_r=has_r, has_seg=has_seg)
  outs = cfg.call(
    kernel,
    grid=(b, h // g, nb),
    in_specs=specs,
    out_specs=out_specs,
    out_shape=out_shape,
    name=f"{cfg.kind}_attention_dkv",
  )(*args)
  dk, dv, dkrow = outs[:3]
  dr = jnp.swapaxes(outs[3][:, :, :, 0, :nb], -1, -2) if has_r else None

  # dQ: query block I per program.
  args = [q, k, v, do, lse, delta, krow, qcol]
  specs = [
    _tiled(blk, d),
    _whole(tp, d, g),
    _whole(tp, dv_, g),
    _tiled(blk, dv_),
    _tiled(blk, 1),
    _tiled(blk, 1),
    _whole(nr, tp, g),
    _tiled(blk, nc, g),
  ]
  args, specs = with_optional(
    args, specs, r_rows(r, nbp) if has_r else None, _R_SPEC(nbp, g), seg, _seg_specs(blk, tp, q_tiled=True)
  )
  kernel = functools.partial(_dq_kernel, cfg=cfg, blk=blk, has_r=has_r, has_seg=has_seg)
  dq, dqcol = cfg.call(
    kernel,
    grid=grid,
    in_specs=specs,
    out_specs=[_tiled(blk, d), _tiled(blk, nc)],
    out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h) + qcol.shape[2:], F32)],
    name=f"{cfg.kind}_attention_dq",
  )(*args)
  return dq, dk, dv, (dkrow, group_sum(dqcol, g, F32), dr)


# ----------------------------------------------------------------------------- custom VJP


_core = flash_core(_forward, _backward)  # the custom VJP every flash kernel shares


# ----------------------------------------------------------------------------- entry point

# "whole": these kernels (the looped-over operand one whole-T block); "stream": the long-sequence
# TPU kernels of `tpu_flash.py` (every operand one tile per grid step, VMEM independent of T).
Kernel = Literal["whole", "stream"]
KERNELS: tuple[str, ...] = get_args(Kernel)


def pallas_attention(
  q,
  k,
  v,
  bias: Bias,
  *,
  scale,
  segment_ids=None,
  block_sizes=None,
  interpret=None,
  skip_tolerance=None,
  backend: Backend = "auto",
  kernel: Kernel = "whole",
):
  """Causal attention with an FPA or FoX bias in Pallas kernels.

  Args:
    q: [B, T, H, K]; k: [B, T, KVH, K]; v: [B, T, KVH, Kv]; fp32 or bf16; KVH divides H (query
      head h reads kv head h // G; see the module docstring for the backward's group sum).
    bias: `ops.bias.FPABias(field, level)` or `ops.bias.FoXBias(c)` (c = cumsum(log_fgate)), [B, T, KVH].
    scale: logit scale.
    segment_ids: optional [B, T] int.
    block_sizes: `BlockSizes`, an int (both passes), or None (`BlockSizes.default` of the backend).
    interpret: run the kernels in the Pallas interpreter; default: on anything but TPU / GPU.
    skip_tolerance: None (these kernels, exact) or eps in (0, 1): the block-sparse kernels
      (`block_sparse.block_sparse_attention`), which drop the chunked kernel's dead tiles.
    backend: what the kernels are built for (`common.run_mode`): "auto" (JAX's backend, the
      interpreter off TPU / GPU), "interpret", or "tpu" / "gpu" whatever JAX runs on: Mosaic /
      Triton kernels to lower through `jax.export` without the hardware (`lowering.lower_for`),
      or with interpret=True that target's tiles and padding run in the interpreter.
    kernel: "whole" (these kernels) or "stream" (`tpu_flash.tpu_flash_attention`: TPU or the
      interpreter, exact only; interpret may then be a `pltpu.InterpretParams()`).
  Returns:
    [B, T, H, Kv] in q's dtype.
  """
  if kernel not in KERNELS:
    raise ValueError(f"unknown kernel {kernel!r}: the kernel must be one of {KERNELS}")
  if kernel == "stream":
    if skip_tolerance is not None:
      raise ValueError(
        "kernel='stream' is exact: drop skip_tolerance, or use kernel='whole' for the block-sparse kernels"
      )
    from fpa_jax.ops.pallas.tpu_flash import tpu_flash_attention  # function-level, as block_sparse

    return tpu_flash_attention(
      q, k, v, bias, scale=scale, segment_ids=segment_ids, block_sizes=block_sizes, interpret=interpret, backend=backend
    )
  check_backend(backend, interpret)  # before the empty return: a bad setting fails on any input
  if skip_tolerance is not None:
    from fpa_jax.ops.pallas.block_sparse import (
      block_sparse_attention,
    )  # a function-level import: block_sparse is the optional path

    return block_sparse_attention(
      q,
      k,
      v,
      bias,
      scale=scale,
      skip_tolerance=skip_tolerance,
      segment_ids=segment_ids,
      block_sizes=block_sizes,
      interpret=interpret,
      backend=backend,
    )
  b, t, h, d = q.shape
  dv = v.shape[-1]
  if b == 0 or t == 0:  # an empty grid: nothing to run
    return jnp.zeros((b, t, h, dv), q.dtype)
  interpret, mode = run_mode(interpret, backend)
  bs = check_blocks(block_sizes, mode)
  bf, bb = (fit(n, t, mode == "gpu") for n in (bs.fwd, bs.backward))
  tp = -(-t // math.lcm(bf, bb)) * math.lcm(bf, bb)
  if not isinstance(bias, (FPABias, FoXBias)):
    raise TypeError(f"bias must be an ops.bias.FPABias or FoXBias, got {type(bias).__name__}")
  kind = bias.kind
  fst = bias.kernel_stats(bf, tp)
  bst = None if (bb == bf or kind == "fox") else bias.kernel_stats(bb, tp)
  # [B, T, H, K] -> [B, H, Tp, K]: a tile is then a (rows, head_dim) block, the layout both
  # Mosaic and Triton tile natively. Triton also wants power-of-2 head dims (zero columns).
  dpad = lambda n: max(16, pl.next_power_of_2(n)) if mode == "gpu" else n
  prep = lambda x, n: jnp.pad(jnp.swapaxes(x, 1, 2), [(0, 0), (0, 0), (0, tp - t), (0, n - x.shape[-1])])
  seg = None
  if segment_ids is not None:
    s = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, tp - t)], constant_values=-1)
    seg = (s[:, :, None], s[:, None, :])  # query column [B, Tp, 1], key row [B, 1, Tp]
  cfg = Cfg(kind, float(scale), bf, bb, interpret, mode, h // k.shape[2])
  o = _core(cfg, prep(q, dpad(d)), prep(k, dpad(d)), prep(v, dpad(dv)), fst, bst, seg)
  return jnp.swapaxes(o[:, :, :t, :dv], 1, 2)
