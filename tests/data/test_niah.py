"""RULER-style retrieval (fpa_jax.data.niah): lengths, needles at their depths, answers only in the
needles, distributions over seeds, scoring, held-out vocabularies, errors, the fpa_niah round trip."""

import re

import numpy as np
import pytest

from fpa_jax.data import builders, niah, passkey
from fpa_jax.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
NIAH = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")
# A small local corpus: lines of uneven lengths, one not ASCII (bytes, not characters, are measured).
CORPUS = niah.Corpus(
  [
    "The archive opened at nine.\nClerks sorted letters by hand, one drawer at a time.\n\nIt rained.\n",
    b"Ships came in from the north; their holds were full of grain and salt.\nCaf\xc3\xa9 tables stood outside.\n",
    "A long corridor led to the reading room, where the lamps were always lit and nobody spoke aloud.\n",
  ]
)
MAX_LINE = max(len(s.encode()) for s in (*CORPUS.lines, *niah.FILLER["train"], *niah.FILLER["heldout"])) + 1


def _options(task):
  spec = niah.TASKS[task]
  return [(h, v, voc) for h in spec.haystacks for v in spec.value_kinds for voc in spec.vocabs]


def _kv_line_len(task, value_kind):
  """The longest line of the kv_lines haystack (+ newline)."""
  if task == "variable_tracking":
    return len(niah.VT_LINE.format(name="X" * niah.NAME_LEN, value="f" * 36)) + 1
  longest = lambda ws: max(map(len, ws))  # noqa: E731
  key = max(longest(a) + 1 + longest(n) for a, n in niah.KEY_WORDS.values())
  return len(niah.NEEDLE.format(noun="number", key="k" * key, value="f" * 36)) + 1


def _stray(ex, s: str) -> list[int]:
  """Byte offsets in the prompt (before the question) where `s` occurs outside every needle line."""
  data = ex.text.encode()
  q0 = ex.answer_start - 1 - len(ex.question.encode())
  spans = [(p - 1, p - 1 + len(n.encode())) for p, n in zip(ex.needle_starts, ex.needles)]
  hits = [m.start() for m in re.finditer(re.escape(s.encode()), data[:q0])]
  return [i for i in hits if not any(a <= i and i + len(s.encode()) <= b for a, b in spans)]


def _haystack_depths(ex):
  """Measured from the text: each needle's share of the haystack bytes before it."""
  starts = [p - 1 for p in ex.needle_starts]
  sizes = [len(n.encode()) + 1 for n in ex.needles]
  intro = ex.text.index("\n") + 1
  end = ex.answer_start - 1 - len(ex.question.encode())
  total = end - intro - sum(sizes)
  before = [s - intro - sum(z for t, z in zip(starts, sizes) if t < s) for s in starts]
  return np.asarray(before) / max(total, 1), total


@pytest.mark.parametrize("task", NIAH + ("passkey",))
def test_every_option_fits_its_length_and_answers_only_in_needles(task):
  for i, (haystack, value_kind, vocab) in enumerate(_options(task)):
    for length in (1200, 3000):
      ex = niah.TASKS[task].generate(
        np.random.default_rng([i, length]),
        length,
        None,
        value_kind=value_kind,
        haystack=haystack,
        vocab=vocab,
        corpus=CORPUS,
      )
      toks = ex.tokens
      slack = _kv_line_len(task, value_kind) if haystack == "kv_lines" else MAX_LINE
      assert length - slack < len(toks) <= length, (haystack, value_kind, len(toks))
      assert toks[0] == TOK.bos_id and toks[-1] == TOK.eos_id and TOK.decode(toks) == ex.text
      assert ex.text.endswith(ex.question + " " + ", ".join(ex.answers))
      assert TOK.decode(toks[ex.answer_start : -1]) == ex.answer_text
      for a, s, n in zip(ex.answers, ex.answer_starts, ex.answer_lens):
        assert TOK.decode(toks[s : s + n]) == a
      # The answers cannot be read from the question (or intro, or haystack): only from the needles.
      for a in ex.answers:
        assert a not in ex.question and not _stray(ex, a), (a, ex.question)
        assert any(a in ex.needles[j] for j in ex.asked)
      if task != "passkey":
        assert all(not _stray(ex, k) for k in ex.keys)  # asked keys: in their needles and the question
      mask = ex.loss_mask()
      assert mask.shape == (len(toks) - 1,) and TOK.decode(toks[1:][mask > 0]) == ex.answer_text


