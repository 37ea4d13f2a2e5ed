"""Names and dtypes shared by every attention op: the bottom layer of `fpa_jax.ops`.

It imports nothing from fpa_jax, so `validate`, `chunked`, `pallas` and the rest can all import it
without a cycle. Public paths re-export from here (`fpa_jax.ops.pallas.BlockSizes`,
`fpa_jax.ops.validate.IMPLS`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax.numpy as jnp

# The one definition of the implementation names (typed as `jax.nn.dot_product_attention` types
# its `implementation`); IMPLS is derived from it for runtime checks and listings.
Implementation = Literal["quadratic", "chunked", "recurrent", "pallas", "auto"]
IMPLS: tuple[str, ...] = get_args(Implementation)
# What skip_tolerance drops, forward and backward: whole tiles (`chunked`, and the block-sparse Pallas
# kernels) or single keys per query block (`sparse`; chunked only), their chunks scheduled per block
# automatically ("keys"), in one loop shared by every (batch row, kv head) ("keys_shared") or per
# (row, kv head) ("keys_per_head").
Skip = Literal["tiles", "keys", "keys_shared", "keys_per_head"]
SKIPS: tuple[str, ...] = get_args(Skip)
# The tiled impls, which take a block_size ("auto" resolves to one of them).
BLOCKED = ("chunked", "pallas", "auto")

# float32, by one name across the package (ops, gates, layers, inference).
F32 = jnp.float32
# Field, levels, penalties and softmax statistics are always fp32, whatever q/k/v are.
STATS_DTYPE = F32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Square tile sizes (query block = key block) of the forward and the two backward kernels.

  TPU wants multiples of 128 (lanes) unless a block covers all of T; Triton wants powers of two
  >= 16. Blocks shrink for short sequences; T is padded to a multiple of both sizes.
  """

  fwd: int
  bwd: int | None = None  # None: same as fwd

  @property
  def backward(self) -> int:
    return self.fwd if self.bwd is None else self.bwd

  @classmethod
  def default(cls, backend: str) -> "BlockSizes":
    """backend: "tpu", "gpu", or anything else (interpret mode)."""
    return _DEFAULT_BLOCKS.get(backend, _DEFAULT_BLOCKS["interpret"])


_DEFAULT_BLOCKS = {"tpu": BlockSizes(128), "gpu": BlockSizes(64), "interpret": BlockSizes(32)}
