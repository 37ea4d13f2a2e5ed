"""Passkey prompts: length within tolerance, needle exactly at the depth, answer, 8x eval splits."""

import numpy as np
import pytest

from fpa_jax.data import builders, make_pipeline, passkey
from fpa_jax.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
MAX_SENTENCE = max(len(TOK.encode(" " + s)) for s in passkey.FILLER)


@pytest.mark.parametrize("target_len", [512, 1000, 4096])
@pytest.mark.parametrize("depth", [0, 10, 50, 90, 100])
def test_prompt_length_needle_and_answer(target_len, depth):
  ex = passkey.make_prompt(TOK, target_len, depth / 100, key=48213)
  toks = list(ex["tokens"])
  assert target_len - MAX_SENTENCE < len(toks) <= target_len
  assert toks[0] == TOK.bos_id and toks[-1] == TOK.eos_id
  text = TOK.decode(toks)
  assert text.startswith(passkey.TASK) and text.endswith(passkey.QUESTION + " 48213")
  assert text.count("48213") == 3  # twice in the needle, once as the answer
  # The needle begins exactly at needle_start, after the depth's share of the filler.
  needle = TOK.encode(passkey.NEEDLE.format(k=48213))
  assert toks[ex["needle_start"] : ex["needle_start"] + len(needle)] == needle
  assert ex["n_before"] == round(depth / 100 * ex["n_filler"])
  base = 2 + len(TOK.encode(" ".join([passkey.TASK, passkey.NEEDLE.format(k=48213), passkey.QUESTION]) + " 48213"))
  filler = len(toks) - base  # filler tokens, before + after the needle
  before = ex["needle_start"] - (1 + len(TOK.encode(passkey.TASK + " ")))
  assert ex["n_filler"] > 0 and 0 <= before <= filler
  assert abs(before / filler - depth / 100) <= MAX_SENTENCE / filler
  assert TOK.decode(toks[ex["answer_start"] : -1]) == " 48213"


def test_eval_examples_reach_8x_and_are_deterministic():
  a = passkey.passkey_eval_examples(512, 8, 50, n=3, seed=1)
  b = passkey.passkey_eval_examples(512, 8, 50, n=3, seed=1)
  assert [e["key"] for e in a] == [e["key"] for e in b]
  assert all(4096 - MAX_SENTENCE < len(e["tokens"]) <= 4096 for e in a)
  assert passkey.eval_split_name(512, 8, 50) == "eval_len4096_depth50"


def test_passkey_builder_splits_and_pipeline_masks_only_the_answer(tmp_path):
  b = builders.get_builder("passkey", tmp_path, small=True)
  want = {"train"} | {f"eval_len{512 * m}_depth{d}" for m in (1, 2, 4, 8) for d in (0, 25, 50, 75, 100)}
  assert set(b.info.splits) == want
  src = builders.data_source("passkey", "eval_len4096_depth75", tmp_path, small=True)
  assert all(4096 - MAX_SENTENCE < len(src[i]["tokens"]) <= 4096 for i in range(len(src)))
  p = make_pipeline(
    "passkey",
    "eval_len4096_depth75",
    data_dir=tmp_path,
    seq_len=4096,
    batch_size=2,
    small=True,
    shuffle=False,
    num_epochs=1,
    process_index=0,
    process_count=1,
  )
  batch = next(p)
  for r in range(2):
    m = batch["loss_mask"][r] > 0
    key = int(src[r]["key"])
    assert TOK.decode(batch["targets"][r][m]) == f" {key}"
    assert set(np.unique(batch["segment_ids"][r])) <= {0, 1}


def test_seq_len_shorter_than_a_prompt_is_an_error(tmp_path):
  """The trap: 512-token prompts packed into 256-token rows would cut off the needle."""
  import grain

  from fpa_jax import train
  from fpa_jax.configs import get_config
  from fpa_jax.data.pipeline import PackIterDataset

  kw = dict(data_dir=tmp_path, batch_size=2, small=True, process_index=0, process_count=1)
  with pytest.raises(ValueError, match=r"seq_len >= 511.*--set seq_len=512"):
    make_pipeline("passkey", seq_len=256, **kw)
  with pytest.raises(ValueError, match="seq_len >= 4095"):
    make_pipeline("passkey", "eval_len4096_depth0", seq_len=4000, shuffle=False, num_epochs=1, **kw)
  row = next(make_pipeline("passkey", seq_len=511, **kw))  # exactly enough: one whole prompt per row
  assert (row["loss_mask"].sum(1) > 0).all() and (row["segment_ids"].max(1) == 1).all()
  # The trainer's CLI turns it into "error: ..." (exit 2) for the documented small config command.
  cfg = get_config("small", task="passkey", small_data=True, data_dir=str(tmp_path), steps=1, warmup_steps=1)
  with pytest.raises(ValueError, match="seq_len"):
    train.make_data(cfg)
  # The packer itself refuses to cut a too-long document when cutting is off (defence in depth).
  docs = [{"tokens": np.arange(40, dtype=np.int32), "mask": np.ones(39, np.float32)}]
  ds = PackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(), 32, split_docs=False, cut_long_docs=False)
  with pytest.raises(ValueError, match="does not fit in seq_len=32"):
    next(iter(ds))
