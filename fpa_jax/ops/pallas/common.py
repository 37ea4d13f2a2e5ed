"""What the dense (`kernels`) and block-sparse (`block_sparse`) Pallas kernels share: the call
configuration, the tile's bias / mask / logits, the tile bodies (the online softmax step, the
dK / dV and dQ tiles: one tile kernel for FPA and FoX, dense or block-sparse), kernel-ref
unpacking, the optional operands, the block-pair statistic's row layout, the group sum of
per-query-head partials, the tile-size checks and the target backend (`run_mode`). Both kernel modules
import this one and not each other at the top (`kernels.pallas_attention` hands skip_tolerance to
`block_sparse` inside the function), so the package has no import circle."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fpa_jax.ops.bias import Kind
from fpa_jax.ops.common import F32, BlockSizes
from fpa_jax.ops.first_passage import n_levels
from fpa_jax.ops.pallas.tile_bias import INF, tile_bias

NEG = -1e30  # finite mask value: exp(NEG - m) == 0 without any inf - inf

# What the kernels are built for: "auto" the backend JAX runs on (the interpreter off TPU / GPU),
# "interpret" the Pallas interpreter, "tpu" / "gpu" Mosaic / Triton whatever JAX runs on (on a
# machine without one, for lowering through `jax.export`: `lowering.lower_for`).
Backend = Literal["auto", "interpret", "tpu", "gpu"]
BACKENDS: tuple[str, ...] = get_args(Backend)


@dataclasses.dataclass(frozen=True)
class Cfg:
  kind: Kind
  scale: float
  fwd: int
  bwd: int
  interpret: bool
  backend: str  # "tpu" | "gpu" | "interpret": `run_mode`'s mode
  group: int = 1  # G = H / KVH: query head h reads kv head h // G

  def compiler_params(self):
    if self.backend == "tpu":
      from jax.experimental.pallas import tpu as pltpu

      return pltpu.CompilerParams(dimension_semantics=("parallel",) * 3)  # every program writes its own blocks
    if self.backend == "gpu":
      from jax.experimental.pallas import triton as plgpu

      return plgpu.CompilerParams(num_warps=4, num_stages=2)
    return None

  def call(self, kernel, **kw):
    return pl.pallas_call(kernel, interpret=self.interpret, compiler_params=self.compiler_params(), **kw)


# ----------------------------------------------------------------------------- tile helpers


def dot_nt(a, b):  # a [m, k], b [n, k] -> a @ b.T [m, n] fp32
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def dot(a, b):  # a [m, k], b [k, n] -> [m, n] fp32
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def pick(row, idx):
  """row[0, idx] of a [1, n] vector as [1, 1] (a masked reduce: no dynamic lane indexing)."""
  iota = jax.lax.broadcasted_iota(jnp.int32, row.shape, 1)
  return jnp.min(jnp.where(iota == idx, row, INF), axis=1, keepdims=True)


def tile_terms(cfg, blk, kvec, qvec, r, qseg, kseg, diag):
  """A tile's (bias [bq, bk] fp32, mask [bq, bk] bool or None, bias pullback): one per kv head,
  shared by the query heads of its group."""
  dist = None
  if diag:
    dist = jax.lax.broadcasted_iota(jnp.int32, (blk, blk), 0) - jax.lax.broadcasted_iota(jnp.int32, (blk, blk), 1)
  bias, pull = tile_bias(cfg.kind, n_levels(blk), kvec, qvec, r, dist)
  mask = None if dist is None else dist >= 0
  if qseg is not None:
    same = qseg == kseg  # [bq, 1] == [1, bk]
    mask = same if mask is None else mask & same
  return bias, mask, pull


def masked_logits(cfg, q, k, bias, mask):
  """q [bq, K], k [bk, K] -> masked logits [bq, bk] fp32."""
  s = dot_nt(q, k) * cfg.scale + bias
  return s if mask is None else jnp.where(mask, s, NEG)


# The tile bodies both kernel modules run: they differ only in how a tile reaches the kernel
# (a slice of a whole-T block there, a block fetched from a prefetched list here).


def softmax_start(s, v):
  """The online softmax's first tile, the diagonal (never masked, so m is finite from here on):
  logits s [bq, bk] fp32, v [bk, Kv] -> (m [bq, 1], l [bq, 1], acc [bq, Kv]) fp32."""
  m = s.max(1, keepdims=True)
  p = jnp.exp(s - m)
  return m, p.sum(1, keepdims=True), dot(p.astype(v.dtype), v)


def softmax_step(state, s, v):
  """One more key tile into the online softmax state (m, l, acc): logits s [bq, bk], v [bk, Kv]."""
  m, l, acc = state
  m_new = jnp.maximum(m, s.max(1, keepdims=True))
  corr = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new)
  return m_new, l * corr + p.sum(1, keepdims=True), acc * corr + dot(p.astype(v.dtype), v)


def dkv_tile(cfg, terms, k, v, heads, dk, dv):
  """The dK / dV kernels' tile: key block k [bk, K], v [bk, Kv] of one kv head against a query block
  of each query head of its group, heads(g) -> (q [bq, K], do [bq, Kv], lse [bq, 1], delta [bq, 1]).
  terms: `tile_terms`'s (bias, mask, pull). dk, dv: the fp32 sums so far. -> (dk, dv, the key stat
  rows' cotangents {row n: [1, bk]}, R's [1, 1] cotangent or None)."""
  bias, mask, pull = terms
  ds_group = None
  for g in range(cfg.group):  # the group's query heads share k, v and the bias: sum in here
    q, do, lse, delta = heads(g)
    p = jnp.exp(masked_logits(cfg, q, k, bias, mask) - lse)  # masked entries: exactly 0
    dv = dv + dot(p.astype(do.dtype).T, do)
    ds = p * (dot_nt(do, v) - delta)  # d loss / d logit = d loss / d bias
    dk = dk + dot(ds.astype(q.dtype).T, q) * cfg.scale
    ds_group = ds if ds_group is None else ds_group + ds
  rows, d_r = pull(ds_group, "key")
  return dk, dv, rows, d_r


def dq_tile(cfg, terms, q, k, v, do, lse, delta):
  """The dQ kernels' tile: one query head's q [bq, K], do [bq, Kv], lse, delta [bq, 1] against key
  block k [bk, K], v [bk, Kv]. -> (this tile's dq [bq, K] fp32, the query stat columns' cotangents
  {column n: [bq, 1]})."""
  bias, mask, pull = terms
  p = jnp.exp(masked_logits(cfg, q, k, bias, mask) - lse)
  ds = p * (dot_nt(do, v) - delta)
  return dot(ds.astype(k.dtype), k) * cfg.scale, pull(ds, "query")


def add_r_cotangent(dr, d_r, i):
  """dr [1, nbp] (R[:, J]'s cotangent as a row) + d_r [1, 1] at entry i."""
  return dr + jnp.where(jax.lax.broadcasted_iota(jnp.int32, dr.shape, 1) == i, d_r, 0.0)


def with_optional(args, specs, r, r_spec, seg, seg_specs):
  """A kernel's operands and BlockSpecs, then the optional ones in the order `unpack` reads them: R
  in `r_rows` layout (or None), the segment ids (query column, key row; or None)."""
  if r is not None:
    args, specs = args + [r], specs + [r_spec]
  if seg is not None:
    args, specs = args + list(seg), specs + list(seg_specs)
  return args, specs


def unpack(refs, n_in, has_r, has_seg):
  """Kernel refs -> (fixed inputs, r, qseg, kseg, outputs)."""
  refs = list(refs)
  fixed, rest = refs[:n_in], refs[n_in:]
  r = rest.pop(0) if has_r else None
  qseg, kseg = (rest.pop(0), rest.pop(0)) if has_seg else (None, None)
  return fixed, r, qseg, kseg, rest


def stats_dims(st):
  """Kernel stats (krow [B, KVH, nr, Tp], qcol [B, KVH, Tp, nc], r) -> (krow, qcol, r, nr, nc)."""
  krow, qcol, r = st
  return krow, qcol, r, krow.shape[2], qcol.shape[3]


def r_rows(r, nbp):
  """r [B, H, nb, nb] -> [B, H, nb, 1, nbp]: row x of a program's block is a [1, nbp] vector."""
  r = jnp.pad(r, [(0, 0), (0, 0), (0, 0), (0, nbp - r.shape[-1])], constant_values=INF)
  return r[:, :, :, None, :]


def group_sum(x, g, dtype):
  """[B, H, ...] per-query-head partials -> [B, H / g, ...] summed over each group, in dtype."""
  if g == 1:
    return x.astype(dtype)
  return x.reshape((x.shape[0], x.shape[1] // g, g) + x.shape[2:]).sum(2).astype(dtype)


def check_backend(backend, interpret=None, *, name="backend"):
  """backend one of BACKENDS, and interpret not False with "interpret"."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown {name} {backend!r}: the {name} must be one of {BACKENDS}")
  if backend == "interpret" and interpret is False:
    raise ValueError(
      f"{name}='interpret' runs the Pallas interpreter: leave interpret unset, or pick {name}='tpu' / 'gpu'"
    )


def run_mode(interpret, backend: Backend = "auto"):
  """(interpret, mode): mode is "tpu", "gpu" or "interpret" (what `check_blocks`, `fit` and
  `Cfg.backend` take: the tiles, padding and compiler params the kernels are built with).

  backend "auto": JAX's backend, interpret None meaning the interpreter on anything but TPU / GPU.
  "interpret": the interpreter's kernels, interpreted. "tpu" / "gpu": that target's kernels,
  compiled (interpret None or False; lowering them off the hardware is `lowering.lower_for`), or
  with interpret=True run in the interpreter: the same tiles and padding, checked on CPU."""
  check_backend(backend, interpret)
  if backend == "auto":
    backend = jax.default_backend()
    if interpret is None:
      interpret = backend not in ("tpu", "gpu")
    return bool(interpret), "interpret" if interpret else backend
  if backend == "interpret":
    return True, "interpret"
  return bool(interpret), backend


def fit(blk, t, pow2):
  """The tile used for length t: the requested size, shrunk for short sequences."""
  if pow2:
    return min(blk, max(16, pl.next_power_of_2(t)))
  return min(blk, -(-t // 8) * 8)


def check_blocks(block_sizes, mode):
  if block_sizes is None:
    return BlockSizes.default(mode)
  if isinstance(block_sizes, int):
    block_sizes = BlockSizes(block_sizes)
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block sizes must be an int or a BlockSizes, got {block_sizes!r}")
  for n in (block_sizes.fwd, block_sizes.backward):
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"block sizes must be positive ints, got {block_sizes}")
    if mode == "gpu" and (n < 16 or n & (n - 1)):
      raise ValueError(f"Triton tiles must be powers of two >= 16, got {block_sizes}")
  return block_sizes


def flash_core(forward, backward):
  """The custom VJP of a flash kernel pair: forward(cfg, q, k, v, stats, seg) -> (o, lse) and
  backward(cfg, q, k, v, do, lse, delta, stats, seg) -> (dq, dk, dv, dstats) ->
  core(cfg, q, k, v, fst, bst, seg) -> o. fst / bst: the bias stats at the forward / backward tile
  size (bst None: the same tiles; else the forward's stats only shaped the output, no gradient)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def core(cfg, q, k, v, fst, bst, seg):
    return forward(cfg, q, k, v, fst, seg)[0]

  def core_fwd(cfg, q, k, v, fst, bst, seg):
    o, lse = forward(cfg, q, k, v, fst, seg)
    return o, (q, k, v, fst, bst, seg, o, lse)

  def core_bwd(cfg, res, do):
    q, k, v, fst, bst, seg, o, lse = res
    delta = jnp.sum(do.astype(F32) * o.astype(F32), -1, keepdims=True)  # [B, H, Tp, 1]
    dq, dk, dv, dst = backward(cfg, q, k, v, do, lse, delta, fst if bst is None else bst, seg)
    dfst, dbst = (dst, None) if bst is None else (jax.tree.map(jnp.zeros_like, fst), dst)
    return dq, dk, dv, dfst, dbst, jax.tree.map(lambda _: None, seg)

  core.defvjp(core_fwd, core_bwd)
  return core
