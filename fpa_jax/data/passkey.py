"""Passkey retrieval prompts (Mohtashami & Jaggi 2023, "Landmark Attention").

A prompt is: task line, filler, the needle line "The pass key is {k}. Remember it. {k} is the
pass key." at a chosen depth, more filler, then "What is the pass key? The pass key is" and the
answer " {k}". Lengths are in tokens of the given tokenizer (bytes by default) and include BOS/EOS.

Splits of `fpa_passkey`: `train` (random depths, at the training length `L`) and
`eval_len{N}_depth{D}` for N in L x (1, 2, 4, 8) and D in (0, 25, 50, 75, 100) percent;
`eval_split_name(L, multiple, depth)` spells it, `passkey_eval_examples` builds them in memory.
"""

from __future__ import annotations

import numpy as np

from fpa_jax.data.tokenizers import ByteTokenizer

TASK = (
  "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
  "them. I will quiz you about the important information there."
)
# The filler is cut into its sentences so the total length can be hit to within one sentence.
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {k}. Remember it. {k} is the pass key."
QUESTION = "What is the pass key? The pass key is"
EVAL_MULTIPLES = (1, 2, 4, 8)
EVAL_DEPTHS = (0, 25, 50, 75, 100)


def eval_split_name(train_len: int, multiple: int, depth: int) -> str:
  """Name of the eval split at `multiple` x the training length and `depth` percent."""
  return f"eval_len{train_len * multiple}_depth{depth}"


def make_prompt(tokenizer, target_len: int, depth: float, key: int) -> dict:
  """Build one prompt of at most `target_len` tokens (BOS + prompt + answer + EOS).

  The total is within one filler sentence of `target_len`. `depth` in [0, 1] places the needle
  after `round(depth * n)` of the n filler sentences. Returns `prompt` (str, ends with
  `QUESTION`), `answer` (str), `key`, `tokens` (int32 [T]), `answer_start` (index of the first
  answer token in `tokens`), `needle_start` (token index where the needle line begins),
  `n_filler` and `n_before` (filler sentences in total / before the needle).
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  enc = tokenizer.encode

  def build(n: int):
    filler = [FILLER[i % len(FILLER)] for i in range(n)]
    n_before = int(round(depth * n))
    head = " ".join([TASK, *filler[:n_before]]) + " "
    prompt = head + " ".join([NEEDLE.format(k=key), *filler[n_before:], QUESTION])
    tokens = [tokenizer.bos_id] + enc(prompt) + enc(answer) + [tokenizer.eos_id]
    return prompt, tokens, n_before, 1 + len(enc(head))

  answer = " " + str(key)
  # Estimate the filler count from per-sentence lengths, then correct on the real encoding
  # (subword tokenizers are not exactly additive across sentence boundaries).
  base = len(build(0)[1])
  if base > target_len:
    raise ValueError(f"target_len {target_len} is below the {base} tokens of a filler-free prompt")
  per = [len(enc(" " + s)) for s in FILLER]
  n, used = 0, base
  while used + per[n % len(per)] <= target_len:
    used += per[n % len(per)]
    n += 1
  while len(build(n)[1]) > target_len:
    n -= 1
  prompt, tokens, n_before, needle_start = build(n)
  answer_start = len(tokens) - 1 - len(enc(answer))
  return {
    "prompt": prompt,
    "answer": answer,
    "key": key,
    "tokens": np.asarray(tokens, np.int32),
    "answer_start": answer_start,
    "needle_start": needle_start,
    "n_filler": n,
    "n_before": n_before,
  }


def random_key(rng: np.random.Generator) -> int:
  """A 5-digit pass key."""
  return int(rng.integers(10_000, 100_000))


def passkey_eval_examples(
  train_len: int, multiple: int, depth: int, n: int = 8, seed: int = 0, tokenizer=None
) -> list[dict]:
  """`n` eval prompts at `multiple` x `train_len` tokens with the needle at `depth` percent.

  The same prompts (same seed) as the `eval_split_name(train_len, multiple, depth)` split.
  """
  tok = tokenizer or ByteTokenizer()
  rng = np.random.default_rng([seed, train_len, multiple, depth])
  return [make_prompt(tok, train_len * multiple, depth / 100.0, random_key(rng)) for _ in range(n)]


def loss_mask(tokens: np.ndarray, answer_start: int, answer_len: int) -> np.ndarray:
  """float32 [T-1] over next-token pairs: 1 where the *target* is an answer token."""
  m = np.zeros(len(tokens) - 1, np.float32)
  m[answer_start - 1 : answer_start - 1 + answer_len] = 1.0
  return m