@pytest.mark.parametrize("task", NIAH)
@pytest.mark.parametrize("haystack", ["repeat", "corpus", "kv_lines"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.77, 1.0])
def test_asked_needles_sit_at_the_requested_depth(task, haystack, depth):
  ex = niah.retrieval_example(task, 7, 2500, depth, haystack=haystack, corpus=CORPUS)
  measured, total = _haystack_depths(ex)
  line = _kv_line_len(task, "digits") if haystack == "kv_lines" else MAX_LINE
  asked = list(ex.asked) if task != "variable_tracking" else list(range(len(ex.answers)))
  np.testing.assert_allclose(measured, ex.placed_depths, atol=1e-9)
  assert np.all(np.abs(measured[asked] - depth) <= line / 2 / total + 1e-9)  # the nearest line boundary
  assert all(ex.depths[i] == depth for i in asked)
  if depth in (0.0, 1.0):  # exactly at either end
    assert np.all(measured[asked] == depth)


def test_depth_sequences_place_each_asked_needle():
  ds = [0.9, 0.1, 0.5, 0.3]
  ex = niah.niah_multiquery(3, 4000, ds, n_queries=4)
  measured, total = _haystack_depths(ex)
  assert np.all(np.abs(measured - ds) <= MAX_LINE / total)
  ex = niah.variable_tracking(3, 4000, [0.1, 0.2, 0.2, 0.6, 0.95], hops=4, chains=2)
  measured, total = _haystack_depths(ex)
  assert np.all(np.abs(measured[:5] - [0.1, 0.2, 0.2, 0.6, 0.95]) <= MAX_LINE / total)
  with pytest.raises(ValueError, match="must not decrease"):
    niah.variable_tracking(3, 4000, [0.5, 0.2, 0.3, 0.6, 0.9])
  with pytest.raises(ValueError, match="one depth per asked needle"):
    niah.niah_multivalue(3, 4000, [0.5, 0.2], n_values=4)


def test_answer_depth_is_uniform_over_seeds():
  deps = np.asarray([niah.niah_single(s, 800).placed_depths[0] for s in range(400)])
  counts = np.histogram(deps, bins=4, range=(0, 1))[0]
  assert counts.min() >= 70 and counts.max() <= 130, counts  # 100 each expected (chi2 < 15)
  # Multikey: the asked needle's rank among the k needles in the text is uniform too.
  ranks = []
  for s in range(240):
    ex = niah.niah_multikey(s, 1500, k=4)
    ranks.append(int(np.argsort(np.argsort(ex.needle_starts))[0]))
  counts = np.bincount(ranks, minlength=4)
  assert counts.min() >= 40 and counts.max() <= 80, counts  # 60 each expected


def test_value_kinds():
  rng = np.random.default_rng(0)
  digits = niah.draw_values(rng, "digits", 600)
  assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in digits) and len(set(digits)) == 600
  freq = np.bincount([int(c) for v in digits for c in v[1:]], minlength=10) / (600 * 6)
  assert np.all(np.abs(freq - 0.1) < 0.02), freq
  words = niah.draw_values(rng, "words", 40)
  assert set(words) <= set(niah.VALUE_WORDS) and len(set(words)) == 40
  uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
  assert all(uuid.fullmatch(v) for v in niah.draw_values(rng, "uuid", 200))
  # Through the generators, word values cover the list and each kind names its noun.
  seen = {niah.niah_single(s, 600, value_kind="words").answers[0] for s in range(300)}
  assert len(seen) > 0.8 * len(niah.VALUE_WORDS)
  for kind, noun in niah.NOUN.items():
    ex = niah.niah_single(1, 800, value_kind=kind)
    assert f"special magic {noun} for" in ex.question
    want = {"digits": r"[1-9]\d{6}", "words": "|".join(niah.VALUE_WORDS), "uuid": uuid.pattern}[kind]
    assert re.fullmatch(want, ex.answers[0])


