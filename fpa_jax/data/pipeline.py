"""grain pipelines: source -> shard by process -> shuffle -> repeat -> (tokenize -> pack) -> batch.

Text is a map-style dataset of fixed-length windows over the tokenized split (`windows`): its rows
are shuffled globally each epoch, so a batch holds rows of many documents; `make_heldout` is the
fixed held-out sample of windows spread over every validation document. The other tasks pack whole
documents (prompts, scope strings) into rows after a record-level shuffle.

Every batch is a dict of numpy arrays ([batch, seq_len] each):
  inputs int32, targets int32 (next-token), segment_ids int32 (1, 2, 3, ... per packed document
  piece in a row, 0 = padding), loss_mask float32 (1 where the target counts).
Packing works on next-token *pairs*, so a target is always the true next token of the same
document and attention (masked by segment_ids) never crosses documents. The test-only `synthetic`
task yields batches of the same format from memory (`synthetic.SyntheticPipeline`), without grain.
"""

from __future__ import annotations

import logging

import grain
import jax
import numpy as np

from fpa_jax.configs import TASKS, TEST_TASKS  # noqa: F401 - one definition; TASKS re-exported
from fpa_jax.data import builders, dips, passkey, scopes, sources, windows
from fpa_jax.data.synthetic import SyntheticPipeline, make_synthetic
from fpa_jax.data.tokenizers import load_tokenizer, parse_tokenizer_name

log = logging.getLogger(__name__)

KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


class PackIterDataset(grain.IterDataset):
  """Pack documents `{"tokens": int32 [n], "mask": float32 [n-1]}` into rows of `seq_len` pairs.

  `split_docs=True` (text) fills every row, continuing a document in the next row. Otherwise a
  document that fits in a row is never cut (the row is padded instead) -- a passkey or query
  must see its whole context -- and only documents longer than a row are cut into row chunks,
  or, with `cut_long_docs=False` (passkey), raise ValueError: a cut prompt's answer row would
  never see the needle.
  """

  def __init__(self, parent: grain.IterDataset, seq_len: int, split_docs: bool, cut_long_docs: bool = True):
    super().__init__(parent)
    self.seq_len, self.split_docs, self.cut_long_docs = seq_len, split_docs, cut_long_docs

  def __iter__(self):
    return _PackIterator(self._parent.__iter__(), self.seq_len, self.split_docs, self.cut_long_docs)


class _PackIterator(grain.DatasetIterator):
  def __init__(self, parent, seq_len: int, split_docs: bool, cut_long_docs: bool = True):
    super().__init__(parent)
    self._len, self._split, self._cut = seq_len, split_docs, cut_long_docs
    self._doc, self._doc_state, self._offset = None, None, 0

  def _load_doc(self):
    # Remember the parent state *before* this document: the checkpoint is then just
    # (that state, offset into the document), small and exact.
    self._doc_state = self._parent.get_state()
    self._doc, self._offset = next(self._parent), 0

  def __next__(self) -> dict[str, np.ndarray]:
    L = self._len
    row = {
      "inputs": np.zeros(L, np.int32),
      "targets": np.zeros(L, np.int32),
      "segment_ids": np.zeros(L, np.int32),
      "loss_mask": np.zeros(L, np.float32),
    }
    pos, seg = 0, 0
    while pos < L:
      if self._doc is None:
        try:
          self._load_doc()
        except StopIteration:
          if pos == 0:
            raise
          break
      toks, mask = self._doc["tokens"], self._doc["mask"]
      remaining = len(mask) - self._offset
      if remaining <= 0:
        self._doc = None
        continue
      space = L - pos
      if not self._split and not self._cut and len(mask) > L:
        raise ValueError(
          f"a document of {len(mask)} next-token pairs does not fit in seq_len={L}; "
          f"set the config field seq_len >= {len(mask)} (get_config(..., seq_len={len(mask)}), or "
          f"--set seq_len={len(mask)} on the command line)"
        )
      if remaining > space and not self._split and pos > 0:
        break  # does not fit: pad this row, start the document on a fresh one
      k, o = min(remaining, space), self._offset
      seg += 1
      row["inputs"][pos : pos + k] = toks[o : o + k]
      row["targets"][pos : pos + k] = toks[o + 1 : o + k + 1]
      row["loss_mask"][pos : pos + k] = mask[o : o + k]
      row["segment_ids"][pos : pos + k] = seg
      pos += k
      self._offset += k
      if self._offset >= len(mask):
        self._doc = None
    return row

  def get_state(self) -> dict:
    if self._doc is None:
      return {"parent": self._parent.get_state(), "offset": -1}
    return {"parent": self._doc_state, "offset": int(self._offset)}

  def set_state(self, state: dict):
    self._parent.set_state(state["parent"])
    self._doc = None
    if state["offset"] >= 0:
      self._load_doc()
      self._offset = int(state["offset"])


