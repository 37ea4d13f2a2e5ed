"""`bindings`: named bindings in nested scopes, asked for after long closed inner scopes.

A program of scopes that bind names to values; a query names a variable and its answer is the value
of that name's innermost live binding (the most recent binding whose scope is still open). Each
outer scope binds a few names, then an inner stretch of nested scopes rebinds the same names (stale
once their scopes close, and more recent than the live bindings) for uniform(inner_min, inner_max)
x `length` tokens, with a few local queries; then the outer names are asked for. Stretches scale
with the length, so at 4x the training length a far answer sits 4x further back: keeping the last
N tokens loses it, keeping the live keys (what a first-passage gate can learn: a scope's keys die
when it closes) does not. `fpa_jax.data.scopes` asks for the most recent live key whatever its
name; this language is content-addressed, like the variable lookups of real code.

Tokens::

    OPEN, CLOSE               a scope (depth +1 / -1)
    BIND(name, value)         one token: a binding in the current scope (a key that holds both)
    QUERY NAME -> VALUE       a query; its answer is the next token (the loss is on it)

Vocabulary (size `7 + N + V + N * V`)::

    0 PAD | 1 BOS | 2 EOS | 3 OPEN | 4 CLOSE | 5 QUERY | 6 (unused: scopes' NONE)
    7 .. 7+N-1: names | then V values | then N * V bindings (name-major)
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD, BOS, EOS, OPEN, CLOSE, QUERY = range(6)
NAME0 = 7


@dataclasses.dataclass(frozen=True)
class BindingsConfig:
  length: int = 512  # tokens per example, BOS and EOS included
  n_names: int = 6
  n_values: int = 10
  max_depth: int = 4  # inner scopes use depths 2 .. max_depth
  outer_bindings: int = 2  # names bound at depth 1 by each outer scope
  inner_min: float = 0.1  # an inner stretch lasts uniform(inner_min, inner_max) * length tokens
  inner_max: float = 0.4
  inner_queries: float = 1.0  # expected local queries per inner stretch
  far_queries: int = 2  # queries of the outer names after each stretch

  def validate(self) -> BindingsConfig:
    if self.length < 32 or self.max_depth < 2 or not 0 < self.inner_min <= self.inner_max < 1:
      raise ValueError(f"BindingsConfig needs length >= 32, max_depth >= 2 and 0 < inner_min <= inner_max < 1: {self}")
    if not 1 <= self.outer_bindings <= self.n_names or self.n_values < 2 or self.far_queries < 1:
      raise ValueError(f"BindingsConfig needs 1 <= outer_bindings <= n_names, n_values >= 2, far_queries >= 1: {self}")
    return self


def vocab_size(cfg: BindingsConfig) -> int:
  return NAME0 + cfg.n_names + cfg.n_values + cfg.n_names * cfg.n_values


def value_token(cfg: BindingsConfig, value: int) -> int:
  return NAME0 + cfg.n_names + value


def bind_token(cfg: BindingsConfig, name: int, value: int) -> int:
  return NAME0 + cfg.n_names + cfg.n_values + name * cfg.n_values + value


def decode_bind(cfg: BindingsConfig, token: int) -> tuple[int, int] | None:
  """(name, value) of a binding token, else None."""
  k = int(token) - (NAME0 + cfg.n_names + cfg.n_values)
  return divmod(k, cfg.n_values) if 0 <= k < cfg.n_names * cfg.n_values else None


class _Program:
  """Tokens plus the scope stack of bindings: what each query's answer is, and where it was bound."""

  def __init__(self, cfg: BindingsConfig, rng: np.random.Generator):
    self.cfg, self.rng = cfg, rng
    self.tokens, self.depths = [BOS], [0]
    self.scopes: list[dict[int, tuple[int, int]]] = [{}]  # per open scope: name -> (value, its position)
    self.query_pos, self.answer_pos = [], []

  @property
  def depth(self) -> int:
    return len(self.scopes) - 1

  def _emit(self, *toks: int) -> None:
    self.tokens += toks
    self.depths += [self.depth] * len(toks)

  def open(self):
    self.scopes.append({})
    self._emit(OPEN)

  def close(self):
    self.scopes.pop()
    self._emit(CLOSE)

  def bind(self, name: int):
    value = int(self.rng.integers(self.cfg.n_values))
    self.scopes[-1][name] = (value, len(self.tokens))
    self._emit(bind_token(self.cfg, name, value))

  def lookup(self, name: int) -> tuple[int, int] | None:
    return next((s[name] for s in reversed(self.scopes) if name in s), None)

  def query(self, name: int):
    value, pos = self.lookup(name)
    self.query_pos.append(len(self.tokens) + 1)  # the NAME token; its target is the answer
    self.answer_pos.append(pos)
    self._emit(QUERY, NAME0 + name, value_token(self.cfg, value))

  def live_names(self) -> list[int]:
    return sorted({n for s in self.scopes for n in s})


