"""RULER-style long-context retrieval (Hsieh et al. 2024, "RULER"), byte-level and offline.

    ex = retrieval_example("niah_multikey", seed=0, length=4096, depth=0.5, k=4, value_kind="uuid")
    ex.tokens, ex.answers, ex.answer_starts  # int32 [T <= 4096]; ("3f...",); (its first token,)
    score_answers(generated_text, ex)        # exact match per answer, averaged
    teacher_forced_correct(argmax, ex)       # bool [n_answers] from argmax int [T-1] of one pass

Every task builds one `RetrievalExample`: an intro line, a haystack of whole lines with the needle
lines inserted at line boundaries at controlled depths, a question, and the answer text
`" " + ", ".join(answers)` (as passkey's `" 12345"`), between BOS and EOS, at most `length` byte
tokens (`ByteTokenizer`: byte b is token b + 3), within one haystack line of it.

Tasks (`TASKS`: name -> `TaskSpec`, with its answer format and scoring):
  niah_single        one needle "One of the special magic {noun}s for {key} is: {value}."
  niah_multikey      k needles with distinct keys (k = 2, 4, 8), one asked: the others are distractors
  niah_multivalue    one key bound to several values, all asked (in order of appearance)
  niah_multiquery    several keys asked in one question (values in the order asked)
  variable_tracking  chains "VAR X1 = 5" ... "VAR X2 = X1" ...: every name bound to the asked value
  passkey            `fpa_jax.data.passkey.make_prompt`, in this record
  bindings           `fpa_jax.data.bindings.generate`, rendered as text ("{", "}", "a=3;", "?a=" 3 ";")

Options (each generator takes them; `TaskSpec` lists what a task supports):
  value_kind  "digits" (7 digits), "words" (a word of `VALUE_WORDS`), "uuid" (8-4-4-4-12 hex, uuid4-like)
  haystack    "repeat" (filler sentences cycled), "corpus" (consecutive lines of a text corpus, from a
              random line on: `Corpus`, default `default_corpus`, the interpreter's stdlib, as `fpa_text`),
              "kv_lines" (lines shaped like the needles, with other keys and values)
  vocab       "train" or "heldout": disjoint key words (and variable-name letters), disjoint filler
              sentences and, by default, disjoint corpus files (the stdlib's train / test split);
              values keep one vocabulary (retrieval copies them)
  depth       None: every needle at a uniform depth; a float in [0, 1]: every asked needle there (one
              after another, in order), distractor needles uniform; a sequence: one depth per asked needle.
              A depth is the fraction of the haystack's bytes before the needle; it goes in at the line
              boundary nearest that fraction (so within one line of it).

The answers are in the needles only: never in the question, the haystack, the intro or a distractor
(corpus lines holding one are skipped; each example is checked as it is built). Scoring is exact
match per answer, averaged over the answers of an example (`score_answers`, generated text;
`teacher_forced_correct`, one parallel pass: answer i is right iff the argmax reproduces each of its
bytes after the true prefix). Whole-example exact match (all answers right) is passkey's scoring,
and `as_passkey_dict` feeds `fpa_jax.eval.passkey.teacher_forced_exact_match` as it is.

TFDS: `fpa_niah` (array_record, tf-free) has splits train / validation / test (vocab "train") and
test_heldout (vocab "heldout"), each drawn from its own seeds (`builders.example_rng`); read one with
`niah_data_source(split, data_dir)`, decode a record with `example_from_record`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import logging
import os
import zlib
from typing import Callable, Iterable, Iterator, Literal, Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from fpa_jax.data import bindings, builders, passkey, text
from fpa_jax.data.tokenizers import BOS_ID, EOS_ID, ByteTokenizer

log = logging.getLogger(__name__)

ValueKind = Literal["digits", "words", "uuid"]
Haystack = Literal["repeat", "corpus", "kv_lines"]
Vocab = Literal["train", "heldout"]
VALUE_KINDS: tuple[str, ...] = ("digits", "words", "uuid")
HAYSTACKS: tuple[str, ...] = ("repeat", "corpus", "kv_lines")
VOCABS: tuple[str, ...] = ("train", "heldout")
MULTIKEY_K = (2, 4, 8)
MAX_LINE = 200  # corpus lines longer than this are skipped: depth and length are hit within one line
OFFSET = ByteTokenizer.offset

# Keys are "adjective-noun" (40 x 40 per vocabulary). No word of these lists is a substring of another
# (nor a value word of a template or filler), and keys hold a hyphen no template or filler has: a
# key or value found in a prompt can only be where it was put (tests/data/test_niah.py checks).
KEY_WORDS = {
  "train": (
    "amber brisk calm dusty eager faint gentle hollow icy jolly keen lofty mellow noble plain quaint "
    "rapid silent tidy urban vivid warm young zesty bold crisp fancy grim hasty ivory jagged kind misty "
    "narrow proud rusty sour stern tame wavy".split(),
    "anchor badger candle donkey falcon garden harbor island jacket kettle ladder meadow mirror orchard "
    "parrot quarry rocket saddle tunnel violin wagon yacht zipper basket cactus dragon engine forest "
    "glacier hammer igloo jungle kitten lantern magnet napkin otter rabbit spoon tractor".split(),
  ),
  "heldout": (
    "azure bitter cheerful daring elegant fragile golden humble jovial lively modest nimble obscure "
    "polite rugged sturdy tender upright vast wicked zealous ancient bright clever dainty fierce gloomy "
    "honest lucky mighty nervous opaque precise rough shiny weary wild sleepy frosty merry".split(),
    "acorn beetle cabin dolphin feather goblet hamster iceberg jigsaw koala lobster mitten nectar oyster "
    "pebble quill raven sparrow teapot umbrella valley walrus yogurt zebra barrel canyon desert emblem "
    "fossil gondola helmet insect jasmine kayak lizard marble nugget pillow turtle whistle".split(),
  ),
}
VALUE_WORDS = tuple(
  "apricot biscuit cobalt diamond emerald flannel granite horizon indigo juniper lagoon mango nutmeg "
  "obsidian paprika quartz ribbon saffron thistle uranium velvet willow xylophone yarrow zircon bamboo "
  "cinnamon denim espresso fennel gravel hazelnut lilac maple nickel orchid pewter quinoa raisin sesame "
  "tulip vanilla walnut almond bronze copper dahlia falafel ginger hickory lentil mustard noodle "
  "pistachio radish seaweed tamarind waffle basil chestnut".split()
)
# Variable names of variable_tracking: 5 capitals from disjoint halves of the alphabet.
NAME_LETTERS = {"train": "ABCDEFGHIJKLM", "heldout": "NOPQRSTUVWXYZ"}
NAME_LEN = 5
# Names of the rendered bindings programs (one letter each).
BINDING_LETTERS = {"train": "abcdefghijklm", "heldout": "nopqrstuvwxyz"}
FILLER = {
  "train": passkey.FILLER,
  "heldout": (
    "A river runs past the old mill.",
    "The clock on the wall ticks slowly.",
    "Snow covers the distant hills.",
    "Birds gather on the wire at dusk.",
    "The train leaves the station at noon.",
  ),
}
NOUN = {"digits": "number", "words": "word", "uuid": "uuid"}

INTRO = (
  "Some special magic {noun}s are hidden within the following text. Make sure to memorize them. "
  "I will quiz you about the {noun}s afterwards."
)
NEEDLE = "One of the special magic {noun}s for {key} is: {value}."
Q_ONE = (
  "What is the special magic {noun} for {key} mentioned in the provided text? "
  "The special magic {noun} for {key} mentioned in the provided text is"
)
Q_VALUES = (
  "What are all the special magic {noun}s for {key} mentioned in the provided text? "
  "The special magic {noun}s for {key} mentioned in the provided text, in order of appearance, are"
)
Q_KEYS = (
  "What are the special magic {noun}s for {keys} mentioned in the provided text? "
  "The special magic {noun}s for {keys} mentioned in the provided text, in that order, are"
)
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_LINE = "VAR {name} = {value}"
VT_QUESTION = (
  "Question: Find all variables that are assigned the value {value} in the text above. Answer: "
  "According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
  "the value {value}, they are:"
)
SEPARATOR = ", "  # between the answers of one example; no value, key or name holds a comma
TEMPLATES = (INTRO, NEEDLE, Q_ONE, Q_VALUES, Q_KEYS, VT_INTRO, VT_LINE, VT_QUESTION)


def _nbytes(s: str) -> int:
  return len(s.encode("utf-8"))


@dataclasses.dataclass(frozen=True, eq=False)
class RetrievalExample:
  """One prompt + answer. Token positions index `tokens` (BOS at 0: text byte j is token j + 1).

  tokens        int32 [T], T <= length: BOS, the UTF-8 bytes of `text` (+3), EOS
  text          intro, haystack and needles, `question`, then the answer text " a1, a2, ..."
  answers       the expected strings, in the order the question asks for them
  answer_start  first token of the answer text (its leading space): `tokens[answer_start:-1]` is
                the whole answer, as passkey's; -1 for bindings, whose answers are interleaved
  answer_starts / answer_lens  each answer's first token and byte count (separators excluded)
  keys          the keys (or the value, for variable_tracking; the names, for bindings) asked for
  needles       the inserted lines, in generation order; `needle_starts` their first tokens
  asked         indices into `needles` of the lines that hold an answer
  depths        the requested (or drawn) depth of each needle; `placed_depths` where it went: the
                fraction of haystack bytes before it (bindings: the binding's position / T)
  """

  task: str
  text: str
  tokens: np.ndarray
  question: str
  answers: tuple[str, ...]
  answer_start: int
  answer_starts: tuple[int, ...]
  answer_lens: tuple[int, ...]
  keys: tuple[str, ...]
  needles: tuple[str, ...]
  needle_starts: tuple[int, ...]
  asked: tuple[int, ...]
  depths: tuple[float, ...]
  placed_depths: tuple[float, ...]
  length: int
  value_kind: str
  haystack: str
  vocab: str

  @property
  def answer_text(self) -> str:
    return " " + SEPARATOR.join(self.answers)

  def loss_mask(self) -> np.ndarray:
    """float32 [T-1] over next-token pairs: 1 where the *target* is in the answer text (separators
    too: a model must learn where an answer ends) or, for bindings, in an answer."""
    m = np.zeros(len(self.tokens) - 1, np.float32)
    if self.answer_start >= 0:
      m[self.answer_start - 1 :] = 1.0
    for s, n in zip(self.answer_starts, self.answer_lens):
      m[s - 1 : s - 1 + n] = 1.0
    return m

  def as_passkey_dict(self) -> dict:
    """The keys `fpa_jax.eval.passkey` scores (`tokens`, `answer_start`, `prompt`, `answer`)."""
    if self.answer_start < 0:
      raise ValueError(f"{self.task} answers are interleaved with the prompt: score with teacher_forced_correct")
    return {
      "tokens": self.tokens,
      "answer_start": self.answer_start,
      "prompt": self.tokens_text(1, self.answer_start),
      "answer": self.answer_text,
      "key": self.answers[0],
      "needle_start": self.needle_starts[self.asked[0]],
    }

  def tokens_text(self, start: int, stop: int) -> str:
    return ByteTokenizer().decode(self.tokens[start:stop])


# --- scoring -------------------------------------------------------------------------------------


def parse_answers(generated: str) -> list[str]:
  """A generated answer text (" a1, a2, ...", up to EOS or a newline) -> its answers, stripped."""
  line = generated.split("\n", 1)[0]
  return [a.strip() for a in line.split(SEPARATOR.strip())]


def answer_correct(pred: Sequence[str] | str, ex: RetrievalExample) -> np.ndarray:
  """bool [len(ex.answers)]: pred[i] (stripped) == answers[i]; a missing prediction is wrong, extra ones
  are ignored. A str is a generated answer text, parsed by `parse_answers`."""
  if isinstance(pred, str):
    pred = parse_answers(pred)
  pred = [str(p).strip() for p in pred]
  return np.asarray([i < len(pred) and pred[i] == a for i, a in enumerate(ex.answers)], bool)


def score_answers(pred: Sequence[str] | str, ex: RetrievalExample) -> float:
  """Exact match per answer, averaged: the share of `ex.answers` predicted exactly, in order (1.0 or 0.0
  for a one-answer task; partial credit k/n when k of n answers are right)."""
  return float(answer_correct(pred, ex).mean())


def teacher_forced_correct(argmax: np.ndarray, ex: RetrievalExample) -> np.ndarray:
  """bool [len(ex.answers)] from one teacher-forced pass: `argmax` int [>= T-1] holds the model's greedy
  prediction after each token of `ex.tokens` (position t predicts token t + 1). Answer i is right iff
  every one of its bytes is predicted after the true prefix: greedy decoding would then emit it."""
  am = np.asarray(argmax)
  return np.asarray(
    [np.array_equal(am[s - 1 : s - 1 + n], ex.tokens[s : s + n]) for s, n in zip(ex.answer_starts, ex.answer_lens)],
    bool,
  )


def score_teacher_forced(argmax: np.ndarray, ex: RetrievalExample) -> float:
  """`teacher_forced_correct` averaged over the answers (the partial credit of `score_answers`)."""
  return float(teacher_forced_correct(argmax, ex).mean())


# --- haystacks and values ------------------------------------------------------------------------


class Corpus:
  """Lines of text for the "corpus" haystack: the non-blank lines (right-stripped) of at most `max_line`
  bytes of `texts` (str or UTF-8 bytes, documents or windows), in order. A haystack is the lines from a
  random one on, wrapping around, skipping any line that holds a needle's key or value."""

  def __init__(self, texts: Iterable[str | bytes], max_line: int = MAX_LINE):
    if isinstance(texts, (str, bytes)):
      texts = [texts]  # one document, not its characters
    lines = []
    for t in texts:
      t = t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t
      lines += [s for s in (x.rstrip() for x in t.splitlines()) if s.strip() and _nbytes(s) <= max_line]
    if not lines:
      raise ValueError(f"the corpus has no usable line: give text with non-blank lines of at most {max_line} bytes")
    self.lines, self.max_line = lines, max_line

  def __len__(self) -> int:
    return len(self.lines)

  def window(self, rng: np.random.Generator, forbidden: Sequence[str]) -> Iterator[str]:
    n, start = len(self.lines), int(rng.integers(len(self.lines)))
    while True:
      kept = 0
      for i in range(n):
        line = self.lines[(start + i) % n]
        if not any(f in line for f in forbidden):
          kept += 1
          yield line
      if not kept:
        return


@functools.lru_cache(maxsize=4)
def default_corpus(vocab: Vocab = "train", small: bool = False) -> Corpus:
  """The stdlib text `fpa_text` is built from, read locally: its train files for vocab "train", its test
  files for "heldout" (`text.split_files`, seed 0, the split `fpa_text` makes). Cached."""
  _check_choice("vocab", vocab, VOCABS)
  root, files = text.corpus_files("stdlib", small)
  texts = {f: text.read_utf8(os.path.join(root, f)) for f in files}
  readable = [f for f in files if texts[f] is not None]
  split = text.split_files(readable, seed=0)["train" if vocab == "train" else "test"]
  return Corpus(texts[f] for f in split)


def _check_choice(what: str, value, valid: Sequence) -> None:
  if value not in valid:
    raise ValueError(f"{what} must be one of {tuple(valid)}, got {value!r}")


def _key_pool(vocab: Vocab) -> list[str]:
  adjs, nouns = KEY_WORDS[vocab]
  return [f"{a}-{n}" for a in adjs for n in nouns]


def draw_keys(rng: np.random.Generator, n: int, vocab: Vocab = "train") -> list[str]:
  """`n` distinct "adjective-noun" keys of `vocab`."""
  pool = _key_pool(vocab)
  if n > len(pool):
    raise ValueError(f"{n} distinct keys asked for; the {vocab} vocabulary has {len(pool)}")
  return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]


