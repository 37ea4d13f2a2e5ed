"""One flag style for the package's command lines (`fpa_jax.train`, `fpa_jax.inference`,
`fpa_jax.eval`): words joined by dashes (`--data-dir`, `--no-progress`), as argparse and the
`experiments/` scripts spell them. The other spelling (`--data_dir`) is still accepted, with one
warning per flag, so older commands keep working.

    args = cli.parse(parser, argv)   # argparse.ArgumentParser whose flags are all dashed
"""

from __future__ import annotations

import argparse
import sys
import warnings


def respell(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
  """argv with every `--under_scored` flag that `parser` knows as `--under-scored` respelled (and
  `--flag_x=value` alike), warning once per flag; anything else is left for argparse to judge."""
  known = {s for a in parser._actions for s in a.option_strings}
  out = []
  for arg in argv:
    flag, eq, value = arg.partition("=")
    if flag.startswith("--") and "_" in flag and flag not in known:
      dashed = "--" + flag[2:].replace("_", "-")
      if dashed in known:
        warnings.warn(f"{flag} is spelled {dashed} now; {flag} still works", FutureWarning, stacklevel=3)
        arg = dashed + eq + value
    out.append(arg)
  return out


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
  return parser.parse_args(respell(parser, sys.argv[1:] if argv is None else list(argv)))
