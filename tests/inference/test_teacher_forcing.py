"""Decode = teacher forcing, end to end: greedy generation through the full cache (parallel and
decode prefill) on prompts of several kernel tiles, with gates whose read-outs are not zero, emits
at every step the teacher-forced argmax of the parallel model; and the passkey scorer records both
scores for a full-cache cell, so a scorer's bug cannot pass for a policy's effect."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import eval as ev
from fpa_jax.inference import generate
from fpa_jax.models import build_model

BLOCK = 16  # the chunked kernel's tile: the prompts below span 3 and 4 tiles
GATES = dict(step_init_std=0.3, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)
NEAR_TIE = 1e-4  # logits this close may swap under another reduction order (fp32)


def _cfg(**gates):
  return C.get_config("tiny", attention="fpa", attn_impl="chunked", block_size=BLOCK, **gates)


@pytest.fixture(scope="module")
def model():
  return build_model(_cfg(**GATES), seed=1)


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def _prompts(model, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, model.cfg.vocab_size, n).astype(np.int32) for n in lengths]


def test_the_gates_read_out_something(model):
  """The model's gates matter: the same weights with the gates' read-outs at their zero init give
  other logits (so the test below checks the penalties' path through the cache, not a plain
  softmax)."""
  flat = build_model(_cfg(**{k: 0.0 for k in GATES}), seed=1)
  tok = _prompts(model, [56])[0][None]
  diff = np.abs(np.asarray(_forward(model, tok)) - np.asarray(_forward(flat, tok))).max()
  assert diff > 1e-2, diff


@pytest.mark.parametrize("prefill", ["parallel", "decode"])
def test_greedy_generation_through_the_full_cache_is_the_teacher_forced_argmax(model, prefill):
  lengths, n_new = [56, 43], 12  # 3.5 and 2.7 tiles of 16, rows of different lengths
  prompts = _prompts(model, lengths)
  out, stats = generate(model, prompts, n_new, prefill=prefill)
  assert out.shape == (2, n_new) and not stats["overflow"]
  for p, g in zip(prompts, out):
    seq = np.concatenate([p, g[:-1]])[None]  # the prompt and every generated token but the last
    logits = np.asarray(jax.device_get(_forward(model, seq)))[0, len(p) - 1 :]  # [n_new, V]: the predictions
    forced = logits.argmax(-1)
    for i, (got, want) in enumerate(zip(g, forced)):
      gap = logits[i, want] - logits[i, got]
      assert got == want or gap < NEAR_TIE, (prefill, len(p), i, got, want, gap)
    assert (g == forced).mean() >= 11 / 12  # at most one near tie per row


def _examples(model, n=4, prompt_len=40, answer=5):
  """Passkey-shaped examples from the model's own greedy answers: rows 0, 2 its answer (retrieved),
  rows 1, 3 with one answer token changed (not retrieved)."""
  prompts = np.stack(_prompts(model, [prompt_len] * n, seed=3))
  answers = generate(model, prompts, answer)[0]
  exs = []
  for r, (p, a) in enumerate(zip(prompts, answers)):
    a = a.copy()
    if r % 2:
      a[2] = (a[2] + 1) % model.cfg.vocab_size
    exs.append({"tokens": np.asarray([*p, *a, 2], np.int32), "answer_start": prompt_len})
  return exs


def test_passkey_full_cell_records_both_scores(model):
  exs = _examples(model)
  gen = ev.passkey_cell(model, exs, batch_size=2, prefill="parallel")  # generated: teacher-forced beside it
  assert gen["correct"] == 2 and gen["scorers_agree"]
  assert gen["teacher_forced"] == {"correct": 2, "accuracy": 0.5}
  assert gen["generated"] == {"correct": 2, "accuracy": 0.5, "prefill": "parallel"}
  tf = ev.passkey_cell(model, exs, batch_size=2, cross_check=True)  # teacher-forced: generated beside it
  assert tf["correct"] == 2 and tf["scorers_agree"] and tf["generated"]["correct"] == 2
  plain = ev.passkey_cell(model, exs, batch_size=2)  # the default teacher-forced cell: as before
  assert "generated" not in plain and plain["correct"] == 2
  cached = ev.passkey_cell(model, exs, batch_size=2, prefill="parallel", policy="window", budget=0.5)
  assert "teacher_forced" not in cached  # only the full cache is the same computation both ways