def _one_value(rng: np.random.Generator, kind: ValueKind) -> str:
  if kind == "digits":
    return str(int(rng.integers(1_000_000, 10_000_000)))
  if kind == "words":
    return VALUE_WORDS[int(rng.integers(len(VALUE_WORDS)))]
  b = bytearray(rng.bytes(16))
  b[6], b[8] = (b[6] & 0x0F) | 0x40, (b[8] & 0x3F) | 0x80  # version 4, RFC 4122 variant
  h = b.hex()
  return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def draw_values(rng: np.random.Generator, kind: ValueKind, n: int, exclude: Iterable[str] = ()) -> list[str]:
  """`n` distinct values of `kind`, none in `exclude`."""
  _check_choice("value_kind", kind, VALUE_KINDS)
  exclude = set(exclude)
  if kind == "words":
    pool = [w for w in VALUE_WORDS if w not in exclude]
    if n > len(pool):
      raise ValueError(f"{n} distinct word values asked for; {len(pool)} words are left ({len(VALUE_WORDS)} in all)")
    return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]
  out: list[str] = []
  while len(out) < n:
    v = _one_value(rng, kind)
    if v not in exclude and v not in out:
      out.append(v)
  return out


def draw_names(rng: np.random.Generator, n: int, vocab: Vocab = "train", exclude: Iterable[str] = ()) -> list[str]:
  """`n` distinct variable names of NAME_LEN letters of `vocab`'s half of the alphabet."""
  letters, exclude, out = NAME_LETTERS[vocab], set(exclude), []
  while len(out) < n:
    name = "".join(letters[i] for i in rng.integers(len(letters), size=NAME_LEN))
    if name not in exclude and name not in out:
      out.append(name)
  return out


