"""One flag style for the package's command lines (`fpa_jax.train`, `fpa_jax.inference`,
`fpa_jax.eval`): words joined by dashes (`--data-dir`, `--no-progress`), as argparse and the
`experiments/` scripts spell them; `--data_dir` is an unknown flag.

    args = cli.parse(parser, argv)   # argparse.ArgumentParser whose flags are all dashed
"""

from __future__ import annotations

import argparse
import sys


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
  return parser.parse_args(sys.argv[1:] if argv is None else list(argv))
