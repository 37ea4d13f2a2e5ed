"""`fpa_scopes`: nested scopes from a random depth walk -- the shared-walk structure.

Tokens (one event per token): OPEN raises the depth, CLOSE lowers it, a CONTENT symbol is a key
at the current depth, and QUERY is followed by its ANSWER token. Key j is *live* at i iff its scope
is still open: the depth never fell below depth(j) on (j, i]. The answer to a query is the symbol of
the most recent live key (NONE when none is live), so solving it needs exactly the live set.

Vocabulary (size `7 + 2 * n_symbols`)::

    0 PAD | 1 BOS | 2 EOS | 3 OPEN | 4 CLOSE | 5 QUERY | 6 NONE
    7 .. 7+C-1: content symbols | 7+C .. 7+2C-1: answer symbols (kept apart from content keys)
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD, BOS, EOS, OPEN, CLOSE, QUERY, NONE = range(7)
CONTENT0 = 7


@dataclasses.dataclass(frozen=True)
class ScopesConfig:
  """Generator settings; rates are relative weights of the event kinds per step."""

  length: int = 512  # tokens per example, BOS and EOS included
  max_depth: int = 8
  n_symbols: int = 16
  open_rate: float = 0.2
  close_rate: float = 0.2
  content_rate: float = 0.4
  query_rate: float = 0.2


def vocab_size(cfg: ScopesConfig) -> int:
  return CONTENT0 + 2 * cfg.n_symbols


def answer_token(cfg: ScopesConfig, symbol: int | None) -> int:
  return NONE if symbol is None else CONTENT0 + cfg.n_symbols + symbol


def generate(rng: np.random.Generator, cfg: ScopesConfig) -> dict[str, np.ndarray]:
  """One example of exactly `cfg.length` tokens.

  Returns int32 arrays: `tokens` [T]; `depth` [T] (depth after each token); `query_pos` [Q]
  (positions of QUERY tokens; the answer sits at query_pos + 1); `live_idx` [sum(live_len)] and
  `live_len` [Q]: the live key positions of each query as a ragged, ascending index list.
  """
  if cfg.length < 4:
    raise ValueError(f"ScopesConfig.length must be >= 4, got {cfg.length}")
  rates = np.array([cfg.open_rate, cfg.close_rate, cfg.content_rate, cfg.query_rate], float)
  probs = rates / rates.sum()
  tokens, depths = [BOS], [0]
  depth = 0
  live: list[tuple[int, int, int]] = []  # (position, depth, symbol): always a stack by depth
  query_pos, live_idx, live_len = [], [], []
  # Draw all randomness up front (one event per step, at most `length` steps): fast and seeded.
  kinds, syms = rng.choice(4, size=cfg.length, p=probs), rng.integers(cfg.n_symbols, size=cfg.length)
  step = -1
  while len(tokens) < cfg.length - 1:
    step += 1
    kind = int(kinds[step])
    # Keep the walk inside [0, max_depth] and leave room for QUERY + ANSWER + EOS.
    if kind == 0 and depth >= cfg.max_depth or kind == 1 and depth == 0:
      kind = 2
    if kind == 3 and len(tokens) + 2 > cfg.length - 1:
      kind = 2
    if kind == 0:
      depth += 1
      tokens.append(OPEN)
    elif kind == 1:
      # Closing scope `depth` kills exactly its keys, which sit on top of the stack.
      while live and live[-1][1] == depth:
        live.pop()
      depth -= 1
      tokens.append(CLOSE)
    elif kind == 2:
      sym = int(syms[step])
      live.append((len(tokens), depth, sym))
      tokens.append(CONTENT0 + sym)
    else:
      query_pos.append(len(tokens))
      live_idx.extend(p for p, _, _ in live)
      live_len.append(len(live))
      tokens.append(QUERY)
      depths.append(depth)
      tokens.append(answer_token(cfg, live[-1][2] if live else None))
    depths.extend([depth] * (len(tokens) - len(depths)))
  tokens.append(EOS)
  depths.append(depth)
  i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
  return {
    "tokens": i32(tokens),
    "depth": i32(depths),
    "query_pos": i32(query_pos),
    "live_idx": i32(live_idx),
    "live_len": i32(live_len),
  }


def loss_mask(tokens: np.ndarray) -> np.ndarray:
  """float32 [T-1] over next-token pairs: 1 where the input is QUERY (target = its answer)."""
  return (np.asarray(tokens[:-1]) == QUERY).astype(np.float32)
