"""What a pipeline reads, prepared once per job: built datasets, TFDS catalog text, SentencePiece models.

`prepare` builds everything a task needs under `data_dir` (a no-op when it is there);
`prepare_shared` does it on JAX process 0 only, then a barrier, for multi-process jobs whose
processes share `data_dir`. Readers then open splits without building (`build=False`).
"""

from __future__ import annotations

import logging
import os
import socket

import jax
import tensorflow_datasets as tfds
from jax.experimental import multihost_utils

from fpa_jax.data import builders, windows
from fpa_jax.data.tokenizers import load_tokenizer, parse_tokenizer_name, spm_model_path, train_spm

log = logging.getLogger(__name__)


def network_available(host: str = "storage.googleapis.com", port: int = 443, timeout: float = 3.0) -> bool:
  """A quick TCP probe, so offline machines fail fast instead of hanging in a download."""
  try:
    with socket.create_connection((host, port), timeout=timeout):
      return True
  except OSError:
    return False


def catalog_builder(name: str, data_dir: str, *, build: bool = True):
  """The builder of the TFDS catalog dataset `name` (array_record under data_dir), prepared if missing.

  Raises ValueError, without hanging, when it is not prepared and the network is unreachable.
  """
  try:
    builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
  except Exception as e:  # tfds raises its own DatasetNotFoundError
    raise ValueError(f"unknown TFDS dataset {name!r}: {e}") from None
  if not builder.is_prepared():
    how = (
      f"prepare it on a machine with network (python -m fpa_jax.data.prepare --data-dir DIR --only text "
      f"--text-source tfds:{name}) and copy DIR here"
    )
    if not build:
      raise ValueError(f"TFDS dataset {name!r} is not prepared under {data_dir!r}: {how}")
    if not network_available():
      raise ValueError(
        f"TFDS dataset {name!r} is not prepared under {data_dir!r} and the network is unreachable: {how}"
      )
    builder.download_and_prepare(
      file_format="array_record", download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )
  return builder


def catalog_source(name: str, split: str, data_dir: str, *, build: bool = True):
  """`tfds.data_source` of one split of a TFDS catalog text dataset (see `catalog_builder`)."""
  builder = catalog_builder(name, data_dir, build=build)
  if split not in builder.info.splits:
    raise ValueError(f"TFDS dataset {name!r} has no split {split!r}; it has {list(builder.info.splits)}")
  return tfds.data_source(name, split=split, data_dir=data_dir, download=False)


def catalog_text_key(record: dict) -> str:
  """The text field of a catalog record (`text` for lm1b, `book_text` for pg19, else the first str)."""
  for k in ("text", "book_text", "content"):
    if k in record:
      return k
  for k, v in record.items():
    if isinstance(v, (bytes, str)):
      return k
  raise ValueError(f"no text feature among {list(record)}")


def iter_text_lines(data_dir: str, split: str = "train", small: bool = False):
  """Yield the lines (with newlines) of the built `fpa_text` split, building it if missing."""
  src = builders.text_data_source(data_dir, split, small=small)
  for i in range(len(src)):
    text = src[i]["text"]
    text = text.decode("utf-8") if isinstance(text, bytes) else text
    yield from text.splitlines(keepends=True)


def get_tokenizer(name: str = "bytes", data_dir: str | None = None, *, small: bool = False):
  """Return the tokenizer `name`; `spm` models are trained offline on `fpa_text` if missing.

  `small=True` uses (and if needed builds) the small `fpa_text` config: seconds, for tests.
  """
  kind, vocab = parse_tokenizer_name(name)
  if kind == "spm" and data_dir is not None:
    path = spm_model_path(data_dir, vocab, small)
    if not os.path.exists(path):
      log.info("SentencePiece model %s not found: training it offline on fpa_text", path)
      train_spm(iter_text_lines(data_dir, split="train", small=small), path[: -len(".model")], vocab)
  return load_tokenizer(name, data_dir, small=small)


def prepare(
  task: str, data_dir: str, *, small: bool = False, text_source: str = "stdlib", tokenizer: str | None = None
):
  """Build what `task` reads under `data_dir`: its dataset and, if given, the `tokenizer` model.
  Returns the dataset's (TFDS) builder."""
  if task == "text" and text_source.startswith("tfds:"):
    builder = catalog_builder(text_source[len("tfds:") :], data_dir)
  else:
    builder = builders.get_builder(task, data_dir, small=small, text_source=text_source)
  if tokenizer is not None:
    tok = get_tokenizer(tokenizer, data_dir, small=small)
    if task == "text":
      for split in builder.info.splits:
        _build_token_file(builder, split, tokenizer, tok, data_dir, text_source)
  return builder


def token_file_path(data_dir: str, split: str, *, small: bool, text_source: str, tokenizer: str) -> str:
  """Where the flat token file of a text split lives (`windows`), beside the built dataset."""
  if text_source.startswith("tfds:"):
    builder = catalog_builder(text_source[len("tfds:") :], data_dir, build=False)
  else:
    builder = builders.get_builder("text", data_dir, small=small, text_source=text_source, build=False)
  return os.path.join(windows.token_dir(str(builder.data_dir), tokenizer), split)


def _build_token_file(builder, split: str, tokenizer: str, tok, data_dir: str, text_source: str) -> None:
  path = os.path.join(windows.token_dir(str(builder.data_dir), tokenizer), split)
  if windows.token_file_ready(path):
    return
  if text_source.startswith("tfds:"):
    src = tfds.data_source(builder.name, split=split, data_dir=data_dir, download=False)
    key = catalog_text_key(src[0]) if len(src) else "text"
  else:
    src, key = builder.as_data_source(split), "text"
  log.info("tokenizing %s/%s (%d documents) into %s", builder.name, split, len(src), path)

  def texts():
    for i in range(len(src)):
      t = src[i][key]
      yield t.decode("utf-8") if isinstance(t, bytes) else str(t)

  windows.build_token_file(texts(), tok.encode, tok.bos_id, tok.eos_id, tok.vocab_size, path)


def prepare_shared(task: str, data_dir: str, **kw) -> None:
  """`prepare` once per job: processes share `data_dir`, and concurrent builds of one dataset would
  clobber each other's files, so JAX process 0 builds while the others wait at a barrier. A single
  process just prepares: no barrier, no collective."""
  if jax.process_count() == 1:
    prepare(task, data_dir, **kw)
    return
  error = None
  if jax.process_index() == 0:
    try:
      prepare(task, data_dir, **kw)
    except Exception as e:  # noqa: BLE001 - re-raised after the barrier, so no process waits forever
      error = e
  multihost_utils.sync_global_devices(f"fpa_jax.data.prepare {task}")
  if error is not None:
    raise error