def _repeat_lines(vocab: Vocab, rng: np.random.Generator) -> Iterator[str]:
  filler = FILLER[vocab]
  i = int(rng.integers(len(filler)))  # a random phase: the first line says nothing about the needle
  while True:
    yield filler[i % len(filler)]
    i += 1


def _kv_lines(make_key, make_value, line: str, avoid_keys: set, avoid_values: set) -> Iterator[str]:
  while True:
    k, v = make_key(), make_value()
    if k not in avoid_keys and v not in avoid_values:
      yield line.format(key=k, value=v, name=k)


def _haystack_lines(
  rng: np.random.Generator,
  haystack: Haystack,
  vocab: Vocab,
  corpus,
  forbidden: Sequence[str],
  kv: Callable[[], Iterator[str]],
) -> Iterator[str]:
  if haystack == "repeat":
    return _repeat_lines(vocab, rng)
  if haystack == "kv_lines":
    return kv()
  if corpus is None:
    corpus = default_corpus(vocab)
  elif not isinstance(corpus, Corpus):
    corpus = Corpus(corpus)
  return corpus.window(rng, forbidden)


def _needle_depths(
  rng: np.random.Generator, depth, n_asked: int, n_other: int, *, ordered: bool = False
) -> list[float]:
  """Depths of the asked needles, then of the others (see the module doc); `ordered`: the asked ones must
  not decrease (a chain's assignments)."""
  if depth is None:
    asked = rng.random(n_asked)
    asked = np.sort(asked) if ordered else asked
  elif np.ndim(depth) == 0:
    asked = np.full(n_asked, float(depth))
  else:
    asked = np.asarray(depth, float)
    if asked.shape != (n_asked,):
      raise ValueError(f"depth: give one depth per asked needle ({n_asked}), a float or None; got {len(asked)}")
    if ordered and np.any(np.diff(asked) < 0):
      raise ValueError(f"depth: a chain's assignments follow one another, so its depths must not decrease: {depth}")
  if not np.all((asked >= 0.0) & (asked <= 1.0)):
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  return [float(d) for d in asked] + [float(d) for d in rng.random(n_other)]


