"""Block-sparse Pallas kernels for FPA and FoX: the chunked kernel's dead-tile skipping
(`skip_tolerance`) as kernels that never visit a dropped tile.

The tiles. `chunked._dead_tiles` (the sound bound of `ops.chunked`: every weight of a dropped tile
is <= eps / T) marks tile (I, J), J < I, dead per (batch row, kv head); the live tiles are the
causal ones that are not. Each (b, kv head, block) gets its walk as an index list, compacted
outside the kernels (`live_lists`):

  forward / dQ  count[b, h, I] live key blocks of query block I, idx[b, h, I, :] = I (the diagonal,
                first: it is never masked, so the running max is finite from the first step),
                then the live J < I ascending, then the last live J repeated up to nb entries.
  dK / dV       the transposed lists: the live query blocks I >= J of key block J, J first.

Both are scalar-prefetched (`pltpu.PrefetchScalarGridSpec`, SMEM on TPU) and the grid gets a
fourth axis n over list entries, (B, H, I, n) / (B, KVH, J, n): the BlockSpec index maps read
idx[b, h, I, n] to choose the key (query) block that entry n fetches, so a dead tile is never
read from HBM. Entries past the count repeat the last live block, whose index is unchanged, so
the pipeline issues no copy for them, and the kernel does no work on them (`pl.when`): splash
attention's scheme (`jax.experimental.pallas.ops.tpu.splash_attention`), with the list per (row,
kv head) from the FPA / FoX bound instead of a static mask. The n axis carries the online softmax
(forward) or the gradient sums (backward) in VMEM scratch / the resident output block, so it is
sequential ("arbitrary"); the other three are parallel. Unlike `kernels.py` no operand is a
whole-T block: every block is one tile, so VMEM use does not grow with T.

Gradients: the same tiles are dropped in the forward and both backward kernels (the lists come
from one `dead` array), which are the gradients of the chunked kernel with the same
skip_tolerance; dK / dV walk each key block's live query blocks and dQ each query block's live key
blocks, one writer per output block as in `kernels.py`. The tile bodies (`common.py`: the online
softmax step, the dK / dV tile looping over the group, the dQ tile, the tile bias and its pullback)
and the GQA layout (forward / dQ over query heads reading kv head h // G, dK / dV over kv heads) are
those of `kernels.py`; so is the custom VJP around stats built outside by differentiable JAX.
skip_tolerance=None walks every causal tile: the exact kernels in this form.

Status: the grid, BlockSpecs and scalar prefetch are Mosaic TPU's form (tiles of 128 tokens
there, `BlockSizes.default("tpu")`; m / l scratch [blk, 1]); only the interpreter on CPU has run
them, and Mosaic has lowered them on CPU (backend="tpu", `lowering.lower_for`). Not done: Triton
GPU (no scalar prefetch, no sequential grid axis: `pallas_attention` raises there), and splitting
the prefetched lists for larger calls: they sit in SMEM, flat (B KVH nb^2 int32: 256 KiB for
B KVH = 16, nb = 64). The grid always has nb list steps per block; the padded ones cost a grid step
each but no copy and no compute.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fpa_jax.ops import chunked as _chunked
from fpa_jax.ops.bias import Bias, FoXBias, FPABias
from fpa_jax.ops.common import F32
from fpa_jax.ops.validate import PALLAS_SKIP_GPU
from fpa_jax.ops.pallas import common as pc


def live_lists(live):
  """live [B, KVH, nb, nb] bool (row: the program's block, column: the blocks it walks; the diagonal
  True) -> (count [B, KVH, nb] int32, idx [B, KVH, nb, nb] int32): per row the diagonal first, then
  the live blocks ascending, then the last live one repeated (no new copy for padded entries)."""
  nb = live.shape[-1]
  col = jnp.arange(nb)
  diag = col[:, None] == col[None, :]
  order = jnp.where(diag, -1, jnp.where(live, col, nb + col))  # dead blocks sort after every live one
  idx = jnp.argsort(order, axis=-1).astype(jnp.int32)
  count = live.sum(-1).astype(jnp.int32)
  last = jnp.take_along_axis(idx, count[..., None] - 1, -1)
  return count, jnp.where(col < count[..., None], idx, last)


def tile_lists(dead, shape):
  """dead [B, KVH, nb, nb] bool (query block I, key block J) or None (nothing dropped), shape
  (B, KVH, nb) -> (count, idx) of the forward / dQ walk, then of the transposed dK / dV walk:
  `live_lists` of the causal tiles that are not dead."""
  nb = shape[-1]
  live = jnp.arange(nb)[:, None] >= jnp.arange(nb)[None, :]
  live = jnp.broadcast_to(live if dead is None else live & ~dead, shape + (nb,))
  return live_lists(live) + live_lists(jnp.swapaxes(live, -1, -2))


# ----------------------------------------------------------------------------- kernels
# Refs: the two prefetched lists (count, idx), the inputs, the outputs, the scratch. Program ids
# (b, h, x, n): x the program's own block, n its list entry.


@dataclasses.dataclass(frozen=True)
class _SparseCfg(pc.Cfg):
  kvh: int = 1
  nb: int = 1

  # The lists are flat in SMEM (count [B KVH nb], idx [B KVH nb nb]): Mosaic pads the last two dims
  # of an SMEM array to (8, 128) words, which would multiply a [.., nb, nb] list's size.
  def count_at(self, b, hk, x):
    return (b * self.kvh + hk) * self.nb + x

  def idx_at(self, b, hk, x, n):
    return self.count_at(b, hk, x) * self.nb + n


def _entry(cfg, cnt_ref, idx_ref, hk):
  b, x, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  return n, idx_ref[cfg.idx_at(b, hk, x, n)], n < cnt_ref[cfg.count_at(b, hk, x)]


def _terms(cfg, blk, krow_ref, qcol_ref, r_ref, qseg_ref, kseg_ref, x, diag):
  """The tile's `tile_terms` (bias, mask, pull): every stat and segment ref is one tile here; the
  walked block x picks R's entry off the diagonal (r_ref / qseg_ref None: no such input)."""
  r = pc.pick(r_ref[...], x) if r_ref is not None and not diag else None
  qseg, kseg = (None, None) if qseg_ref is None else (qseg_ref[...], kseg_ref[...])
  kvec, qvec = (lambda m: krow_ref[m : m + 1, :]), (lambda m: qcol_ref[:, m : m + 1])
  return pc.tile_terms(cfg, blk, kvec, qvec, r, qseg, kseg, diag)


