"""The model's forward pass, jitted, for tests that compare against it: an eager NNX forward
dispatches (and compiles) the chunked kernel op by op, several times slower than one compile."""

from __future__ import annotations

from flax import nnx


@nnx.jit
def forward(model, tokens, segment_ids=None):
  """DecoderLM logits [B, T, V] of tokens [B, T] (segment_ids [B, T] or None)."""
  return model(tokens, segment_ids=segment_ids)