@pytest.mark.parametrize("k", [2, 4, 8])
def test_multikey_distinct_keys_and_distractors(k):
  for s in range(20):
    ex = niah.niah_multikey(s, 3000, k=k, haystack=("repeat", "kv_lines")[s % 2])
    keys = [re.search(r"for (\S+) is:", n).group(1) for n in ex.needles]
    assert len(ex.needles) == k and len(set(keys)) == k and ex.asked == (0,) and ex.keys == (keys[0],)
    assert all(key not in ex.question for key in keys[1:])  # only the asked key is named
    if s % 2:  # the kv_lines haystack: other keys, other values
      hay = [ln for ln in ex.text.split("\n")[1:-1] if ln not in ex.needles]
      assert hay and all(keys[0] not in ln and ex.answers[0] not in ln for ln in hay)


def test_multivalue_and_multiquery_answer_order():
  for s in range(10):
    ex = niah.niah_multivalue(s, 3000, n_values=4)
    pos = [ex.text.index(f"is: {a}.") for a in ex.answers]
    assert pos == sorted(pos) and len(set(ex.keys)) == 1  # in order of appearance, one key
  orders = set()
  for s in range(10):
    ex = niah.niah_multiquery(s, 3000, n_queries=4)
    named = [ex.question.index(k) for k in ex.keys]
    assert named == sorted(named)  # answers follow the order the question names the keys
    for k, a in zip(ex.keys, ex.answers):
      assert f"for {k} is: {a}." in ex.text
    orders.add(ex.asked)
  assert len(orders) > 1  # the asked order is not the needles' order


@pytest.mark.parametrize("haystack", ["repeat", "corpus", "kv_lines"])
def test_variable_tracking_resolves_to_the_asked_value(haystack):
  for s in range(6):
    ex = niah.variable_tracking(s, 3000, hops=3, chains=3, haystack=haystack, corpus=CORPUS)
    bound = {}
    for ln in ex.text.split("\n"):
      if m := re.fullmatch(r"VAR ([A-Z]{5}) = (\S+)", ln):
        bound[m.group(1)] = bound.get(m.group(2), m.group(2))  # a name, or a literal
    names = [n for n in bound if bound[n] == ex.keys[0]]
    assert tuple(names) == ex.answers and len(names) == 4
    assert f"{len(names)} variables are assigned the value {ex.keys[0]}" in ex.question


def test_passkey_is_make_prompt_in_the_harness():
  ex = niah.passkey_task(np.random.default_rng(5), 1024, 0.5)
  p = passkey.make_prompt(TOK, 1024, 0.5, passkey.random_key(np.random.default_rng(5)))
  assert np.array_equal(ex.tokens, p["tokens"]) and ex.answers == (str(p["key"]),)
  assert ex.answer_start == p["answer_start"] and ex.needle_starts == (p["needle_start"],)
  d = ex.as_passkey_dict()  # what fpa_jax.eval.passkey.teacher_forced_exact_match reads
  assert d["answer_start"] == p["answer_start"] and d["answer"] == p["answer"]
  assert abs(ex.placed_depths[0] - 0.5) < 0.05


def _interpret_bindings(text: str) -> list[str]:
  """The answer of each "?x=" query: the value of x's innermost live binding."""
  scopes, out = [{}], []
  for m in re.finditer(r"\{|\}|\?([a-z])=(\d+);|([a-z])=(\d+);", text):
    if m.group(0) == "{":
      scopes.append({})
    elif m.group(0) == "}":
      scopes.pop()
    elif m.group(1):
      out.append(next(s[m.group(1)] for s in reversed(scopes) if m.group(1) in s))
      assert out[-1] == m.group(2)
    else:
      scopes[-1][m.group(3)] = m.group(4)
  return out


@pytest.mark.parametrize("vocab", ["train", "heldout"])
def test_bindings_rendered_in_the_harness(vocab):
  for s, length in [(0, 400), (1, 1000), (2, 3000)]:
    ex = niah.bindings_task(s, length, vocab=vocab)
    assert length - 1 <= len(ex.tokens) <= length
    assert list(ex.answers) == _interpret_bindings(ex.text) and ex.answers
    assert set(re.findall(r"[a-z]", ex.text)) <= set(niah.BINDING_LETTERS[vocab])
    for a, p in zip(ex.answers, ex.answer_starts):
      assert ex.text[p - 4] == "?" and ex.text[p - 2 : p] == "=" + a  # "?x=" then the value (text: no BOS)
  assert ex.loss_mask().sum() == len(ex.answers)