def generate(rng: np.random.Generator, cfg: BindingsConfig) -> dict[str, np.ndarray]:
  """One example of exactly `cfg.length` tokens.

  Returns int32 arrays: `tokens` [T]; `depth` [T] (scope depth after each token); `query_pos` [Q]
  (the NAME token of each query: the answer is tokens[query_pos + 1]); `answer_pos` [Q] (the
  binding token that answers it: `decode_bind(tokens[answer_pos])` is (name, answer value)).
  """
  cfg.validate()
  p = _Program(cfg, rng)
  end = cfg.length - 1  # the EOS slot
  room = lambda k: len(p.tokens) + k <= end  # noqa: E731
  names = lambda k: [int(n) for n in rng.choice(cfg.n_names, size=k, replace=False)]  # noqa: E731
  while room(1):
    stretch = max(1, int(rng.uniform(cfg.inner_min, cfg.inner_max) * cfg.length))
    outer_cost = 2 + cfg.outer_bindings + 3 * cfg.far_queries
    if not room(stretch + outer_cost):
      break
    p.open()
    outer = names(cfg.outer_bindings)
    for n in outer:
      p.bind(n)
    stop = len(p.tokens) + stretch
    p_query = cfg.inner_queries / max(stretch / 1.5, 1)  # per event; events are ~1.5 tokens
    # Inside: never idle at depth 1 (a binding there would be a live outer one). Keep room to close
    # back to depth 1 and ask the far queries.
    while len(p.tokens) < stop and room(p.depth + 3 * cfg.far_queries + 4):
      r = rng.random()
      if p.depth == 1 or (r < 0.2 and p.depth < cfg.max_depth):
        p.open()
      elif r < 0.4 and p.depth > 2:
        p.close()
      elif r > 1 - p_query:
        p.query(int(rng.choice(p.live_names())))
      else:
        p.bind(int(rng.integers(cfg.n_names)))  # often shadows an outer name: stale once closed
    while p.depth > 1:
      p.close()
    for n in rng.choice(outer, size=cfg.far_queries):
      p.query(int(n))  # answered by the outer binding, past every closed inner scope
    p.close()
  while room(1):  # fill the tail with empty scopes (an open only where its close fits), then PAD
    if p.depth:
      p.close()
    elif room(2):
      p.open()
    else:
      p._emit(PAD)
  assert p.depth == 0 and len(p.tokens) == end
  p.tokens.append(EOS)
  p.depths.append(0)
  i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
  return {
    "tokens": i32(p.tokens),
    "depth": i32(p.depths),
    "query_pos": i32(p.query_pos),
    "answer_pos": i32(p.answer_pos),
  }


def loss_mask(tokens: np.ndarray) -> np.ndarray:
  """float32 [T-1] over next-token pairs: 1 where the input is a queried NAME (target = its value)."""
  t = np.asarray(tokens)
  m = np.zeros(len(t) - 1, np.float32)
  m[1:] = t[:-2] == QUERY
  return m


class BindingsLM:
  """In-memory LM batches of `generate` examples (seeded per batch), loss on every next token with
  the answers weighted x`answer_weight`. Checkpointable: `get_state` / `set_state` (the batch count).

  Yields dicts of inputs / targets / segment_ids int32 [B, T] and loss_mask float32 [B, T], T = seq_len."""

  def __init__(self, *, seq_len: int, batch_size: int, seed: int = 0, answer_weight: float = 4.0, **cfg_kw):
    self.cfg = BindingsConfig(length=seq_len + 1, **cfg_kw).validate()
    self.vocab_size = vocab_size(self.cfg)
    self.batch_size, self.seed, self.w, self.n = batch_size, seed, answer_weight, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.n])
    self.n += 1
    toks = np.stack([generate(rng, self.cfg)["tokens"] for _ in range(self.batch_size)])
    mask = 1.0 + (self.w - 1.0) * np.stack([loss_mask(t) for t in toks])
    return {
      "inputs": toks[:, :-1],
      "targets": toks[:, 1:],
      "segment_ids": np.ones_like(toks[:, :-1]),
      "loss_mask": mask.astype(np.float32),
    }

  def get_state(self) -> dict:
    return {"n": self.n}

  def set_state(self, state: dict) -> None:
    self.n = int(state["n"])