def _assemble(
  *,
  task: str,
  length: int,
  intro: str,
  lines: Iterator[str],
  needles: Sequence[str],
  depths: Sequence[float],
  question: str,
  answers: Sequence[str],
  asked: Sequence[int],
  keys: Sequence[str],
  value_kind: str,
  haystack: str,
  vocab: str,
  answers_by_position: bool = False,
) -> RetrievalExample:
  """Fill the haystack to `length`, insert the needles at their depths and lay the example out.

  answers_by_position: `answers[i]` belongs to `needles[asked[i]]` and the answers are reordered as
  their needles appear (multivalue: "in order of appearance")."""
  if int(length) != length or length < 1:
    raise ValueError(f"length must be a positive int (tokens, BOS and EOS included), got {length!r}")
  answer_text = " " + SEPARATOR.join(answers)
  fixed = 2 + _nbytes(intro) + 1 + sum(_nbytes(n) + 1 for n in needles) + _nbytes(question) + _nbytes(answer_text)
  if fixed > length:
    raise ValueError(
      f"length {length} is too short for this {task} example ({len(needles)} needles): it needs "
      f"{fixed} tokens before any haystack (BOS, intro, needles, question, answer, EOS); use length >= {fixed}"
    )
  budget, hay, sizes, used = length - fixed, [], [], 0
  for line in lines:
    n = _nbytes(line) + 1
    if used + n > budget:
      break
    hay.append(line)
    sizes.append(n)
    used += n
  prefix = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
  total = int(prefix[-1])
  # Each needle at the boundary nearest its depth, measured on the haystack alone (needles do not shift
  # one another); needles at one boundary keep their order.
  bounds = [int(np.argmin(np.abs(prefix - d * total))) for d in depths]
  at: dict[int, list[int]] = {}
  for i in sorted(range(len(needles)), key=lambda i: (bounds[i], i)):
    at.setdefault(bounds[i], []).append(i)
  parts, pos = [intro + "\n"], _nbytes(intro) + 1
  starts = [0] * len(needles)
  for b in range(len(hay) + 1):
    for i in at.get(b, ()):
      starts[i] = 1 + pos  # token index: BOS first
      parts.append(needles[i] + "\n")
      pos += _nbytes(needles[i]) + 1
    if b < len(hay):
      parts.append(hay[b] + "\n")
      pos += sizes[b]
  if answers_by_position:
    order = sorted(range(len(answers)), key=lambda j: starts[asked[j]])
    answers, asked = [answers[j] for j in order], [asked[j] for j in order]
    answer_text = " " + SEPARATOR.join(answers)
  parts += [question, answer_text]
  body = "".join(parts)
  tokens = np.asarray([BOS_ID, *(b + OFFSET for b in body.encode("utf-8")), EOS_ID], np.int32)
  answer_start = 1 + pos + _nbytes(question)
  a_starts, s = [], answer_start + 1  # past the leading space
  for a in answers:
    a_starts.append(s)
    s += _nbytes(a) + _nbytes(SEPARATOR)
  ex = RetrievalExample(
    task=task,
    text=body,
    tokens=tokens,
    question=question,
    answers=tuple(answers),
    answer_start=answer_start,
    answer_starts=tuple(a_starts),
    answer_lens=tuple(_nbytes(a) for a in answers),
    keys=tuple(keys),
    needles=tuple(needles),
    needle_starts=tuple(starts),
    asked=tuple(asked),
    depths=tuple(float(d) for d in depths),
    placed_depths=tuple(float(prefix[b] / total) if total else 0.0 for b in bounds),
    length=int(length),
    value_kind=value_kind,
    haystack=haystack,
    vocab=vocab,
  )
  check_example(ex)
  return ex


def _occurrences(data: bytes, s: bytes) -> list[int]:
  out, i = [], data.find(s)
  while i >= 0:
    out.append(i)
    i = data.find(s, i + 1)
  return out


def check_example(ex: RetrievalExample, *, keys: bool = True) -> None:
  """Raise RuntimeError unless the answer spans decode to the answers and every answer (and, with
  `keys`, every asked key) occurs in the prompt only inside needle lines (keys: and in the question),
  no answer in the question. Bindings (answer_start -1), whose digits are everywhere: the spans only.
  Every generated example passes it (it runs as each is built)."""
  for a, s, n in zip(ex.answers, ex.answer_starts, ex.answer_lens):
    if ex.tokens_text(s, s + n) != a:
      raise RuntimeError(f"{ex.task}: the span at {s} does not decode to the answer {a!r}")
  if ex.answer_start < 0:
    return
  data = bytes(int(t) - OFFSET for t in ex.tokens[1 : ex.answer_start])  # the prompt, without BOS
  spans = [(s - 1, s - 1 + _nbytes(n)) for s, n in zip(ex.needle_starts, ex.needles)]
  q0 = len(data) - _nbytes(ex.question)
  inside = lambda i, n: any(a <= i and i + n <= b for a, b in spans)  # noqa: E731
  for a in ex.answers:
    if a in ex.question:
      raise RuntimeError(f"{ex.task}: the answer {a!r} is in the question {ex.question!r}")
    b = a.encode()
    if stray := [i for i in _occurrences(data, b) if not inside(i, len(b))]:
      raise RuntimeError(f"{ex.task}: the answer {a!r} occurs outside the needles at bytes {stray[:5]}")
  for k in ex.keys if keys else ():
    b = k.encode()
    if stray := [i for i in _occurrences(data, b) if not inside(i, len(b)) and i < q0]:
      raise RuntimeError(f"{ex.task}: the asked key {k!r} occurs outside the needles at bytes {stray[:5]}")


