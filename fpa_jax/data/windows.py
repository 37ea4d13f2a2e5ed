"""Text as a random-access set of fixed-length windows: training rows from many documents, exact resume.

Packing documents in order and batching consecutive rows makes every batch (and the next few dozen
steps) chunks of one file. Instead, a split's documents are tokenized once, each as BOS doc EOS,
into one flat token file beside the built dataset, and a row is any window of it:

    window at flat position s, length L: inputs = tokens[s : s+L], targets = tokens[s+1 : s+L+1]

A pair whose input and target lie in different documents (EOS -> the next BOS) has loss 0, and the
segment id steps there (1, 2, ... within the row), so attention never crosses a document (as with
packing) and every target is the true next token of its own document. Training windows tile the
stream (s = 0, L, 2L, ...; the last one zero-padded), and the pipeline shuffles their *indices*
globally each epoch (`grain.MapDataset.shuffle`, a seeded index permutation): a batch's rows are
uniform draws over the whole split, and the iterator's state is one integer, so resume is exact.

The held-out set (`heldout_starts`) is a fixed sample of windows spread over every document of a
split: one window inside each document (at a seeded offset), the rest evenly spaced over the
stream; the same for every run at a given length. `coverage` says how many documents and tokens
it scores.

Files (built by `sources.prepare`, once per job; `build_token_file`):
  <builder dir>/tokens_<tokenizer>/<split>.bin   tokens, uint16 when the vocabulary fits, else int32
  <builder dir>/tokens_<tokenizer>/<split>.json  {"dtype", "n_tokens", "n_docs", "starts": [n_docs + 1]}
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import numpy as np

VERSION = 1  # bump to rebuild token files whose layout changed


def token_dir(builder_dir: str, tokenizer: str) -> str:
  return os.path.join(builder_dir, f"tokens_{tokenizer.replace(':', '')}")


def build_token_file(
  texts: Iterable[str], encode: Callable[[str], list[int]], bos: int, eos: int, vocab: int, path: str
) -> None:
  """Tokenize `texts` (one document each) into `path`.bin / .json; written to temporary names, then
  renamed, so a crash leaves no half file (and concurrent readers see whole files or none)."""
  dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  starts, n = [0], 0
  with open(tmp + ".bin", "wb") as f:
    for t in texts:
      toks = np.asarray([bos, *encode(t), eos], dtype)
      f.write(toks.tobytes())
      n += len(toks)
      starts.append(n)
  meta = {"version": VERSION, "dtype": np.dtype(dtype).name, "n_tokens": n, "n_docs": len(starts) - 1, "starts": starts}
  with open(tmp + ".json", "w") as f:
    json.dump(meta, f)
  os.replace(tmp + ".bin", path + ".bin")
  os.replace(tmp + ".json", path + ".json")  # last: its presence means the pair is complete


def token_file_ready(path: str) -> bool:
  try:
    with open(path + ".json") as f:
      return json.load(f).get("version") == VERSION and os.path.exists(path + ".bin")
  except (OSError, ValueError):
    return False


class TokenFile:
  """A built split: `tokens` (memmap [n_tokens]) and document `starts` (int64 [n_docs + 1])."""

  def __init__(self, path: str):
    if not token_file_ready(path):
      raise ValueError(
        f"token file {path}.bin/.json is not built: run python -m fpa_jax.data.prepare (or make_pipeline on process 0)"
      )
    with open(path + ".json") as f:
      meta = json.load(f)
    self.path = path
    self.starts = np.asarray(meta["starts"], np.int64)
    self.n_tokens = int(meta["n_tokens"])
    self.tokens = np.memmap(path + ".bin", dtype=meta["dtype"], mode="r", shape=(self.n_tokens,))

  @property
  def n_docs(self) -> int:
    return len(self.starts) - 1

  def doc_of(self, pos: np.ndarray) -> np.ndarray:
    """Document index of flat positions `pos`."""
    return np.searchsorted(self.starts, pos, side="right") - 1


def _row(tf: TokenFile, s: int, L: int) -> dict[str, np.ndarray]:
  row = {
    "inputs": np.zeros(L, np.int32),
    "targets": np.zeros(L, np.int32),
    "segment_ids": np.zeros(L, np.int32),
    "loss_mask": np.zeros(L, np.float32),
  }
  if s < 0:  # a padding row (held-out sets padded to a whole number of batches)
    return row
  span = np.asarray(tf.tokens[s : s + L + 1], np.int32)
  n = len(span) - 1
  if n <= 0:
    return row
  docs = tf.doc_of(np.arange(s, s + n + 1))
  row["inputs"][:n], row["targets"][:n] = span[:-1], span[1:]
  row["segment_ids"][:n] = docs[:-1] - docs[0] + 1
  row["loss_mask"][:n] = docs[:-1] == docs[1:]
  return row


class WindowSource:
  """grain random-access source: item i is the row of the window at `starts[i]`, or, with
  `starts=None`, at i * seq_len (the tiling of the stream used for training)."""

  def __init__(self, tf: TokenFile, seq_len: int, starts: np.ndarray | None = None):
    self.tf, self.seq_len = tf, int(seq_len)
    self.starts = None if starts is None else np.asarray(starts, np.int64)
    self._n = len(self.starts) if starts is not None else max(1, -(-(tf.n_tokens - 1) // self.seq_len))

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    i = int(i) % self._n
    s = int(self.starts[i]) if self.starts is not None else i * self.seq_len
    return _row(self.tf, s, self.seq_len)

  def __repr__(self) -> str:
    return f"WindowSource({self.tf.path!r}, seq_len={self.seq_len}, n={self._n})"


def heldout_starts(tf: TokenFile, seq_len: int, n_windows: int, seed: int = 0) -> np.ndarray:
  """A fixed sample of `n_windows` window starts spread over every document (sorted int64).

  With n_windows >= n_docs: one window in each document (at a seeded offset, wholly inside it when
  the document is longer than a window), the rest at evenly spaced stream positions (so long
  documents get more, by their share of the tokens). With fewer windows than documents: one window
  in each of `n_windows` documents evenly spaced over the split's (sorted) document order.
  """
  if n_windows < 1:
    raise ValueError(f"n_windows must be >= 1, got {n_windows}")
  L, N = int(seq_len), tf.n_tokens
  lens = np.diff(tf.starts)
  docs = np.arange(tf.n_docs) if n_windows >= tf.n_docs else np.linspace(0, tf.n_docs - 1, n_windows).round()
  docs = np.unique(docs.astype(np.int64))
  rng = np.random.default_rng([seed, L])
  room = np.maximum(lens[docs] - L, 1)  # last pair of a doc is (.., EOS): start <= start_d + len_d - L - 1
  starts = tf.starts[docs] + (rng.random(len(docs)) * room).astype(np.int64)
  extra = n_windows - len(starts)
  if extra > 0:
    starts = np.concatenate([starts, np.linspace(0, max(N - L - 1, 0), extra).astype(np.int64)])
  return np.sort(np.clip(starts, 0, max(N - 2, 0)))


def coverage(tf: TokenFile, starts: np.ndarray, seq_len: int) -> dict:
  """What a set of windows scores: documents with at least one scored pair, and scored pairs."""
  rows = [_row(tf, int(s), seq_len) for s in starts]
  scored = np.concatenate([np.arange(s, s + seq_len)[r["loss_mask"] > 0] for s, r in zip(starts, rows)])
  docs = np.unique(tf.doc_of(scored)) if scored.size else np.array([], np.int64)
  return {
    "windows": int(len(starts)),
    "seq_len": int(seq_len),
    "docs_covered": int(len(docs)),
    "docs_in_split": int(tf.n_docs),
    "pairs_scored": int(scored.size),
    "distinct_pairs_scored": int(np.unique(scored).size),
    "tokens_in_split": int(tf.n_tokens),
  }