def test_scoring_is_exact_match_per_answer():
  ex = niah.niah_multivalue(2, 2000, n_values=4)
  a = list(ex.answers)
  assert niah.score_answers(a, ex) == 1.0
  assert niah.score_answers(" " + ", ".join(a) + "\nmore", ex) == 1.0  # generated text, parsed
  assert niah.score_answers([a[0], "x", a[2]], ex) == 0.5  # 2 of 4 (the 4th missing)
  assert niah.score_answers(a[::-1], ex) == 0.0  # the order is part of the answer
  assert niah.score_answers([a[0] + "1", *a[1:]], ex) == 0.75  # no partial credit within an answer
  one = niah.niah_single(2, 1000)
  assert niah.score_answers([one.answers[0]], one) == 1.0 and niah.score_answers([], one) == 0.0
  # Teacher forcing: an oracle argmax (the next token everywhere) gets every answer; one wrong byte in
  # answer 2 loses that answer only.
  oracle = np.concatenate([ex.tokens[1:], [0]])
  assert niah.teacher_forced_correct(oracle, ex).all() and niah.score_teacher_forced(oracle, ex) == 1.0
  bad = oracle.copy()
  bad[ex.answer_starts[2] - 1 + 3] += 1
  assert list(niah.teacher_forced_correct(bad, ex)) == [True, True, False, True]
  assert niah.score_teacher_forced(bad, ex) == 0.75
  spec = niah.TASKS
  assert all(t.answer_format and t.scoring for t in spec.values())


@pytest.mark.parametrize("task", list(niah.TASKS))
def test_deterministic_by_seed(task):
  a = niah.retrieval_example(task, [4, 2], 1500)
  b = niah.retrieval_example(task, [4, 2], 1500)
  c = niah.retrieval_example(task, [4, 3], 1500)
  assert np.array_equal(a.tokens, b.tokens) and a.answers == b.answers
  assert not np.array_equal(a.tokens, c.tokens)
  e1 = niah.retrieval_eval_examples(task, 1500, None if task == "bindings" else 0.5, n=2, seed=1)
  e2 = niah.retrieval_eval_examples(task, 1500, None if task == "bindings" else 0.5, n=2, seed=1)
  assert [x.text for x in e1] == [x.text for x in e2]


def test_vocabularies_are_disjoint_and_unambiguous():
  (ta, tn), (ha, hn) = niah.KEY_WORDS["train"], niah.KEY_WORDS["heldout"]
  assert not (set(ta) | set(tn)) & (set(ha) | set(hn))
  words = [*ta, *tn, *ha, *hn, *niah.VALUE_WORDS]
  assert len(set(words)) == len(words)
  # No word inside another: a key or value found in a prompt is the one put there.
  assert not [(a, b) for a in words for b in words if a != b and a in b]
  fixed = " ".join([*niah.TEMPLATES, *niah.FILLER["train"], *niah.FILLER["heldout"], passkey.TASK])
  assert not [w for w in niah.VALUE_WORDS if w in fixed.lower()] and "-" not in fixed
  assert not set(niah.FILLER["train"]) & set(niah.FILLER["heldout"])
  assert not set(niah.NAME_LETTERS["train"]) & set(niah.NAME_LETTERS["heldout"])
  assert not set(niah.BINDING_LETTERS["train"]) & set(niah.BINDING_LETTERS["heldout"])
  train_words = set(ta) | set(tn)
  for task in ("niah_single", "niah_multikey", "niah_multiquery"):
    ex = niah.retrieval_example(task, 1, 3000, vocab="heldout", haystack="kv_lines")
    used = set(re.findall(r"([a-z]+)-([a-z]+)", ex.text))
    assert used and not {w for pair in used for w in pair} & train_words
    ex = niah.retrieval_example(task, 1, 3000, vocab="heldout", haystack="repeat")
    hay = {ln for ln in ex.text.split("\n")[1:-1] if ln not in ex.needles}
    assert hay <= set(niah.FILLER["heldout"])
  ex = niah.variable_tracking(1, 3000, vocab="heldout", haystack="kv_lines", chains=2)
  assert set("".join(re.findall(r"VAR ([A-Z]+) =", ex.text))) <= set(niah.NAME_LETTERS["heldout"])
  # The default corpus is read locally: the stdlib's train files, or its test files when held out.
  tr, ho = niah.default_corpus("train", small=True), niah.default_corpus("heldout", small=True)
  assert len(tr) > len(ho) > 0 and tr.lines != ho.lines