def _as_rng(rng) -> np.random.Generator:
  return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _options(task: str, value_kind, haystack, vocab) -> None:
  spec = TASKS[task]
  _check_choice(f"{task}: value_kind", value_kind, spec.value_kinds)
  _check_choice(f"{task}: haystack", haystack, spec.haystacks)
  _check_choice(f"{task}: vocab", vocab, spec.vocabs)


def _count(what: str, n: int) -> None:
  if int(n) != n or n < 1:
    raise ValueError(f"{what} must be an int >= 1, got {n!r}")


# --- the generators ------------------------------------------------------------------------------
# Each: (rng or seed, length, depth=None, *, value_kind, haystack, vocab, corpus, task options) ->
# RetrievalExample. corpus: a `Corpus` or iterable of str / bytes for haystack "corpus" (default:
# `default_corpus(vocab)`).


def _niah(task, rng, length, depth, *, n_keys, n_values, value_kind, haystack, vocab, corpus) -> RetrievalExample:
  """The NIAH tasks: `n_keys` keys, each in `n_values` needles with distinct values, key 0's first.
  Asked: needle 0 (single, multikey), key 0's values (multivalue) or every key (multiquery)."""
  _options(task, value_kind, haystack, vocab)
  rng, noun = _as_rng(rng), NOUN[value_kind]
  keys = draw_keys(rng, n_keys, vocab)
  values = draw_values(rng, value_kind, n_keys * n_values)
  needles = [NEEDLE.format(noun=noun, key=keys[i // n_values], value=v) for i, v in enumerate(values)]
  by_position = False
  if task == "niah_multiquery":  # asked in a random order: the question's order is not the needles'
    asked = [int(i) for i in rng.permutation(n_keys)]
    question = Q_KEYS.format(noun=noun, keys=_and([keys[i] for i in asked]))
    answers, asked_keys = [values[i] for i in asked], [keys[i] for i in asked]
  elif task == "niah_multivalue":
    asked, by_position = list(range(n_values)), True
    question, answers, asked_keys = Q_VALUES.format(noun=noun, key=keys[0]), values, keys[:1]
  else:
    asked, question, answers, asked_keys = [0], Q_ONE.format(noun=noun, key=keys[0]), values[:1], keys[:1]
  depths = _needle_depths(rng, depth, len(asked), len(needles) - len(asked))
  pool = _key_pool(vocab)
  kv = lambda: _kv_lines(  # noqa: E731
    lambda: pool[int(rng.integers(len(pool)))],
    lambda: _one_value(rng, value_kind),
    NEEDLE.replace("{noun}", noun),
    set(keys),
    set(values),
  )
  return _assemble(
    task=task,
    length=length,
    intro=INTRO.format(noun=noun),
    lines=_haystack_lines(rng, haystack, vocab, corpus, forbidden=keys + values, kv=kv),
    needles=needles,
    depths=depths,
    question=question,
    answers=answers,
    asked=asked,
    keys=asked_keys,
    value_kind=value_kind,
    haystack=haystack,
    vocab=vocab,
    answers_by_position=by_position,
  )


def _and(items: Sequence[str]) -> str:
  return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def niah_single(
  rng,
  length: int,
  depth=None,
  *,
  value_kind: ValueKind = "digits",
  haystack: Haystack = "repeat",
  vocab: Vocab = "train",
  corpus=None,
) -> RetrievalExample:
  """One needle, asked for its value. Answer: the value."""
  opts = dict(value_kind=value_kind, haystack=haystack, vocab=vocab, corpus=corpus)
  return _niah("niah_single", rng, length, depth, n_keys=1, n_values=1, **opts)


def niah_multikey(
  rng,
  length: int,
  depth=None,
  *,
  k: int = 4,
  value_kind: ValueKind = "digits",
  haystack: Haystack = "repeat",
  vocab: Vocab = "train",
  corpus=None,
) -> RetrievalExample:
  """k needles with distinct keys; the first is asked, the other k - 1 are distractors at uniform depths.
  Answer: the asked key's value. `depth`: the asked needle's."""
  _count("k", k)
  opts = dict(value_kind=value_kind, haystack=haystack, vocab=vocab, corpus=corpus)
  return _niah("niah_multikey", rng, length, depth, n_keys=k, n_values=1, **opts)


def niah_multivalue(
  rng,
  length: int,
  depth=None,
  *,
  n_values: int = 4,
  value_kind: ValueKind = "digits",
  haystack: Haystack = "repeat",
  vocab: Vocab = "train",
  corpus=None,
) -> RetrievalExample:
  """One key in `n_values` needles, each with its own value; all asked. Answer: the values in order of
  appearance. A sequence `depth`: one per value, in generation order."""
  _count("n_values", n_values)
  opts = dict(value_kind=value_kind, haystack=haystack, vocab=vocab, corpus=corpus)
  return _niah("niah_multivalue", rng, length, depth, n_keys=1, n_values=n_values, **opts)


def niah_multiquery(
  rng,
  length: int,
  depth=None,
  *,
  n_queries: int = 4,
  value_kind: ValueKind = "digits",
  haystack: Haystack = "repeat",
  vocab: Vocab = "train",
  corpus=None,
) -> RetrievalExample:
  """`n_queries` needles with distinct keys, all asked in one question, in a random order (not the
  needles'). Answer: their values in the order asked. A sequence `depth`: one per needle, in needle order."""
  _count("n_queries", n_queries)
  opts = dict(value_kind=value_kind, haystack=haystack, vocab=vocab, corpus=corpus)
  return _niah("niah_multiquery", rng, length, depth, n_keys=n_queries, n_values=1, **opts)


def variable_tracking(
  rng,
  length: int,
  depth=None,
  *,
  hops: int = 4,
  chains: int = 1,
  value_kind: ValueKind = "digits",
  haystack: Haystack = "repeat",
  vocab: Vocab = "train",
  corpus=None,
) -> RetrievalExample:
  """`chains` chains "VAR X1 = v", "VAR X2 = X1", ... of `hops` copies each, with distinct values and
  names; chain 0 is asked (the others are distractors, at uniform depths, in order). Answer: every name of
  the asked chain, in chain order (= order of appearance). A sequence `depth` has one depth per line of
  chain 0 (hops + 1), not decreasing."""
  task = "variable_tracking"
  _count("hops", hops)
  _count("chains", chains)
  _options(task, value_kind, haystack, vocab)
  rng = _as_rng(rng)
  names = draw_names(rng, chains * (hops + 1), vocab)
  values = draw_values(rng, value_kind, chains)
  needles, depths = [], _needle_depths(rng, depth, hops + 1, 0, ordered=True)
  for c in range(chains):
    chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
    needles += [VT_LINE.format(name=chain[0], value=values[c])]
    needles += [VT_LINE.format(name=b, value=a) for a, b in zip(chain, chain[1:])]
    if c:
      depths += [float(d) for d in np.sort(rng.random(hops + 1))]
  lines = _haystack_lines(
    rng,
    haystack,
    vocab,
    corpus,
    forbidden=names + values,
    kv=lambda: _kv_lines(
      lambda: draw_names(rng, 1, vocab)[0],
      lambda: _one_value(rng, value_kind),
      VT_LINE,
      set(names),
      set(values),
    ),
  )
  return _assemble(
    task=task,
    length=length,
    intro=VT_INTRO,
    lines=lines,
    needles=needles,
    depths=depths,
    question=VT_QUESTION.format(value=values[0], n=hops + 1),
    answers=names[: hops + 1],
    asked=list(range(hops + 1)),
    keys=[values[0]],
    value_kind=value_kind,
    haystack=haystack,
    vocab=vocab,
  )


def passkey_task(
  rng,
  length: int,
  depth=None,
  *,
  value_kind: ValueKind = "digits",
  haystack: Haystack = "repeat",
  vocab: Vocab = "train",
  corpus=None,
) -> RetrievalExample:
  """`passkey.make_prompt` (5-digit key, its filler, its depth by sentences) in this record. Answer: the
  key. Only its own options (digits, repeat, train)."""
  _options("passkey", value_kind, haystack, vocab)
  rng = _as_rng(rng)
  depth = _needle_depths(rng, depth, 1, 0)[0]  # one needle: a float, a 1-sequence or None
  key = passkey.random_key(rng)
  tok = ByteTokenizer()
  needle = passkey.NEEDLE.format(k=key)
  base = 2 + _nbytes(" ".join([passkey.TASK, needle, passkey.QUESTION]) + f" {key}")  # no filler
  if length < base:
    raise ValueError(f"length {length} is too short for a passkey example (no filler fits); use length >= {base}")
  p = passkey.make_prompt(tok, length, float(depth), key)
  tokens = p["tokens"]
  head = 1 + _nbytes(passkey.TASK + " ")
  filler = len(tokens) - 2 - _nbytes(" ".join([passkey.TASK, needle, passkey.QUESTION]) + p["answer"])
  ex = RetrievalExample(
    task="passkey",
    text=tok.decode(tokens),
    tokens=tokens,
    question=passkey.QUESTION,
    answers=(str(key),),
    answer_start=int(p["answer_start"]),
    answer_starts=(int(p["answer_start"]) + 1,),
    answer_lens=(len(str(key)),),
    keys=("pass key",),
    needles=(needle,),
    needle_starts=(int(p["needle_start"]),),
    asked=(0,),
    depths=(float(depth),),
    placed_depths=((p["needle_start"] - head) / filler if filler else 0.0,),
    length=int(length),
    value_kind=value_kind,
    haystack=haystack,
    vocab=vocab,
  )
  check_example(ex, keys=False)  # the question names "the pass key" (so does the needle)
  return ex


BINDINGS_MIN_PROGRAM = 32  # `BindingsConfig.validate`


def _render_bindings(cfg: bindings.BindingsConfig, tokens: np.ndarray, letters: str):
  """Text of a bindings program, the byte offset where each token's text starts, and the answers'
  (offset, text): OPEN "{", CLOSE "}", BIND "a=3;", QUERY NAME VALUE "?a=" "3" ";"; PAD/BOS/EOS nothing."""
  name0, value0 = bindings.NAME0, bindings.NAME0 + cfg.n_names
  parts, at, pos, answers = [], [], 0, []
  toks = [int(t) for t in tokens]
  for i, t in enumerate(toks):
    at.append(pos)
    if t == bindings.OPEN:
      s = "{"
    elif t == bindings.CLOSE:
      s = "}"
    elif t == bindings.QUERY:
      s = "?"
    elif name0 <= t < value0:
      s = letters[t - name0] + "="
    elif value0 <= t < value0 + cfg.n_values:
      s = f"{t - value0};"
      answers.append((pos, str(t - value0)))
    elif (nv := bindings.decode_bind(cfg, t)) is not None:
      s = f"{letters[nv[0]]}={nv[1]};"
    else:
      s = ""  # PAD, BOS, EOS
    parts.append(s)
    pos += len(s)
  return "".join(parts), at, answers


def bindings_task(
  rng,
  length: int,
  depth=None,
  *,
  value_kind: ValueKind = "digits",
  haystack: str = "program",
  vocab: Vocab = "train",
  corpus=None,
  **cfg_kw,
) -> RetrievalExample:
  """A `bindings.generate` program (cfg_kw: `BindingsConfig` fields but length) rendered as text: the
  longest of a few seeded draws that fits `length` bytes, its tail filled with empty scopes "{}".
  Answers: every query's value, in order, each right after its "?name="; vocab "heldout" names the
  variables with other letters. `depth` must be None: the program places its bindings."""
  _options("bindings", value_kind, haystack, vocab)
  if depth is not None:
    raise ValueError("depth: a bindings program places its own bindings; give depth=None")
  rng = _as_rng(rng)
  letters = BINDING_LETTERS[vocab]
  probe = bindings.BindingsConfig(**cfg_kw)
  if probe.n_names > len(letters):
    raise ValueError(f"bindings: n_names {probe.n_names} is more than the {len(letters)} letters of a vocabulary")
  # A token renders to at most 3 + (value digits) bytes ("a=3;"): that length surely fits; then grow it.
  per = 3 + len(str(probe.n_values - 1))
  lo = (length - 2) // per
  if lo < BINDINGS_MIN_PROGRAM:
    raise ValueError(
      f"length {length} is too short for a bindings example: use length >= {BINDINGS_MIN_PROGRAM * per + 2}"
    )
  seed = int(rng.integers(2**63))
  best, n_prog = None, lo
  for attempt in range(4):
    cfg = dataclasses.replace(probe, length=n_prog).validate()
    g = bindings.generate(np.random.default_rng([seed, attempt]), cfg)
    body, at, answers = _render_bindings(cfg, g["tokens"], letters)
    if _nbytes(body) + 2 <= length and (best is None or len(body) > len(best[1])):
      best = (cfg, body, at, answers, g)
    n_prog = max(lo, int(n_prog * (length - 2) / max(len(body), 1) * 0.99))
  _, body, at, answers, g = best
  body += "{}" * ((length - 2 - len(body)) // 2)  # empty scopes, as bindings fills its own tail: within 1 byte
  tokens = np.asarray([BOS_ID, *(b + OFFSET for b in body.encode()), EOS_ID], np.int32)
  qnames = [letters[int(g["tokens"][q]) - bindings.NAME0] for q in g["query_pos"]]
  needles = [body[at[p] :].split(";", 1)[0] + ";" for p in g["answer_pos"]]
  return RetrievalExample(
    task="bindings",
    text=body,
    tokens=tokens,
    question="",
    answers=tuple(a for _, a in answers),
    answer_start=-1,
    answer_starts=tuple(1 + p for p, _ in answers),
    answer_lens=tuple(len(a) for _, a in answers),
    keys=tuple(qnames),
    needles=tuple(needles),
    needle_starts=tuple(1 + at[p] for p in g["answer_pos"]),
    asked=tuple(range(len(needles))),
    depths=tuple(float(at[p] / len(body)) for p in g["answer_pos"]),
    placed_depths=tuple(float(at[p] / len(body)) for p in g["answer_pos"]),
    length=int(length),
    value_kind=value_kind,
    haystack=haystack,
    vocab=vocab,
  )


# --- the registry --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """A task: its generator, what its answer is and how it is scored, the options it takes and the
  task options (`kwargs` name -> values) `random_example` draws from."""

  generate: Callable[..., RetrievalExample]
  answer_format: str
  scoring: str
  value_kinds: tuple[str, ...] = VALUE_KINDS
  haystacks: tuple[str, ...] = HAYSTACKS
  vocabs: tuple[str, ...] = VOCABS
  kwargs: tuple[tuple[str, tuple], ...] = ()


_EXACT = "exact match of the answer (1 or 0)"
_PER_ANSWER = "exact match per answer, in order, averaged over the answers (k of n right scores k/n)"
TASKS: dict[str, TaskSpec] = {
  "niah_single": TaskSpec(niah_single, "' {value}': the needle's value (7 digits, a word or a uuid)", _EXACT),
  "niah_multikey": TaskSpec(
    niah_multikey,
    "' {value}': the asked key's value; the k - 1 other needles are distractors",
    _EXACT,
    kwargs=(("k", MULTIKEY_K),),
  ),
  "niah_multivalue": TaskSpec(
    niah_multivalue,
    "' {v1}, {v2}, ...': all values of the one key, in order of appearance",
    _PER_ANSWER,
    kwargs=(("n_values", (4,)),),
  ),
  "niah_multiquery": TaskSpec(
    niah_multiquery,
    "' {v1}, {v2}, ...': the value of each asked key, in the order asked",
    _PER_ANSWER,
    kwargs=(("n_queries", (4,)),),
  ),
  "variable_tracking": TaskSpec(
    variable_tracking,
    "' {X1}, {X2}, ...': every name bound to the value, in chain order",
    _PER_ANSWER,
    kwargs=(("hops", (4,)), ("chains", (1, 2))),
  ),
  "passkey": TaskSpec(
    passkey_task,
    "' {key}': the 5-digit pass key",
    _EXACT,
    value_kinds=("digits",),
    haystacks=("repeat",),
    vocabs=("train",),
  ),
  "bindings": TaskSpec(
    bindings_task,
    "'{value}' after each '?{name}=': the value of the name's innermost live binding",
    _PER_ANSWER + ", teacher-forced only",
    value_kinds=("digits",),
    haystacks=("program",),
  ),
}
RETRIEVAL_TASKS = TASKS  # the name `fpa_jax.data` exports (its `TASKS` is the pipeline's)


def retrieval_example(task: str, seed, length: int, depth=None, **kw) -> RetrievalExample:
  """`TASKS[task].generate(np.random.default_rng(seed), length, depth, **kw)`."""
  _check_choice("task", task, tuple(TASKS))
  return TASKS[task].generate(np.random.default_rng(seed), length, depth, **kw)


def random_example(task: str, rng, length: int, *, vocab: Vocab = "train", corpus=None) -> RetrievalExample:
  """An example with drawn options: value kind, haystack and task options uniform over the task's, depth
  uniform. Options whose needles do not fit `length` are drawn again (up to 8 times)."""
  _check_choice("task", task, tuple(TASKS))
  spec, rng = TASKS[task], _as_rng(rng)
  for _ in range(8):
    kw = {k: vs[int(rng.integers(len(vs)))] for k, vs in spec.kwargs}
    kw["value_kind"] = spec.value_kinds[int(rng.integers(len(spec.value_kinds)))]
    kw["haystack"] = spec.haystacks[int(rng.integers(len(spec.haystacks)))]
    try:
      return spec.generate(rng, length, None, vocab=vocab, corpus=corpus, **kw)
    except ValueError as e:
      if "too short" not in str(e):
        raise
      err = e
  raise err


def retrieval_eval_examples(
  task: str, length: int, depth: float, n: int = 8, seed: int = 0, **kw
) -> list[RetrievalExample]:
  """`n` examples of `task` at `length` with the asked needle(s) at `depth` (fixed options `kw`), the same
  for the same arguments (as `passkey.passkey_eval_examples`)."""
  _check_choice("task", task, tuple(TASKS))
  d = 1001 if depth is None or np.ndim(depth) else int(round(float(depth) * 1000))  # 1001: drawn depths
  rng = np.random.default_rng([seed, zlib.crc32(task.encode()), length, d])
  return [TASKS[task].generate(rng, length, depth, **kw) for _ in range(n)]


# --- TFDS ----------------------------------------------------------------------------------------

SPLIT_VOCAB = {"train": "train", "validation": "train", "test": "train", "test_heldout": "heldout"}
_TEXT_SEQ = lambda: tfds.features.Sequence(tfds.features.Text())  # noqa: E731
_INT_SEQ = lambda: tfds.features.Tensor(shape=(None,), dtype=np.int32)  # noqa: E731
_FLOAT_SEQ = lambda: tfds.features.Tensor(shape=(None,), dtype=np.float32)  # noqa: E731
_TEXT = ("task", "text", "question", "value_kind", "haystack", "vocab")
_INTS = ("answer_starts", "answer_lens", "needle_starts", "asked")


@dataclasses.dataclass(eq=False)
class NiahConfig(tfds.core.BuilderConfig):
  """Examples cycle through `tasks` (index i: task i % len(tasks)), then `lengths` (bytes, BOS and EOS
  included); options are drawn by `random_example`. `small_corpus`: the small stdlib listing."""

  tasks: tuple[str, ...] = tuple(TASKS)
  lengths: tuple[int, ...] = (2048, 4096, 8192)
  n_train: int = 10_000
  n_eval: int = 210  # validation, test and test_heldout each
  seed: int = 0
  small_corpus: bool = False


class FpaNiah(builders._FpaBuilder):
  """The retrieval suite; records: `RetrievalExample` fields (`example_from_record` decodes one)."""

  code_path = epath.Path(__file__)
  BUILDER_CONFIGS = [
    NiahConfig(name="small", lengths=(2048,), n_train=14, n_eval=7, small_corpus=True),
    NiahConfig(name="default"),
  ]
  DEFAULT_CONFIG_NAME = "default"

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description=__doc__,
      features=tfds.features.FeaturesDict(
        {
          **{k: tfds.features.Text() for k in _TEXT},
          "tokens": _INT_SEQ(),
          **{k: _INT_SEQ() for k in _INTS},
          "answers": _TEXT_SEQ(),
          "keys": _TEXT_SEQ(),
          "needles": _TEXT_SEQ(),
          "depths": _FLOAT_SEQ(),
          "placed_depths": _FLOAT_SEQ(),
          "answer_start": tfds.features.Scalar(dtype=np.int32),
          "length": tfds.features.Scalar(dtype=np.int32),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    c = self.builder_config
    bad = [t for t in c.tasks if t not in TASKS]
    if bad:
      raise ValueError(f"NiahConfig.tasks: unknown {bad}; valid are {tuple(TASKS)}")
    sizes = {"train": c.n_train, "validation": c.n_eval, "test": c.n_eval, "test_heldout": c.n_eval}
    return {s: self._generate_examples(s, n) for s, n in sizes.items()}

  def _generate_examples(self, split, n):
    c = self.builder_config
    vocab = SPLIT_VOCAB[split]
    corpus = default_corpus(vocab, c.small_corpus)
    for i in range(n):
      task, length = c.tasks[i % len(c.tasks)], c.lengths[(i // len(c.tasks)) % len(c.lengths)]
      v = vocab if vocab in TASKS[task].vocabs else TASKS[task].vocabs[0]  # passkey has no held-out variant
      ex = random_example(task, builders.example_rng(c.seed, split, i), length, vocab=v, corpus=corpus)
      yield i, example_to_record(ex)


def example_to_record(ex: RetrievalExample) -> dict:
  rec = {k: getattr(ex, k) for k in _TEXT}
  rec |= {k: np.asarray(getattr(ex, k), np.int32) for k in _INTS}
  rec |= {k: list(getattr(ex, k)) for k in ("answers", "keys", "needles")}
  rec |= {k: np.asarray(getattr(ex, k), np.float32) for k in ("depths", "placed_depths")}
  return rec | {"tokens": ex.tokens, "answer_start": ex.answer_start, "length": ex.length}


def example_from_record(rec: dict) -> RetrievalExample:
  """A `RetrievalExample` from a `fpa_niah` record (strings come back as bytes)."""
  s = lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)  # noqa: E731
  return RetrievalExample(
    **{k: s(rec[k]) for k in _TEXT},
    tokens=np.asarray(rec["tokens"], np.int32),
    **{k: tuple(int(x) for x in rec[k]) for k in _INTS},
    **{k: tuple(s(x) for x in rec[k]) for k in ("answers", "keys", "needles")},
    **{k: tuple(float(x) for x in rec[k]) for k in ("depths", "placed_depths")},
    answer_start=int(rec["answer_start"]),
    length=int(rec["length"]),
  )


def get_niah_builder(data_dir, *, small: bool = False, build: bool = True) -> FpaNiah:
  """The `fpa_niah` builder under `data_dir`, built first if missing (one process builds, the others
  wait on a lock, as `builders.get_builder`); `build=False`: a missing dataset is a ValueError."""
  d = builders.check_data_dir(data_dir)
  config = "small" if small else "default"
  make = lambda: FpaNiah(config=config, data_dir=d, file_format="array_record")  # noqa: E731
  builder = make()
  if builder.is_prepared():
    return builder
  if not build:
    raise ValueError(f"dataset fpa_niah/{config} is not built under {d}: call get_niah_builder({d!r}, small={small})")
  with open(os.path.join(d, f".fpa_niah-{config}.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    builder = make()
    if not builder.is_prepared():
      log.warning("dataset fpa_niah/%s is not built under %s: building it now", config, d)
      print(f"[fpa_jax.data] building fpa_niah/{config} under {d} ...", flush=True)
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return builder


def niah_data_source(split: str, data_dir, *, small: bool = False, build: bool = True):
  """Random-access source (len, __getitem__ -> record) of one `fpa_niah` split, via `tfds.data_source`."""
  builder = get_niah_builder(data_dir, small=small, build=build)
  if split not in builder.info.splits:
    raise ValueError(f"unknown split {split!r} of fpa_niah: valid are {sorted(builder.info.splits)}")
  return tfds.data_source(
    f"fpa_niah/{builder.builder_config.name}", split=split, data_dir=os.fspath(builder.data_dir_root), download=False
  )
