"""Pallas kernels for FPA and FoX (`impl="pallas"`): see `kernels.py` (tested in interpret mode only)."""

from fpa_jax.ops.pallas.kernels import BlockSizes, pallas_attention

__all__ = ["BlockSizes", "pallas_attention"]
