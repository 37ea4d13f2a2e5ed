"""tf-free TFDS builders: `fpa_scopes`, `fpa_dips`, `fpa_passkey`, `fpa_text`.

All are `GeneratorBasedBuilder`s written as `array_record` (no TensorFlow needed) and read back
through `tfds.data_source` / `builder.as_data_source`. Each has a `small` config (seconds, tests)
and a `default` one. Every example is drawn from `np.random.default_rng([seed, split, index])`, so
a build is deterministic given its config. Everything goes under the given `data_dir`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from fpa_jax.data import dips, passkey, scopes, text
from fpa_jax.data.tokenizers import ByteTokenizer

log = logging.getLogger(__name__)

_I32_SEQ = lambda: tfds.features.Tensor(shape=(None,), dtype=np.int32)  # noqa: E731
_SPLIT_IDS = {"train": 0, "validation": 1, "test": 2}


def example_rng(seed: int, split: str, index: int) -> np.random.Generator:
  """The generator of example `index` of `split`: a stream of its own, so an example does not depend on
  the others or their order (a study can draw any train example alone, `experiments.passkey`)."""
  sid = _SPLIT_IDS.get(split, 3 + sum(map(ord, split)))
  return np.random.default_rng([seed, sid, index])


class _FpaBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Common base. `code_path` is pinned to this file: tfds otherwise resolves it through
  `importlib_resources`, which is not installed (and no checksums file is needed offline)."""

  VERSION = tfds.core.Version("1.0.0")
  code_path = epath.Path(__file__)


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
  """Config of `fpa_scopes` / `fpa_dips`: generator settings plus split sizes and seed."""

  task: scopes.ScopesConfig | dips.DipsConfig | None = None
  n_train: int = 10_000
  n_eval: int = 500  # validation and test each
  seed: int = 0


class _SyntheticBuilder(_FpaBuilder, skip_registration=True):
  _module = None  # scopes or dips

  def _split_generators(self, dl_manager):
    c = self.builder_config
    return {
      "train": self._generate_examples("train", c.n_train),
      "validation": self._generate_examples("validation", c.n_eval),
      "test": self._generate_examples("test", c.n_eval),
    }

  def _generate_examples(self, split, n):
    c = self.builder_config
    for i in range(n):
      yield i, self._module.generate(example_rng(c.seed, split, i), c.task)


class FpaScopes(_SyntheticBuilder):
  """Nested scopes; records: tokens, depth, query_pos, live_idx, live_len (see `scopes.generate`)."""

  _module = scopes
  BUILDER_CONFIGS = [
    SyntheticConfig(
      name="small", task=scopes.ScopesConfig(length=128, max_depth=4, n_symbols=8), n_train=256, n_eval=32
    ),
    SyntheticConfig(name="default", task=scopes.ScopesConfig(), n_train=20_000, n_eval=500),
  ]
  DEFAULT_CONFIG_NAME = "default"

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description=scopes.__doc__,
      features=tfds.features.FeaturesDict(
        {k: _I32_SEQ() for k in ("tokens", "depth", "query_pos", "live_idx", "live_len")}
      ),
    )


class FpaDips(_SyntheticBuilder):
  """Dips; records: tokens, query_pos, live_idx, live_len (see `dips.generate`)."""

  _module = dips
  BUILDER_CONFIGS = [
    SyntheticConfig(name="small", task=dips.DipsConfig(length=128, n_levels=3, n_symbols=4), n_train=256, n_eval=32),
    SyntheticConfig(name="default", task=dips.DipsConfig(), n_train=20_000, n_eval=500),
  ]
  DEFAULT_CONFIG_NAME = "default"

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description=dips.__doc__,
      features=tfds.features.FeaturesDict({k: _I32_SEQ() for k in ("tokens", "query_pos", "live_idx", "live_len")}),
    )


@dataclasses.dataclass(eq=False)
class PasskeyConfig(tfds.core.BuilderConfig):
  """`train_len` is the training length in byte tokens; eval splits go to 8x it."""

  train_len: int = 1024
  n_train: int = 10_000
  n_eval: int = 20  # per eval split
  seed: int = 0


