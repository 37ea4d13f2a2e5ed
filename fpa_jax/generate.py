"""Deprecated: the generation command line is `python -m fpa_jax.inference` now.

This module's name was also the function `fpa_jax.inference.generate`; `python -m fpa_jax.generate`
still runs the command line, with a warning.
"""

from __future__ import annotations

import sys
import warnings

from fpa_jax.inference.__main__ import main, parse_args

__all__ = ["main", "parse_args"]

warnings.warn(
  "python -m fpa_jax.generate is python -m fpa_jax.inference now (fpa_jax.generate still works)",
  FutureWarning,
  stacklevel=2,
)

if __name__ == "__main__":
  sys.exit(main())
