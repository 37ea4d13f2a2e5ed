"""fpa_scopes / fpa_dips: targets against an independent brute force, determinism, TFDS round trip."""

import numpy as np
import pytest

from fpa_jax.data import bindings, builders, dips, scopes


def brute_scopes(tokens, n_symbols):
  """Depth from the raw tokens; key j live at i iff min depth on (j, i] >= depth(j)."""
  depth = np.cumsum([1 if t == scopes.OPEN else -1 if t == scopes.CLOSE else 0 for t in tokens])
  keys = [j for j, t in enumerate(tokens) if scopes.CONTENT0 <= t < scopes.CONTENT0 + n_symbols]
  out = {}
  for i, t in enumerate(tokens):
    if t == scopes.QUERY:
      out[i] = [j for j in keys if j < i and depth[j + 1 : i + 1].min() >= depth[j]]
  return depth, out


def brute_dips(cfg, tokens):
  """Key j live at i iff no dip on (j, i] has value below level(j)."""
  out = {}
  for i, t in enumerate(tokens):
    if t != dips.QUERY:
      continue
    live = []
    for j in range(i):
      c = dips.decode_content(cfg, tokens[j])
      if c is not None and all(
        not (dips.DIP0 <= tokens[k] < dips.DIP0 + cfg.n_levels and tokens[k] - dips.DIP0 < c[0])
        for k in range(j + 1, i + 1)
      ):
        live.append(j)
    out[i] = live
  return out


def ragged(ex):
  offs = np.concatenate([[0], np.cumsum(ex["live_len"])])
  return {int(q): list(ex["live_idx"][offs[n] : offs[n + 1]]) for n, q in enumerate(ex["query_pos"])}


@pytest.mark.parametrize("seed", range(6))
def test_scopes_targets_match_brute_force(seed):
  cfg = scopes.ScopesConfig(length=200, max_depth=3 + seed % 3, n_symbols=5, open_rate=0.3, close_rate=0.25)
  ex = scopes.generate(np.random.default_rng(seed), cfg)
  toks = ex["tokens"]
  assert len(toks) == cfg.length and toks[0] == scopes.BOS and toks[-1] == scopes.EOS
  depth, live = brute_scopes(list(toks), cfg.n_symbols)
  np.testing.assert_array_equal(ex["depth"], depth)
  assert depth.min() >= 0 and depth.max() <= cfg.max_depth and depth.max() > 0
  assert ragged(ex) == live and len(live) > 3
  assert any(
    0 < len(v) < sum(1 for t in toks[:q] if scopes.CONTENT0 <= t < scopes.CONTENT0 + cfg.n_symbols)
    for q, v in live.items()
  )
  for q, v in live.items():  # the answer is the symbol of the most recent live key, or NONE
    want = scopes.NONE if not v else toks[v[-1]] + cfg.n_symbols
    assert toks[q + 1] == want


def brute_bindings(toks: list[int], cfg) -> dict[int, int]:
  """query NAME position -> the position of the binding it must return: the latest binding of that
  name whose scope is still open, found by a backwards scan that skips closed scopes."""
  out = {}
  for q in range(1, len(toks) - 1):
    if toks[q - 1] != bindings.QUERY:
      continue
    depth_drop, j = 0, q - 2
    while j >= 0:  # walk back; a CLOSE hides everything until its matching OPEN
      if toks[j] == bindings.CLOSE:
        depth_drop += 1
      elif toks[j] == bindings.OPEN:
        depth_drop = max(depth_drop - 1, 0)
      elif depth_drop == 0 and (bindings.decode_bind(cfg, toks[j]) or (None,))[0] == toks[q] - bindings.NAME0:
        out[q] = j
        break
      j -= 1
  return out


@pytest.mark.parametrize("seed", range(4))
def test_bindings_targets_match_brute_force_and_defeat_a_window(seed):
  """Every query's answer is its name's innermost live binding (a backwards scan over the tokens),
  and at every length >= 30% of the answers lie further back than an eighth of the sequence: a
  window of 12.5% of the cache loses them."""
  far, n_q = 0, 0
  for k, length in enumerate([128, 512, 1024]):
    cfg = bindings.BindingsConfig(length=length, max_depth=3 + seed % 2)
    ex = bindings.generate(np.random.default_rng([seed, k]), cfg)
    toks = ex["tokens"]
    assert len(toks) == length and toks[0] == bindings.BOS and toks[-1] == bindings.EOS
    assert toks.max() < bindings.vocab_size(cfg) and ex["depth"].max() <= cfg.max_depth and ex["depth"].min() >= 0
    want = brute_bindings(list(toks), cfg)
    assert dict(zip(ex["query_pos"].tolist(), ex["answer_pos"].tolist())) == want and len(want) >= 3
    for q, a in zip(ex["query_pos"], ex["answer_pos"]):
      assert toks[q + 1] == bindings.value_token(cfg, bindings.decode_bind(cfg, toks[a])[1])
    np.testing.assert_array_equal(np.flatnonzero(bindings.loss_mask(toks)), ex["query_pos"])
    far += int((ex["query_pos"] - ex["answer_pos"] > length // 8).sum())
    n_q += len(want)
  assert far / n_q >= 0.3, (far, n_q)
  with pytest.raises(ValueError, match="inner_min"):
    bindings.BindingsConfig(inner_min=0.5, inner_max=0.2).validate()


@pytest.mark.parametrize("seed", range(6))
def test_dips_targets_match_brute_force(seed):
  cfg = dips.DipsConfig(length=160, n_levels=3 + seed % 2, n_symbols=4)
  ex = dips.generate(np.random.default_rng(seed), cfg)
  toks = list(ex["tokens"])
  assert len(toks) == cfg.length and max(toks) < dips.vocab_size(cfg)
  live = brute_dips(cfg, toks)
  assert ragged(ex) == live and len(live) > 3
  for q, v in live.items():
    want = dips.NONE if not v else dips.answer0(cfg) + dips.decode_content(cfg, toks[v[-1]])[1]
    assert toks[q + 1] == want
  m = dips.loss_mask(ex["tokens"])
  assert m.sum() == len(live) and all(m[q] == 1 for q in live)


def test_generation_is_deterministic_given_seed():
  cfg = scopes.ScopesConfig(length=100)
  a, b = (scopes.generate(np.random.default_rng(7), cfg) for _ in range(2))
  c = scopes.generate(np.random.default_rng(8), cfg)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a["tokens"], c["tokens"])


@pytest.mark.parametrize("task", ["scopes", "dips"])
def test_tfds_records_match_brute_force_and_rebuild_identically(task, tmp_path):
  src = builders.data_source(task, "validation", tmp_path / "a", small=True)
  cfg = builders.synthetic_task_config(task, small=True)
  assert len(src) == 32
  for i in range(4):
    ex = src[i]
    toks = list(ex["tokens"])
    live = brute_scopes(toks, cfg.n_symbols)[1] if task == "scopes" else brute_dips(cfg, toks)
    assert ragged(ex) == live
  again = builders.data_source(task, "validation", tmp_path / "b", small=True)
  assert all(np.array_equal(src[i]["tokens"], again[i]["tokens"]) for i in range(len(src)))