def _to_str(x) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _doc_fn(task: str, tok):
  """Record -> {"tokens": int32 [n], "mask": float32 [n-1]} for `task`."""
  if task in ("scopes", "dips"):
    mod = scopes if task == "scopes" else dips
    return lambda r: {"tokens": np.asarray(r["tokens"], np.int32), "mask": mod.loss_mask(r["tokens"])}
  if task == "passkey":

    def f(r):
      prompt, answer = tok.encode(_to_str(r["prompt"])), tok.encode(_to_str(r["answer"]))
      toks = np.asarray([tok.bos_id, *prompt, *answer, tok.eos_id], np.int32)
      return {"tokens": toks, "mask": passkey.loss_mask(toks, 1 + len(prompt), len(answer))}

    return f
  raise ValueError(f"no document function for task {task!r} (text rows are windows: fpa_jax.data.windows)")


def check_passkey_seq_len(src, seq_len: int, split: str = "train") -> None:
  """Raise ValueError unless a row of `seq_len` pairs holds a whole prompt of the passkey split `src`.

  A shorter row would cut every prompt: the answer row never sees the needle and the other rows
  carry no loss at all. Prompts have at most `target_len` tokens (BOS..EOS), i.e. `target_len - 1` pairs.
  """
  if len(src) == 0:
    return
  target_len = int(src[0]["target_len"])
  if seq_len < target_len - 1:
    raise ValueError(
      f"passkey split {split!r} has prompts of up to {target_len} tokens, longer than seq_len={seq_len}: "
      f"packing would cut each prompt so the answer never sees the needle. Set seq_len >= {target_len - 1} "
      f"(e.g. seq_len={target_len} with a smaller batch_size=8: get_config(..., seq_len={target_len}, "
      f"batch_size=8), or --set seq_len={target_len} --set batch_size=8 on the command line)"
    )


class Pipeline:
  """Iterator of packed batches with `vocab_size`, and exact `get_state` / `set_state`."""

  def __init__(self, dataset: grain.IterDataset, vocab_size: int, info: dict):
    self._ds = dataset
    self._it = iter(dataset)
    self.vocab_size = int(vocab_size)
    self.info = info

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    b = next(self._it)
    return {k: np.asarray(b[k]) for k in KEYS}

  def get_state(self) -> dict:
    """JSON-serialisable position of the iterator (save with orbax `ocp.args.JsonSave`)."""
    return {"iterator": self._it.get_state(), "info": self.info}

  def set_state(self, state: dict):
    if state.get("info") != self.info:
      raise ValueError(f"pipeline state is for {state.get('info')}, this pipeline is {self.info}")
    self._it.set_state(state["iterator"])


