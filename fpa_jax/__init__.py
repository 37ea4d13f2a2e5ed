"""fpa_jax: First Passage Attention in JAX / Flax NNX."""

__version__ = "0.1.0"
