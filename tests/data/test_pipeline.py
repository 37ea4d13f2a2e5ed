"""Pipelines: packing, exact resume, sharding, tokenizers, clear errors, multi-process preparation."""

import contextlib
import json
from unittest import mock

import grain
import numpy as np
import pytest

from fpa_jax.data import TASKS, SyntheticPipeline, get_tokenizer, make_pipeline, sources, text
from fpa_jax.data.pipeline import TEST_TASKS, PackIterDataset
from fpa_jax.data.tokenizers import load_tokenizer

KW = dict(small=True, process_index=0, process_count=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


def _docs(lengths):
  # Document d holds tokens d*1000, d*1000+1, ...: any crossing would show as a jump.
  return [
    {"tokens": np.arange(n, dtype=np.int32) + 1000 * d, "mask": np.ones(n - 1, np.float32)}
    for d, n in enumerate(lengths)
  ]


@pytest.mark.parametrize("split_docs", [True, False])
def test_packing_never_crosses_documents(split_docs):
  lengths = list(np.random.default_rng(0).integers(2, 40, size=60)) + [90]
  ds = PackIterDataset(grain.MapDataset.source(_docs(lengths)).to_iter_dataset(), 32, split_docs)
  rows, n_pairs = list(ds), 0
  for r in rows:
    seg, inp, tgt = r["segment_ids"], r["inputs"], r["targets"]
    real = seg > 0
    n = real.sum()
    assert real[:n].all() and seg[0] == 1  # segments 1, 2, 3, ... then padding 0 only at the end
    assert (np.diff(seg[:n]) >= 0).all() and set(seg[:n]) == set(range(1, seg.max() + 1))
    assert ((seg == 0) == (r["loss_mask"] == 0)).all()
    assert (np.where(real, tgt - inp, 1) == 1).all()  # every target is its own doc's next token
    for s in np.unique(seg[real]):
      docs = np.unique(inp[seg == s] // 1000)
      assert len(docs) == 1 and (np.diff(inp[seg == s]) == 1).all()
    if not split_docs:  # a fitting document is whole: its segment starts at its first token
      for s in np.unique(seg[real]):
        d = inp[seg == s][0] // 1000
        if lengths[d] - 1 <= 32:
          assert inp[seg == s][0] % 1000 == 0 and (seg == s).sum() == lengths[d] - 1
    n_pairs += real.sum()
  assert n_pairs == sum(n - 1 for n in lengths)  # nothing dropped


@pytest.mark.parametrize("task", TASKS + TEST_TASKS)
def test_contract_and_exact_resume(task, data_dir):
  L = 512 if task == "passkey" else 128  # a passkey row must hold a whole (small: 512-token) prompt
  kw = dict(KW, vocab_size=300)  # synthetic's ids; the real tasks ignore it
  p = make_pipeline(task, data_dir=data_dir, seq_len=L, batch_size=3, seed=5, **kw)
  for _ in range(2):
    next(p)
  state = json.loads(json.dumps(p.get_state()))  # must survive JSON (orbax JsonSave)
  expected = [next(p) for _ in range(3)]
  q = make_pipeline(task, data_dir=data_dir, seq_len=L, batch_size=3, seed=5, **kw)
  q.set_state(state)
  for a, b in zip(expected, (next(q) for _ in range(3))):
    assert set(a) == {"inputs", "targets", "segment_ids", "loss_mask"}
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  b = expected[0]
  assert b["inputs"].shape == (3, L) and b["inputs"].dtype == np.int32
  assert b["segment_ids"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
  assert b["inputs"].max() < p.vocab_size and b["targets"].max() < p.vocab_size
  assert 0 < b["loss_mask"].sum() and (b["loss_mask"][b["segment_ids"] == 0] == 0).all()
  other = make_pipeline(task, data_dir=data_dir, seq_len=L, batch_size=3, seed=6, **kw)
  assert any(not np.array_equal(x["inputs"], next(other)["inputs"]) for x in [next(q) for _ in range(3)])


def test_process_shards_are_disjoint(data_dir):
  seen = []
  for i in range(2):
    p = make_pipeline(
      "scopes",
      data_dir=data_dir,
      seq_len=127,
      batch_size=4,
      shuffle=False,
      num_epochs=1,
      small=True,
      process_index=i,
      process_count=2,
    )
    seen.append({r.tobytes() for b in p for r, s in zip(b["inputs"], b["segment_ids"]) if s[0] == 1})
  assert len(seen[0]) == len(seen[1]) == 128 and not seen[0] & seen[1]


def test_tokenizers_round_trip(data_dir, tmp_path):
  s = "def f(x):\n\tif x:  # é ✓ 漢\n        return {1: 'a'}\n"
  b = get_tokenizer("bytes")
  assert b.decode(b.encode(s)) == s and b.vocab_size == 259 and min(b.encode(s)) > b.eos_id
  with pytest.raises(FileNotFoundError, match="fpa_jax.data.prepare"):
    load_tokenizer("spm:400", tmp_path, small=True)  # loading never trains
  sp = get_tokenizer("spm:400", data_dir, small=True)  # this trains a missing model
  assert sp.vocab_size == 400 and sp.decode(sp.encode(s)) == s and len(sp.encode(s)) < len(s)
  p = make_pipeline("text", data_dir=data_dir, seq_len=64, batch_size=2, tokenizer="spm:400", **KW)
  assert p.vocab_size == 400 and next(p)["inputs"].max() < 400


def test_text_dir_split_by_file_and_manifest(tmp_path, data_dir):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(12):
    (corpus / f"f{i:02d}.txt").write_text(f"document {i}\n" * 20)
  (corpus / "bad.bin").write_bytes(b"\xff\xfe\x00")  # not UTF-8: skipped, recorded
  splits = text.split_files(text.list_files(str(corpus)))
  assert splits == text.split_files(text.list_files(str(corpus)))  # deterministic
  assert sum(map(len, splits.values())) == 13 and all(splits.values())
  p = make_pipeline("text", data_dir=data_dir, seq_len=64, batch_size=2, text_source=str(corpus), num_epochs=1, **KW)
  tok = get_tokenizer("bytes")
  got = "".join(tok.decode(r[s > 0]) for b in p for r, s in zip(b["inputs"], b["segment_ids"]))
  import glob

  (man_path,) = glob.glob(f"{data_dir}/fpa_text/dir_*_small/1.0.0/manifest.json")
  man = json.load(open(man_path))
  assert man["skipped_not_utf8"] == ["bad.bin"] and man["n_files"] == 12
  assert {e["split"] for e in man["files"]} == {"train", "validation", "test"}
  for e in man["files"]:  # the train pipeline sees exactly the train files
    assert (f"document {int(e['path'][1:3])}\n" in got) == (e["split"] == "train"), e
  assert all(len(e["sha256"]) == 64 and e["size"] == (corpus / e["path"]).stat().st_size for e in man["files"])


def test_clear_errors(tmp_path, data_dir):
  kw = dict(data_dir=data_dir, seq_len=32, batch_size=1, **KW)
  with pytest.raises(ValueError, match="valid are"):
    make_pipeline("nope", **kw)
  with pytest.raises(ValueError, match="valid are"):
    make_pipeline("scopes", "nosplit", **kw)
  with pytest.raises(ValueError, match="spm:N"):
    make_pipeline("text", tokenizer="wordpiece", **kw)
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    make_pipeline("scopes", **{**kw, "data_dir": str(tmp_path / "file")})
  with pytest.raises(ValueError, match="does not exist"):
    make_pipeline("text", text_source=str(tmp_path / "missing"), **kw)
  with mock.patch.object(sources, "network_available", return_value=False) as probe:
    with pytest.raises(ValueError, match="network"):
      make_pipeline("text", text_source="tfds:lm1b", **kw)
  assert probe.called


def test_synthetic_task_is_the_global_stream_split_by_process():
  """`make_pipeline("synthetic")` (per-process batch, no data_dir) gives each process its rows of
  the SyntheticPipeline stream (global batch); train and validation differ."""
  kw = dict(data_dir=None, seq_len=16, batch_size=2, vocab_size=50, seed=3)
  parts = [make_pipeline("synthetic", process_index=i, process_count=2, **kw) for i in range(2)]
  whole = [
    SyntheticPipeline(vocab_size=50, seq_len=16, batch_size=4, seed=3, process_index=i, process_count=2)
    for i in range(2)
  ]
  for _ in range(2):
    for p, w in zip(parts, whole):
      a, b = next(p), next(w)
      assert a["inputs"].shape == (2, 16) and a["inputs"].max() < 50
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])
  val = make_pipeline("synthetic", "validation", process_index=0, process_count=1, **kw)
  assert not np.array_equal(next(val)["inputs"], next(make_pipeline("synthetic", **KW, **kw))["inputs"])
  with pytest.raises(ValueError, match="valid are"):
    make_pipeline("synthetic", "nosplit", **KW, **kw)
  with pytest.raises(ValueError, match="vocab_size"):
    make_pipeline("synthetic", **KW, **{**kw, "vocab_size": None})


@contextlib.contextmanager
def _as_process(i):
  """Pretend to be process `i` of a 2-process job; barriers are recorded instead of synced."""
  barriers = []
  with (
    mock.patch.object(sources.jax, "process_count", return_value=2),
    mock.patch.object(sources.jax, "process_index", return_value=i),
    mock.patch.object(sources.multihost_utils, "sync_global_devices", side_effect=barriers.append),
  ):
    yield barriers


def test_multi_process_job_builds_on_process_0_only(tmp_path):
  kw = dict(data_dir=tmp_path, seq_len=128, batch_size=2, small=True, process_count=2)
  # Process 1 reaches the barrier without building: with nothing built yet it fails, clearly.
  with _as_process(1) as barriers, pytest.raises(ValueError, match="not built.*shared"):
    make_pipeline("scopes", process_index=1, **kw)
  assert barriers == ["fpa_jax.data.prepare scopes"] and not list(tmp_path.glob("fpa_scopes/*/*/*.json"))
  # Process 0 builds before the barrier; then process 1 reads what it built.
  with _as_process(0) as barriers:
    assert next(make_pipeline("scopes", process_index=0, **kw))["inputs"].shape == (2, 128)
  assert barriers == ["fpa_jax.data.prepare scopes"]
  with _as_process(1):
    assert next(make_pipeline("scopes", process_index=1, **kw))["inputs"].shape == (2, 128)
  # A failure on process 0 still reaches the barrier (no process waits forever), then raises.
  with _as_process(0) as barriers, pytest.raises(ValueError, match="does not exist"):
    make_pipeline("text", process_index=0, text_source=str(tmp_path / "missing"), **kw)
  assert barriers == ["fpa_jax.data.prepare text"]


def _window_docs(data_dir, seq_len):
  """Map a text row (its inputs' bytes) -> the documents its scored pairs come from, over the
  whole small train split, and the split's per-window document weights."""
  from fpa_jax.data import windows

  path = sources.token_file_path(data_dir, "train", small=True, text_source="stdlib", tokenizer="bytes")
  tf = windows.TokenFile(path)
  src = windows.WindowSource(tf, seq_len)
  where = {src[i]["inputs"].tobytes(): int(tf.doc_of(i * seq_len)) for i in range(len(src))}
  return tf, src, where


def test_text_batches_mix_documents_and_resume_exactly(data_dir):
  """Packing files in order made each batch (and the next ~40) chunks of one file.
  Windows shuffled globally: rows of a batch come from many documents, and consecutive batches
  share documents no more often than independent draws would."""
  L, B, n = 64, 8, 30
  p = make_pipeline("text", data_dir=data_dir, seq_len=L, batch_size=B, seed=0, **KW)
  tf, src, where = _window_docs(data_dir, L)
  batches = [next(p) for _ in range(n)]
  docs = [[where[r.tobytes()] for r in b["inputs"]] for b in batches]
  distinct = [len(set(d)) for d in docs]
  assert min(distinct) >= 5 and np.mean(distinct) >= 6, distinct
  # Chance: P(a row of the next batch is from a document of this one), windows drawn uniformly.
  w = np.bincount([int(tf.doc_of(i * L)) for i in range(len(src))], minlength=tf.n_docs) / len(src)
  chance = np.mean([w[list(set(d))].sum() for d in docs[:-1]])
  shared = np.mean([np.mean([x in set(a) for x in b]) for a, b in zip(docs[:-1], docs[1:])])
  assert shared <= 2 * chance + 0.05, (shared, chance)
  # Every window once per epoch, in another order each epoch.
  q = make_pipeline("text", data_dir=data_dir, seq_len=L, batch_size=1, seed=0, **KW)
  e0 = [where[next(q)["inputs"][0].tobytes()] for _ in range(len(src))]
  e1 = [where[next(q)["inputs"][0].tobytes()] for _ in range(len(src))]
  assert sorted(e0) == sorted(e1) and e0 != e1


def test_text_windows_never_cross_documents(data_dir):
  p = make_pipeline("text", data_dir=data_dir, seq_len=96, batch_size=4, seed=1, **KW)
  bos, eos = get_tokenizer("bytes").bos_id, get_tokenizer("bytes").eos_id
  for _ in range(10):
    b = next(p)
    for inp, tgt, seg, m in zip(b["inputs"], b["targets"], b["segment_ids"], b["loss_mask"]):
      np.testing.assert_array_equal(inp[1:][seg[1:] > 0], np.where(seg[:-1] > 0, tgt[:-1], 0)[seg[1:] > 0])
      crossing = np.flatnonzero(np.diff(seg) != 0)  # the pair (EOS -> next BOS) and padding carry no loss
      assert all(inp[i] == eos and m[i] == 0 and (seg[i + 1] == 0 or tgt[i] == bos) for i in crossing)
      assert (m[seg > 0][np.isin(np.flatnonzero(seg > 0), crossing, invert=True)] == 1).all()


def test_text_processes_get_disjoint_windows(data_dir):
  seen = []
  for i in range(2):
    p = make_pipeline(
      "text", data_dir=data_dir, seq_len=64, batch_size=4, shuffle=False, num_epochs=1, small=True,
      process_index=i, process_count=2,
    )  # fmt: skip
    seen.append({r.tobytes() for b in p for r in b["inputs"]})
  _, src, _ = _window_docs(data_dir, 64)
  assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == len({src[i]["inputs"].tobytes() for i in range(len(src))})


def test_heldout_spans_every_document_and_is_fixed(data_dir):
  from fpa_jax.data import make_heldout

  kw = dict(data_dir=data_dir, seq_len=64, small=True)
  h = make_heldout(batch_size=3, n_windows=10, process_index=0, process_count=1, **kw)
  cov = h.info["coverage"]
  assert cov["docs_covered"] == cov["docs_in_split"] and cov["windows"] == 10 and cov["pairs_scored"] > 0
  rows = [b for b in h]
  assert sum(len(b["inputs"]) for b in rows) == 12  # padded to whole batches with all-masked rows
  assert rows[-1]["loss_mask"][-2:].sum() == 0 and rows[0]["loss_mask"].sum() > 0
  again = make_heldout(batch_size=3, n_windows=10, process_index=0, process_count=1, **kw)
  for a, b in zip(rows, again):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  # Two processes: the same set, split, each with the same number of (padded) batches.
  parts = [list(make_heldout(batch_size=2, n_windows=10, process_index=i, process_count=2, **kw)) for i in range(2)]
  assert len(parts[0]) == len(parts[1]) == 3
  mine = {r.tobytes() for b in rows for r, m in zip(b["inputs"], b["loss_mask"]) if m.sum()}
  theirs = {r.tobytes() for part in parts for b in part for r, m in zip(b["inputs"], b["loss_mask"]) if m.sum()}
  assert mine == theirs
  few = make_heldout(batch_size=1, n_windows=1, process_index=0, process_count=1, **kw).info["coverage"]
  assert few["docs_covered"] >= 1 and few["windows"] == 1


def test_processes_sharing_a_data_dir_build_once(tmp_path):
  """Two independent jobs starting on one fresh data dir at once (parallel study runs): one builds, the
  other waits on the lock and reads it (two builds raced on the final rename: FileExistsError)."""
  import subprocess
  import sys

  code = (
    "import sys; from fpa_jax.data.builders import get_builder; "
    "b = get_builder('scopes', sys.argv[1], small=True); print(len(b.info.splits['train'].file_instructions) > 0)"
  )
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for _ in range(2)
  ]
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
    assert out.strip().endswith("True")
  assert sum("building fpa_scopes" in out + err for out, err in outs) == 1  # built once
