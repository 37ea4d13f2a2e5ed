"""`python -m fpa_jax.eval ...`: the command line (`fpa_jax.eval.cli`)."""

import sys

from fpa_jax.eval.cli import main

if __name__ == "__main__":
  sys.exit(main())
