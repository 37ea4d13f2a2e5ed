"""Pallas kernels for FPA and FoX (`impl="pallas"`): see `kernels.py`, and `block_sparse.py` for
`skip_tolerance` (tested in interpret mode only)."""

from fpa_jax.ops.common import BlockSizes
from fpa_jax.ops.pallas.block_sparse import block_sparse_attention
from fpa_jax.ops.pallas.kernels import pallas_attention

__all__ = ["BlockSizes", "block_sparse_attention", "pallas_attention"]