def _walk(n, live, start, tile, finish):
  """The list axis n of a program: start() and tile(diag=True) at entry 0 (the diagonal, never
  masked, so the running max is finite from there on), tile(False) at each later live entry,
  finish() at the last entry."""

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


def _fwd_kernel(cnt_ref, idx_ref, *refs, cfg, blk, has_r, has_seg):
  # q, qcol, qseg, r: query block I; k, v, krow, kseg: key block J = idx[b, h // G, I, n].
  (q_ref, k_ref, v_ref, krow_ref, qcol_ref), r_ref, qseg_ref, kseg_ref, rest = pc.unpack(refs, 5, has_r, has_seg)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  n, j, live = _entry(cfg, cnt_ref, idx_ref, pl.program_id(1) // cfg.group)

  def tile(diag):
    bias, mask, _ = _terms(cfg, blk, krow_ref, qcol_ref, r_ref, qseg_ref, kseg_ref, j, diag)
    s, v = pc.masked_logits(cfg, q_ref[...], k_ref[...], bias, mask), v_ref[...]
    state = pc.softmax_start(s, v) if diag else pc.softmax_step((m_sc[...], l_sc[...], acc_sc[...]), s, v)
    m_sc[...], l_sc[...], acc_sc[...] = state

  def finish():
    o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
    lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])

  _walk(n, live, lambda: None, tile, finish)


