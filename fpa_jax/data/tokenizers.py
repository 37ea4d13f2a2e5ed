"""Tokenizers: raw bytes (default, no files) and SentencePiece trained offline on `fpa_text`.

Both share one interface: `encode(str) -> list[int]`, `decode(list[int]) -> str`, `vocab_size`,
`pad_id`, `bos_id`, `eos_id`. Id 0 is always padding so packed rows can be zero-filled.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Protocol

import sentencepiece as spm

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_SPM_VOCAB = 32000  # `base110m`


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted by 3: ids 0/1/2 are pad/bos/eos, byte b is id b + 3 (vocab 259)."""

  offset = 3
  pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
  vocab_size = 256 + offset
  name = "bytes"

  def encode(self, text: str) -> list[int]:
    return [b + self.offset for b in text.encode("utf-8")]

  def decode(self, ids: Iterable[int]) -> str:
    # Specials are dropped; a cut multi-byte character decodes to U+FFFD rather than raising.
    data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.vocab_size)
    return data.decode("utf-8", errors="replace")


class SpmTokenizer:
  """A SentencePiece model configured to round-trip arbitrary text (code included) exactly."""

  def __init__(self, model_path: str):
    self.path = str(model_path)
    self._sp = spm.SentencePieceProcessor(model_file=self.path)
    self.vocab_size = int(self._sp.get_piece_size())
    self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID
    self.name = f"spm:{self.vocab_size}"

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids if int(i) > EOS_ID])


def train_spm(lines: Iterable[str], model_prefix: str, vocab_size: int, seed: int = 0) -> str:
  """Train a SentencePiece model from an iterator of lines; returns the `.model` path.

  Identity normalisation, no dummy prefix, kept whitespace and byte fallback make
  `decode(encode(s)) == s` for any string -- indentation matters for source code.
  """
  os.makedirs(os.path.dirname(model_prefix) or ".", exist_ok=True)
  spm.set_random_generator_seed(seed)  # sentence sampling is seeded -> reproducible models
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_prefix=model_prefix,
    vocab_size=vocab_size,
    hard_vocab_limit=False,  # a small corpus may not support the requested size
    model_type="unigram",
    character_coverage=1.0,
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    pad_id=PAD_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    unk_id=3,
    input_sentence_size=2_000_000,
    shuffle_input_sentence=True,
    num_threads=2,
    minloglevel=2,
  )
  return model_prefix + ".model"


def parse_tokenizer_name(name: str) -> tuple[str, int | None]:
  """`"bytes"` -> ("bytes", None); `"spm"` -> ("spm", 32000); `"spm:N"` -> ("spm", N)."""
  if name == "bytes":
    return "bytes", None
  if name == "spm":
    return "spm", DEFAULT_SPM_VOCAB
  m = re.fullmatch(r"spm:(\d+)", name or "")
  if m and int(m.group(1)) >= 260:
    return "spm", int(m.group(1))
  raise ValueError(
    f"unknown tokenizer {name!r}: valid are 'bytes', 'spm' (vocab {DEFAULT_SPM_VOCAB}) "
    "or 'spm:N' with N >= 260 (byte fallback needs 256 ids plus specials)"
  )


def spm_model_path(data_dir: str, vocab_size: int, small: bool = False) -> str:
  """Where the SentencePiece model for `fpa_text` lives: next to the data, under `data_dir/spm/`."""
  tag = "fpa_text_small" if small else "fpa_text"
  return os.path.join(os.fspath(data_dir), "spm", f"{tag}_v{vocab_size}.model")


def load_tokenizer(name: str = "bytes", data_dir: str | None = None, *, small: bool = False):
  """The tokenizer `name`, loaded only: a missing SentencePiece model is a FileNotFoundError.

  Training one needs the `fpa_text` corpus, a higher layer: `fpa_jax.data.get_tokenizer`
  (`sources.get_tokenizer`) trains a missing model, then loads it with this.
  """
  kind, vocab = parse_tokenizer_name(name)
  if kind == "bytes":
    return ByteTokenizer()
  if data_dir is None:
    raise ValueError(f"tokenizer {name!r} needs data_dir (the model is saved next to the data)")
  path = spm_model_path(data_dir, vocab, small)
  if not os.path.exists(path):
    raise FileNotFoundError(
      f"SentencePiece model {path} not found: build it with python -m fpa_jax.data.prepare "
      f"--data-dir {data_dir} --only text --spm-vocab {vocab}{' --small' if small else ''}"
    )
  return SpmTokenizer(path)