class FpaPasskey(_FpaBuilder):
  """Passkey prompts; splits `train` and `eval_len{N}_depth{D}` (see `passkey`)."""

  BUILDER_CONFIGS = [PasskeyConfig(name="small", train_len=512, n_train=64, n_eval=2), PasskeyConfig(name="default")]
  DEFAULT_CONFIG_NAME = "default"

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description=passkey.__doc__,
      features=tfds.features.FeaturesDict(
        {
          "tokens": _I32_SEQ(),
          "prompt": tfds.features.Text(),
          "answer": tfds.features.Text(),
          **{
            k: tfds.features.Scalar(dtype=np.int32)
            for k in ("key", "depth", "needle_start", "answer_start", "target_len")
          },
        }
      ),
    )

  def _split_generators(self, dl_manager):
    c = self.builder_config
    out = {"train": self._generate_examples("train")}
    for m in passkey.EVAL_MULTIPLES:
      for d in passkey.EVAL_DEPTHS:
        out[passkey.eval_split_name(c.train_len, m, d)] = self._generate_examples("eval", m, d)
    return out

  @staticmethod
  def _record(ex, depth_pct, target_len):
    return {
      "tokens": ex["tokens"],
      "prompt": ex["prompt"],
      "answer": ex["answer"],
      "key": ex["key"],
      "depth": depth_pct,
      "needle_start": ex["needle_start"],
      "answer_start": ex["answer_start"],
      "target_len": target_len,
    }

  def _generate_examples(self, kind, multiple=1, depth=0):
    c = self.builder_config
    return self._train(c) if kind == "train" else self._eval(c, multiple, depth)

  def _train(self, c):
    tok = ByteTokenizer()
    for i in range(c.n_train):
      rng = example_rng(c.seed, "train", i)
      depth = int(rng.integers(0, 101))
      yield (
        i,
        self._record(passkey.make_prompt(tok, c.train_len, depth / 100, passkey.random_key(rng)), depth, c.train_len),
      )

  def _eval(self, c, multiple, depth):
    exs = passkey.passkey_eval_examples(c.train_len, multiple, depth, n=c.n_eval, seed=c.seed)
    for i, ex in enumerate(exs):
      yield i, self._record(ex, depth, c.train_len * multiple)


@dataclasses.dataclass(eq=False)
class TextConfig(tfds.core.BuilderConfig):
  """`source` is "stdlib" or a local directory; `small` keeps a few small files."""

  source: str = "stdlib"
  small: bool = False
  seed: int = 0


