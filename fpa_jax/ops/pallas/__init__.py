"""Pallas kernels for FPA and FoX (`impl="pallas"`): see `kernels.py`, and `block_sparse.py` for
`skip_tolerance` (run in interpret mode only). `backend` picks what they are built for ("auto",
"interpret", "tpu", "gpu"); `lowering.lower_for` lowers them for TPU / GPU without the hardware."""

from fpa_jax.ops.common import BlockSizes
from fpa_jax.ops.pallas.block_sparse import block_sparse_attention
from fpa_jax.ops.pallas.common import BACKENDS, Backend
from fpa_jax.ops.pallas.kernels import pallas_attention
from fpa_jax.ops.pallas.lowering import PLATFORMS, Platform, lower_for, lowered_kernels

__all__ = [
  "BACKENDS",
  "PLATFORMS",
  "Backend",
  "BlockSizes",
  "Platform",
  "block_sparse_attention",
  "lower_for",
  "lowered_kernels",
  "pallas_attention",
]