def test_bad_arguments_say_what_to_change():
  with pytest.raises(ValueError, match="k must be an int >= 1"):
    niah.niah_multikey(0, 2000, k=0)
  for bad in (-0.1, 1.5):
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
      niah.niah_single(0, 2000, bad)
  with pytest.raises(ValueError, match=r"hops must be an int >= 1"):
    niah.variable_tracking(0, 2000, hops=0)
  for task in NIAH:
    with pytest.raises(ValueError, match=r"too short .* use length >= (\d+)") as e:
      niah.retrieval_example(task, 9, 100)
    need = int(re.search(r"length >= (\d+)", str(e.value)).group(1))
    ex = niah.retrieval_example(task, 9, need)  # the stated minimum fits (with no haystack)
    assert len(ex.tokens) == need
  with pytest.raises(ValueError, match=r"too short for a passkey .* use length >= \d+"):
    niah.passkey_task(0, 100)
  with pytest.raises(ValueError, match=r"too short for a bindings .* use length >= 130"):
    niah.bindings_task(0, 100)
  with pytest.raises(ValueError, match=r"value_kind must be one of \('digits', 'words', 'uuid'\)"):
    niah.niah_single(0, 2000, value_kind="hex")
  with pytest.raises(ValueError, match=r"passkey: haystack must be one of \('repeat',\)"):
    niah.passkey_task(0, 2000, haystack="corpus")
  with pytest.raises(ValueError, match="vocab must be one of"):
    niah.niah_single(0, 2000, vocab="test")
  with pytest.raises(ValueError, match="depth=None"):
    niah.bindings_task(0, 2000, 0.5)
  with pytest.raises(ValueError, match="task must be one of"):
    niah.retrieval_example("niah", 0, 2000)
  with pytest.raises(ValueError, match="no usable line"):
    niah.Corpus(["\n\n   \n"])


def test_builder_round_trip(tmp_path):
  with pytest.raises(ValueError, match="not built"):
    niah.get_niah_builder(tmp_path, small=True, build=False)
  b = niah.get_niah_builder(tmp_path, small=True)
  cfg = b.builder_config
  assert set(b.info.splits) == {"train", "validation", "test", "test_heldout"}
  seen = {}
  for split, vocab in niah.SPLIT_VOCAB.items():
    src = niah.niah_data_source(split, tmp_path, small=True, build=False)
    exs = [niah.example_from_record(src[i]) for i in range(len(src))]
    assert len(exs) == (cfg.n_train if split == "train" else cfg.n_eval)
    assert {e.task for e in exs} == set(niah.TASKS)  # every task in every split (n >= 7)
    for e in exs:
      niah.check_example(e, keys=e.task not in ("passkey", "bindings"))
      assert e.vocab == (vocab if vocab in niah.TASKS[e.task].vocabs else "train")
      assert len(e.tokens) <= e.length and e.length in cfg.lengths
    seen[split] = {e.tokens.tobytes() for e in exs}
    # The records are the examples the generators make from the split's own seeds.
    corpus = niah.default_corpus(vocab, cfg.small_corpus)
    want = set()
    for i in range(len(exs)):
      task = cfg.tasks[i % len(cfg.tasks)]
      v = vocab if vocab in niah.TASKS[task].vocabs else "train"
      rng = builders.example_rng(cfg.seed, split, i)
      want.add(niah.random_example(task, rng, cfg.lengths[0], vocab=v, corpus=corpus).tokens.tobytes())
    assert seen[split] == want
  splits = list(seen)
  assert all(not seen[a] & seen[b] for a in splits for b in splits if a < b)  # distinct seeds, no overlap