class FpaText(_FpaBuilder):
  """Real text, one record per file: text, path, size, sha256. Split by file (`text.split_files`)."""

  BUILDER_CONFIGS = [TextConfig(name="small", small=True), TextConfig(name="default")]
  DEFAULT_CONFIG_NAME = "default"

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description=text.__doc__,
      features=tfds.features.FeaturesDict(
        {
          "text": tfds.features.Text(),
          "path": tfds.features.Text(),
          "sha256": tfds.features.Text(),
          "size": tfds.features.Scalar(dtype=np.int64),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    c = self.builder_config
    root, files = text.corpus_files(c.source, c.small)
    texts = {f: text.read_utf8(os.path.join(root, f)) for f in files}  # read once, reused below
    readable = [f for f in files if texts[f] is not None]
    splits = text.split_files(readable, seed=c.seed)
    # The manifest lands in the versioned data dir, next to the records it describes.
    man = text.manifest(root, readable, splits)
    man["skipped_not_utf8"] = sorted(set(files) - set(readable))
    path = os.path.join(os.fspath(self.data_dir), "manifest.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(man, f, indent=1)
    by_path = {e["path"]: e for e in man["files"]}
    return {s: self._generate_examples(fs, texts, by_path) for s, fs in splits.items()}

  def _generate_examples(self, files, texts, by_path):
    for f in files:
      e = by_path[f]
      yield f, {"text": texts[f], "path": f, "sha256": e["sha256"], "size": e["size"]}


BUILDERS = {"scopes": FpaScopes, "dips": FpaDips, "passkey": FpaPasskey, "text": FpaText}


def text_config(source: str = "stdlib", small: bool = False) -> TextConfig | str:
  """Config for `fpa_text`: a registered name for stdlib, a dynamic one per local directory."""
  if source == "stdlib":
    return "small" if small else "default"
  root = os.path.abspath(os.path.expanduser(source))
  if not os.path.isdir(root):
    raise ValueError(f"--text-dir {source!r} does not exist or is not a directory")
  tag = hashlib.sha256(root.encode()).hexdigest()[:10]
  return TextConfig(
    name=f"dir_{tag}{'_small' if small else ''}", source=root, small=small, description=f"local text under {root}"
  )


def check_data_dir(data_dir) -> str:
  """Validate (and create) `data_dir`; raise ValueError naming the problem."""
  if data_dir is None or str(data_dir).strip() == "":
    raise ValueError("data_dir is required: a writable directory where datasets are built and kept")
  d = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
  if os.path.exists(d) and not os.path.isdir(d):
    raise ValueError(f"data_dir {d!r} exists and is not a directory")
  try:
    os.makedirs(d, exist_ok=True)
  except OSError as e:
    raise ValueError(f"data_dir {d!r} cannot be created: {e}") from None
  if not os.access(d, os.W_OK):
    raise ValueError(f"data_dir {d!r} is not writable")
  return d


def get_builder(task: str, data_dir, *, small: bool = False, text_source: str = "stdlib", build: bool = True):
  """The builder of `task` under `data_dir`, built first (with a log line) if not yet there;
  with `build=False` a missing dataset is a ValueError instead."""
  if task not in BUILDERS:
    raise ValueError(f"unknown task {task!r}: valid are {tuple(BUILDERS)}")
  d = check_data_dir(data_dir)
  config = text_config(text_source, small) if task == "text" else ("small" if small else "default")
  make = lambda: BUILDERS[task](config=config, data_dir=d, file_format="array_record")  # noqa: E731
  builder = make()
  if builder.is_prepared():
    return builder
  name = f"{builder.name}/{builder.builder_config.name}"
  if not build:
    text_dir = f" --text-dir {text_source}" if task == "text" and text_source != "stdlib" else ""
    raise ValueError(
      f"dataset {name} is not built under {d}: build it with python -m fpa_jax.data.prepare --data-dir {d} "
      f"--only {task}{text_dir}{' --small' if small else ''} (in a multi-process job process 0 builds it, so "
      "the data dir must be shared by all processes)"
    )
  # Processes sharing a data dir (parallel study runs) build a dataset once: the first takes the lock
  # and builds, the others wait, then read what it built (two builds race on the final rename).
  with open(os.path.join(d, f".{builder.name}-{builder.builder_config.name}.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    builder = make()
    if not builder.is_prepared():
      log.warning("dataset %s is not built under %s: building it now", name, d)
      print(f"[fpa_jax.data] building {name} under {d} ...", flush=True)
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return builder


def data_source(
  task: str, split: str, data_dir, *, small: bool = False, text_source: str = "stdlib", build: bool = True
):
  """Random-access source (len, __getitem__) of one split; builds the dataset if missing (`build`)."""
  builder = get_builder(task, data_dir, small=small, text_source=text_source, build=build)
  if split not in builder.info.splits:
    raise ValueError(
      f"unknown split {split!r} for {builder.name}/{builder.builder_config.name}: "
      f"valid are {sorted(builder.info.splits)}"
    )
  if isinstance(builder.builder_config, TextConfig) and builder.builder_config.name.startswith("dir_"):
    return builder.as_data_source(split)  # dynamic config: not reachable by name
  return tfds.data_source(
    f"{builder.name}/{builder.builder_config.name}",
    split=split,
    data_dir=os.fspath(builder.data_dir_root),
    download=False,
  )


def text_data_source(data_dir, split: str = "train", *, small: bool = False, source: str = "stdlib"):
  return data_source("text", split, data_dir, small=small, text_source=source)


def synthetic_task_config(task: str, small: bool = False):
  """The generator config (`ScopesConfig` / `DipsConfig`) of the small or default build."""
  name = "small" if small else "default"
  return next(c.task for c in BUILDERS[task].BUILDER_CONFIGS if c.name == name)