def _dkv_kernel(cnt_ref, idx_ref, *refs, cfg, blk, has_r, has_seg):
  # Grid (B, KVH, J, n). k, v, krow, kseg, r (R[:, J]): key block J of kv head h; q, dO, lse, delta
  # ([G, blk, .], the group's query heads), qcol, qseg: query block I = idxT[b, h, J, n].
  fixed, r_ref, qseg_ref, kseg_ref, outs = pc.unpack(refs, 8, has_r, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, krow_ref, qcol_ref = fixed
  dk_ref, dv_ref, dkrow_ref = outs[:3]
  dr_ref = outs[3] if has_r else None
  dk_sc, dv_sc = outs[-2:]
  n, i, live = _entry(cfg, cnt_ref, idx_ref, pl.program_id(1))

  def start():
    dk_sc[...], dv_sc[...] = jnp.zeros(dk_sc.shape, F32), jnp.zeros(dv_sc.shape, F32)
    dkrow_ref[...] = jnp.zeros(dkrow_ref.shape, F32)  # resident across n: the sum's buffer
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

  _walk(n, live, start, tile, finish)


def _dq_kernel(cnt_ref, idx_ref, *refs, cfg, blk, has_r, has_seg):
  # q, dO, lse, delta, qcol, qseg, r: query block I; k, v, krow, kseg: key block idx[b, h // G, I, n].
  fixed, r_ref, qseg_ref, kseg_ref, (dq_ref, dqcol_ref, dq_sc) = pc.unpack(refs, 8, has_r, has_seg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, krow_ref, qcol_ref = fixed
  n, j, live = _entry(cfg, cnt_ref, idx_ref, pl.program_id(1) // cfg.group)

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

  _walk(n, live, start, tile, finish)


# ----------------------------------------------------------------------------- pallas_calls
# Index maps take the grid indices (b, h, x, n) and then the prefetched (count, idx) refs.


def _call(cfg, kernel, grid, in_specs, out_specs, out_shape, scratch, name, lists, args):
  params = None
  if cfg.backend == "tpu":  # the list axis carries the accumulators: sequential
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
  spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
  )
  return pl.pallas_call(
    kernel, grid_spec=spec, out_shape=out_shape, interpret=cfg.interpret, compiler_params=params, name=name
  )(*lists, *args)


def _own(shape, head_div=1):
  """A [B, H, Tp, c] tile at the program's own block x (head h read as h // head_div)."""
  return pl.BlockSpec((None, None) + shape, lambda b, h, x, n, c, ix: (b, h // head_div, x, 0))


def _walked(cfg, shape, g):
  """A [B, KVH, Tp, c] tile at the walked block idx[b, h // g, x, n]."""
  return pl.BlockSpec((None, None) + shape, lambda b, h, x, n, c, ix: (b, h // g, ix[cfg.idx_at(b, h // g, x, n)], 0))


def _krow_spec(cfg, nr, blk, g, walked):
  if walked:
    return pl.BlockSpec(
      (None, None, nr, blk), lambda b, h, x, n, c, ix: (b, h // g, 0, ix[cfg.idx_at(b, h // g, x, n)])
    )
  return pl.BlockSpec((None, None, nr, blk), lambda b, h, x, n, c, ix: (b, h, 0, x))


def _r_spec(nbp, g):  # row x of R (or R^T) as [1, nbp]
  return pl.BlockSpec((None, None, None, 1, nbp), lambda b, h, x, n, c, ix: (b, h // g, x, 0, 0))


def _seg_specs(cfg, blk, g, q_walked):
  """(qseg [B, Tp, 1], kseg [B, 1, Tp]) specs: one side the program's block, the other walked."""
  own = lambda b, h, x, n, c, ix: x
  walk = lambda b, h, x, n, c, ix: ix[cfg.idx_at(b, h // g, x, n)]
  qb, kb = (walk, own) if q_walked else (own, walk)
  return [
    pl.BlockSpec((None, blk, 1), lambda *a: (a[0], qb(*a), 0)),
    pl.BlockSpec((None, 1, blk), lambda *a: (a[0], 0, kb(*a))),
  ]


def _forward(cfg, q, k, v, st, seg, lists):
  """q [B, H, Tp, K], k [B, KVH, Tp, K], v [B, KVH, Tp, Kv], stats per kv head, the forward lists
  -> (o [B, H, Tp, Kv], lse [B, H, Tp, 1] fp32)."""
  b, h, tp, d = q.shape
  dv, blk, g = v.shape[-1], cfg.fwd, cfg.group
  nb = tp // blk
  krow, qcol, r, nr, nc = pc.stats_dims(st)
  args = [q, k, v, krow, qcol]
  specs = [_own((blk, d)), _walked(cfg, (blk, d), g), _walked(cfg, (blk, dv), g), _krow_spec(cfg, nr, blk, g, True)]
  specs.append(_own((blk, nc), g))
  args, specs = pc.with_optional(
    args, specs, None if r is None else pc.r_rows(r, nb), _r_spec(nb, g), seg, _seg_specs(cfg, blk, g, False)
  )
  kernel = functools.partial(_fwd_kernel, cfg=cfg, blk=blk, has_r=r is not None, has_seg=seg is not None)
  scratch = [pltpu.VMEM((blk, 1), F32), pltpu.VMEM((blk, 1), F32), pltpu.VMEM((blk, dv), F32)]
  out_shape = [jax.ShapeDtypeStruct((b, h, tp, dv), q.dtype), jax.ShapeDtypeStruct((b, h, tp, 1), F32)]
  return _call(
    cfg,
    kernel,
    (b, h, nb, nb),
    specs,
    [_own((blk, dv)), _own((blk, 1))],
    out_shape,
    scratch,
    f"{cfg.kind}_block_sparse_fwd",
    lists[:2],
    args,
  )


def _backward(cfg, q, k, v, do, lse, delta, st, seg, lists):
  """-> dq, dk, dv (input dtypes) and the stat cotangents (dkrow, dqcol, dr) per kv head."""
  b, h, tp, d = q.shape
  dv_, blk, g = v.shape[-1], cfg.bwd, cfg.group
  nb = tp // blk
  krow, qcol, r, nr, nc = pc.stats_dims(st)
  has_r, has_seg = r is not None, seg is not None

  # dK / dV: grid (B, KVH, J, n) over the transposed lists; q-side tiles of the group: [G, blk, .].
  group = lambda cols: pl.BlockSpec(
    (None, g, blk, cols), lambda b, h, x, n, c, ix: (b, h, ix[cfg.idx_at(b, h, x, n)], 0)
  )
  args = [q, k, v, do, lse, delta, krow, qcol]
  specs = [group(d), _own((blk, d)), _own((blk, dv_)), group(dv_), group(1), group(1)]
  specs += [_krow_spec(cfg, nr, blk, 1, False), _walked(cfg, (blk, nc), 1)]
  out_specs = [_own((blk, d)), _own((blk, dv_)), _krow_spec(cfg, nr, blk, 1, False)]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_shape.append(jax.ShapeDtypeStruct(krow.shape, F32))
  r_t = pc.r_rows(jnp.swapaxes(r, -1, -2), nb) if has_r else None  # R^T: program J reads R[:, J] as a row
  args, specs = pc.with_optional(args, specs, r_t, _r_spec(nb, 1), seg, _seg_specs(cfg, blk, 1, q_walked=True))
  if has_r:
    out_specs.append(_r_spec(nb, 1))
    out_shape.append(jax.ShapeDtypeStruct(r.shape[:2] + (nb, 1, nb), F32))
  kernel = functools.partial(_dkv_kernel, cfg=cfg, blk=blk, has_r=has_r, has_seg=has_seg)
  scratch = [pltpu.VMEM((blk, d), F32), pltpu.VMEM((blk, dv_), F32)]
  outs = _call(
    cfg,
    kernel,
    (b, h // g, nb, nb),
    specs,
    out_specs,
    out_shape,
    scratch,
    f"{cfg.kind}_block_sparse_dkv",
    lists[2:],
    args,
  )
  dk, dv, dkrow = outs[:3]
  dr = jnp.swapaxes(outs[3][:, :, :, 0, :], -1, -2) if has_r else None

  # dQ: grid (B, H, I, n) over the forward lists.
  args = [q, k, v, do, lse, delta, krow, qcol]
  specs = [_own((blk, d)), _walked(cfg, (blk, d), g), _walked(cfg, (blk, dv_), g), _own((blk, dv_)), _own((blk, 1))]
  specs += [_own((blk, 1)), _krow_spec(cfg, nr, blk, g, True), _own((blk, nc), g)]
  args, specs = pc.with_optional(
    args, specs, pc.r_rows(r, nb) if has_r else None, _r_spec(nb, g), seg, _seg_specs(cfg, blk, g, False)
  )
  kernel = functools.partial(_dq_kernel, cfg=cfg, blk=blk, has_r=has_r, has_seg=has_seg)
  dq, dqcol = _call(
    cfg,
    kernel,
    (b, h, nb, nb),
    specs,
    [_own((blk, d)), _own((blk, nc))],
    [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h) + qcol.shape[2:], F32)],
    [pltpu.VMEM((blk, d), F32)],
    f"{cfg.kind}_block_sparse_dq",
    lists[:2],
    args,
  )
  return dq, dk, dv, (dkrow, pc.group_sum(dqcol, g, F32), dr)


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, st, seg, lists):
  return _forward(cfg, q, k, v, st, seg, lists)[0]


def _core_fwd(cfg, q, k, v, st, seg, lists):
  o, lse = _forward(cfg, q, k, v, st, seg, lists)
  return o, (q, k, v, st, seg, lists, o, lse)


def _core_bwd(cfg, res, do):
  q, k, v, st, seg, lists, o, lse = res
  delta = jnp.sum(do.astype(F32) * o.astype(F32), -1, keepdims=True)  # [B, H, Tp, 1]
  dq, dk, dv, dst = _backward(cfg, q, k, v, do, lse, delta, st, seg, lists)
  none = lambda t: jax.tree.map(lambda _: None, t)
  return dq, dk, dv, dst, none(seg), none(lists)


_core.defvjp(_core_fwd, _core_bwd)


# ----------------------------------------------------------------------------- entry point


def block_sparse_attention(
  q,
  k,
  v,
  bias: Bias,
  *,
  scale,
  skip_tolerance,
  segment_ids=None,
  block_sizes=None,
  interpret=None,
  backend: pc.Backend = "auto",
):
  """Causal FPA / FoX attention in Pallas kernels that visit only the tiles the skip bound keeps.

  Args:
    q: [B, T, H, K]; k: [B, T, KVH, K]; v: [B, T, KVH, Kv]; fp32 or bf16; KVH divides H.
    bias: `ops.bias.FPABias(field, level)` or `FoXBias(c)`, [B, T, KVH].
    scale: logit scale.
    skip_tolerance: eps in (0, 1): drop the tiles `chunked.dead_tiles` drops at this tile size
      (each row loses weight <= eps), or None: every causal tile (exact).
    segment_ids: optional [B, T] int.
    block_sizes: as in `pallas_attention`, one tile for all three kernels (the dropped tiles are
      the forward's); a `BlockSizes` with another backward tile raises.
    interpret: the Pallas interpreter; default: on anything but TPU / GPU.
    backend: as in `pallas_attention`; "gpu" raises (Triton has no scalar prefetch).
  Returns:
    [B, T, H, Kv] in q's dtype: `chunked_attention(..., block_size=tile, skip_tolerance=...)` up to
    rounding, values and gradients.
  """
  pc.check_backend(backend, interpret)
  b, t, h, d = q.shape
  dv = v.shape[-1]
  if b == 0 or t == 0:
    return jnp.zeros((b, t, h, dv), q.dtype)
  interpret, mode = pc.run_mode(interpret, backend)
  if mode == "gpu":
    raise ValueError(PALLAS_SKIP_GPU)
  bs = pc.check_blocks(block_sizes, mode)
  if bs.backward != bs.fwd:
    raise ValueError(
      f"skip_tolerance drops the same tiles in the forward and backward kernels: one tile size, got "
      f"{bs}; pass block_size={bs.fwd}"
    )
  if not isinstance(bias, (FPABias, FoXBias)):
    raise TypeError(f"bias must be an ops.bias.FPABias or FoXBias, got {type(bias).__name__}")
  blk = pc.fit(bs.fwd, t, False)  # = chunked.block_for(t, bs.fwd): the chunked kernel's tiles
  nb = -(-t // blk)
  tp = nb * blk
  dead = None
  if skip_tolerance is not None:
    dead = _chunked._dead_tiles(q, k, bias, bias.stats(nb, blk), scale, skip_tolerance, nb, blk)
  st = bias.kernel_stats(blk, tp)
  prep = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), [(0, 0), (0, 0), (0, tp - t), (0, 0)])
  seg = None
  if segment_ids is not None:
    s = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, tp - t)], constant_values=-1)
    seg = (s[:, :, None], s[:, None, :])
  kvh = k.shape[2]
  cfg = _SparseCfg(bias.kind, float(scale), blk, blk, interpret, mode, h // kvh, kvh, nb)
  lists = tuple(x.reshape(-1) for x in tile_lists(dead, (b, kvh, nb)))
  o = _core(cfg, prep(q), prep(k), prep(v), st, seg, lists)
  return jnp.swapaxes(o[:, :, :t], 1, 2)
