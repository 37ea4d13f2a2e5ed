"""Build every dataset (and optionally the SentencePiece model) under one data dir, offline.

    python -m fpa_jax.data.prepare --data-dir DIR [--only NAME] [--small]
        [--text-dir PATH | --text-source tfds:pg19] [--spm-vocab N]

NAME is one of scopes, dips, passkey, text (or the builder names fpa_scopes, ...).
"""

from __future__ import annotations

import argparse
import logging

from tqdm import tqdm

from fpa_jax.data import sources
from fpa_jax.data.pipeline import TASKS


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
    prog="python -m fpa_jax.data.prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--data-dir", required=True)
  ap.add_argument("--only", default=None, help=f"one of {TASKS} (or fpa_<task>)")
  ap.add_argument("--small", action="store_true", help="tiny configs (seconds; tests, smoke runs)")
  ap.add_argument("--text-dir", default=None, help="local text corpus instead of the stdlib sources")
  ap.add_argument("--text-source", default=None, help="tfds:NAME catalog dataset (needs network once)")
  ap.add_argument("--spm-vocab", type=int, default=0, help="also train a SentencePiece model of this size")
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO)

  tasks = TASKS
  if args.only:
    name = args.only.removeprefix("fpa_")
    if name not in TASKS:
      ap.error(f"--only {args.only!r}: valid are {TASKS}")
    tasks = (name,)
  source = args.text_dir or args.text_source or "stdlib"
  for task in tqdm(tasks, desc="datasets"):
    b = sources.prepare(task, args.data_dir, small=args.small, text_source=source)
    print(f"{b.info.full_name}: {dict((k, v.num_examples) for k, v in b.info.splits.items())}")
  if args.spm_vocab:
    tok = sources.get_tokenizer(f"spm:{args.spm_vocab}", args.data_dir, small=args.small)
    print(f"SentencePiece model {tok.path} (vocab {tok.vocab_size})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