def make_pipeline(
  task: str,
  split: str = "train",
  *,
  data_dir,
  seq_len: int,
  batch_size: int,
  seed: int = 0,
  tokenizer: str = "bytes",
  small: bool = False,
  shuffle: bool = True,
  num_epochs: int | None = None,
  process_index: int | None = None,
  process_count: int | None = None,
  text_source: str = "stdlib",
  vocab_size: int | None = None,
) -> Pipeline | SyntheticPipeline:
  """Build the grain pipeline of `task`/`split`; builds the dataset under `data_dir` if missing
  (in a multi-process job on process 0 only, see `sources.prepare_shared`).

  `batch_size` is per process. Records are sharded `process_index::process_count` before the
  seeded shuffle, so processes see disjoint data. `num_epochs=None` repeats forever.
  `text_source` (text only): "stdlib", a local directory, or "tfds:NAME".
  scopes/dips have their own small vocabularies, so `tokenizer` applies to text/passkey only.
  `synthetic` (`TEST_TASKS`) is in memory: an endless stream of ids below `vocab_size` (required),
  no data_dir; the other tasks take their vocabulary from their data and ignore `vocab_size`.
  """
  if task not in TASKS + TEST_TASKS:
    raise ValueError(f"unknown task {task!r}: valid are {TASKS}")
  parse_tokenizer_name(tokenizer)
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
  if process_index is None or process_count is None:
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  if task == "synthetic":
    return make_synthetic(
      split,
      vocab_size=vocab_size,
      seq_len=seq_len,
      batch_size=batch_size,
      seed=seed,
      process_index=process_index,
      process_count=process_count,
    )
  data_dir = builders.check_data_dir(data_dir)
  tokenized = task in ("text", "passkey")
  sources.prepare_shared(
    task, data_dir, small=small, text_source=text_source, tokenizer=tokenizer if tokenized else None
  )

  info = {
    "task": task,
    "split": split,
    "seq_len": seq_len,
    "batch_size": batch_size,
    "seed": seed,
    "tokenizer": tokenizer,
    "small": small,
    "shuffle": shuffle,
    "num_epochs": num_epochs,
    "process_index": process_index,
    "process_count": process_count,
    "text_source": text_source,
  }
  # Everything is built now: open it read-only.
  if task == "text":
    tf = _token_file(data_dir, split, small, text_source, tokenizer)
    ds = grain.MapDataset.source(windows.WindowSource(tf, seq_len))
    ds = _shard(ds, process_index, process_count, task, split)
    if shuffle:
      ds = ds.shuffle(seed=seed)  # a fresh permutation of the windows each epoch (repeat reseeds)
    ds = ds.repeat(num_epochs).to_iter_dataset().batch(batch_size, drop_remainder=num_epochs is None)
    return Pipeline(ds, load_tokenizer(tokenizer, data_dir, small=small).vocab_size, {**info, "rows": "windows"})
  src = builders.data_source(task, split, data_dir, small=small, text_source=text_source, build=False)
  if task == "passkey":
    check_passkey_seq_len(src, seq_len, split)

  if tokenized:
    tok = load_tokenizer(tokenizer, data_dir, small=small)
    vocab = tok.vocab_size
  else:
    mod = scopes if task == "scopes" else dips
    vocab, tok = mod.vocab_size(builders.synthetic_task_config(task, small)), None

  ds = _shard(grain.MapDataset.source(src), process_index, process_count, task, split)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).map(_doc_fn(task, tok))
  ds = PackIterDataset(ds.to_iter_dataset(), seq_len, split_docs=False, cut_long_docs=(task != "passkey"))
  ds = ds.batch(batch_size, drop_remainder=num_epochs is None)
  return Pipeline(ds, vocab, info)


def _shard(ds: grain.MapDataset, process_index: int, process_count: int, task: str, split: str) -> grain.MapDataset:
  """This process's records (every process_count-th, from process_index): disjoint across processes."""
  if process_count > 1:
    ds = ds[process_index::process_count]
  if len(ds) == 0:
    raise ValueError(f"{task}/{split} has no records for process {process_index}/{process_count}")
  return ds


def _token_file(data_dir, split: str, small: bool, text_source: str, tokenizer: str) -> windows.TokenFile:
  path = sources.token_file_path(data_dir, split, small=small, text_source=text_source, tokenizer=tokenizer)
  if not windows.token_file_ready(path):
    raise ValueError(
      f"text split {split!r} has no token file at {path}.bin (valid splits are built together); build it with "
      f"python -m fpa_jax.data.prepare --data-dir {data_dir} --only text"
    )
  return windows.TokenFile(path)


def make_heldout(
  split: str = "validation",
  *,
  data_dir,
  seq_len: int,
  batch_size: int,
  n_windows: int = 256,
  tokenizer: str = "bytes",
  small: bool = False,
  text_source: str = "stdlib",
  process_index: int | None = None,
  process_count: int | None = None,
) -> Pipeline:
  """The fixed held-out text set: `n_windows` windows of `seq_len` spread over every document of
  `split` (`windows.heldout_starts`, seed 0: the same for every run), one pass, batches of
  `batch_size` per process. The set is padded with all-masked rows to a whole number of batches
  on every process (so a multi-process eval runs the same number of steps everywhere), and split
  across processes. `pipeline.info["coverage"]`: documents and pairs it scores (`windows.coverage`).
  """
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
  parse_tokenizer_name(tokenizer)
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  data_dir = builders.check_data_dir(data_dir)
  sources.prepare_shared("text", data_dir, small=small, text_source=text_source, tokenizer=tokenizer)
  tf = _token_file(data_dir, split, small, text_source, tokenizer)
  starts = windows.heldout_starts(tf, seq_len, n_windows)
  per = batch_size * process_count
  padded = np.concatenate([starts, -np.ones(-len(starts) % per, np.int64)])
  ds = grain.MapDataset.source(windows.WindowSource(tf, seq_len, padded))[process_index::process_count]
  ds = ds.to_iter_dataset().batch(batch_size, drop_remainder=False)
  info = {
    "task": "text",
    "split": split,
    "heldout": True,
    "seq_len": seq_len,
    "batch_size": batch_size,
    "tokenizer": tokenizer,
    "small": small,
    "process_index": process_index,
    "process_count": process_count,
    "text_source": text_source,
    "coverage": windows.coverage(tf, starts, seq_len),
  }
  return Pipeline(ds, load_tokenizer(tokenizer, data_dir, small=small).vocab_size, info)
