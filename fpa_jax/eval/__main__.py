"""`python -m fpa_jax.eval ...`: the command line (`fpa_jax.eval.cli`); `python -m fpa_jax.eval retrieval ...`:
the retrieval suite's (`fpa_jax.eval.retrieval`)."""

import sys

from fpa_jax.eval.cli import main

if __name__ == "__main__":
  if sys.argv[1:2] == ["retrieval"]:  # the suite has its own flags (`fpa_jax.eval.retrieval`)
    from fpa_jax.eval.retrieval import main as retrieval_main

    sys.exit(retrieval_main(sys.argv[2:]))
  sys.exit(main())
