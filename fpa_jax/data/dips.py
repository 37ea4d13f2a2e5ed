"""`fpa_dips`: the general case of first-passage liveness.

CONTENT tokens carry a (level, symbol) pair; DIP tokens carry a field value v. Key j is *live* at i
iff no dip on (j, i] went below its level (a dip v kills every live key with level > v). Nested
scopes are the special case where levels are depths and dips are closes. QUERY is followed by
the symbol of the most recent live key, or NONE.

Vocabulary (L = n_levels, C = n_symbols; size `5 + L + L*C + C`)::

    0 PAD | 1 BOS | 2 EOS | 3 QUERY | 4 NONE | 5 .. 5+L-1: DIP v
    5+L + level*C + symbol: CONTENT | 5+L+L*C + symbol: ANSWER
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD, BOS, EOS, QUERY, NONE = range(5)
DIP0 = 5


@dataclasses.dataclass(frozen=True)
class DipsConfig:
  """Generator settings; rates are relative weights of the event kinds per step."""

  length: int = 512  # tokens per example, BOS and EOS included
  n_levels: int = 4
  n_symbols: int = 8
  content_rate: float = 0.5
  dip_rate: float = 0.25
  query_rate: float = 0.25


def content0(cfg: DipsConfig) -> int:
  return DIP0 + cfg.n_levels


def answer0(cfg: DipsConfig) -> int:
  return content0(cfg) + cfg.n_levels * cfg.n_symbols


def vocab_size(cfg: DipsConfig) -> int:
  return answer0(cfg) + cfg.n_symbols


def decode_content(cfg: DipsConfig, token: int) -> tuple[int, int] | None:
  """(level, symbol) of a CONTENT token, else None."""
  k = int(token) - content0(cfg)
  return divmod(k, cfg.n_symbols) if 0 <= k < cfg.n_levels * cfg.n_symbols else None


def generate(rng: np.random.Generator, cfg: DipsConfig) -> dict[str, np.ndarray]:
  """One example of exactly `cfg.length` tokens.

  Returns int32 arrays: `tokens` [T]; `query_pos` [Q] (the answer sits at query_pos + 1);
  `live_idx` [sum(live_len)] and `live_len` [Q]: each query's live key positions, ascending.
  """
  if cfg.length < 4:
    raise ValueError(f"DipsConfig.length must be >= 4, got {cfg.length}")
  rates = np.array([cfg.content_rate, cfg.dip_rate, cfg.query_rate], float)
  probs = rates / rates.sum()
  tokens = [BOS]
  live: list[tuple[int, int, int]] = []  # (position, level, symbol), ascending position
  query_pos, live_idx, live_len = [], [], []
  # Draw all randomness up front (one event per step, at most `length` steps): fast and seeded.
  n = cfg.length
  kinds, levels = rng.choice(3, size=n, p=probs), rng.integers(cfg.n_levels, size=n)
  syms, dips = rng.integers(cfg.n_symbols, size=n), rng.integers(cfg.n_levels, size=n)
  step = -1
  while len(tokens) < cfg.length - 1:
    step += 1
    kind = int(kinds[step])
    if kind == 2 and len(tokens) + 2 > cfg.length - 1:
      kind = 0  # no room for QUERY + ANSWER before EOS
    if kind == 0:
      level, sym = int(levels[step]), int(syms[step])
      live.append((len(tokens), level, sym))
      tokens.append(content0(cfg) + level * cfg.n_symbols + sym)
    elif kind == 1:
      v = int(dips[step])
      live = [k for k in live if k[1] <= v]
      tokens.append(DIP0 + v)
    else:
      query_pos.append(len(tokens))
      live_idx.extend(p for p, _, _ in live)
      live_len.append(len(live))
      tokens.append(QUERY)
      tokens.append(NONE if not live else answer0(cfg) + live[-1][2])
  tokens.append(EOS)
  i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
  return {"tokens": i32(tokens), "query_pos": i32(query_pos), "live_idx": i32(live_idx), "live_len": i32(live_len)}


def loss_mask(tokens: np.ndarray) -> np.ndarray:
  """float32 [T-1] over next-token pairs: 1 where the input is QUERY (target = its answer)."""
  return (np.asarray(tokens[:-1]) == QUERY).astype(np.float32)
