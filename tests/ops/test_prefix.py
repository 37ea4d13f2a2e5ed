"""Chunked prefill against a cache: the op (`ops.prefix`), a layer's cache (`inference.cache.
prefill_chunk`) and the model (`inference.extend`).

  * the op against float64 loops, on arbitrary cached state and on a sequence split at every point;
  * with the full cache, chunk by chunk = the whole prompt at once (outputs and cache state), for
    several splits, size-1 chunks and rows of different chunk lengths;
  * with eviction, exactly a float64 loop simulation of the policy's keep rule, and the `fpa`
    tolerance bound (|out - full| <= 2 eps max|v|) with keys actually evicted;
  * the model: `extend` = the parallel logits (full), = `prefill_parallel`'s cache for one chunk.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fwd import forward
from _tol import assert_close, rtol

from fpa_jax import configs as C
from fpa_jax import ops
from fpa_jax.inference import cache as K
from fpa_jax.inference import decode as D
from fpa_jax.inference import conversation as E
from fpa_jax.inference.policies import make_policy, tolerance_threshold
from fpa_jax.models import build_model
from fpa_jax.ops import first_passage as fp
from fpa_jax.ops import reference_np as ref

F32 = np.float32


def _rep(x, g):
  return np.repeat(np.asarray(x), g, axis=2)


def _seq(seed, b=2, t=10, h=4, kvh=2, d=3):
  """fp32-representable q, k, v, field, level of a whole sequence; some levels +-inf, fields +inf."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, h, d)).astype(F32)
  k, v = (rng.normal(size=(b, t, kvh, d)).astype(F32) for _ in range(2))
  field = np.cumsum(rng.normal(size=(b, t, kvh)), 1).astype(F32)
  level = (field + rng.normal(size=(b, t, kvh))).astype(F32)
  level[0, 1, 0], level[-1, 2, -1], field[0, 4, -1] = np.inf, -np.inf, np.inf
  return q, k, v, field, level


# ----------------------------------------------------------------------------- the op


def test_prefix_matches_float64_loops_on_arbitrary_cached_state():
  rng = np.random.default_rng(0)
  b, t, s, h, kvh, d = 2, 5, 7, 4, 2, 3
  q, k, v, field, level = _seq(1, b, t, h, kvh, d)
  ck, cv = (rng.normal(size=(b, s, kvh, d)).astype(F32) for _ in range(2))
  clev = rng.normal(size=(b, s, kvh)).astype(F32)
  cmin = (clev + rng.normal(size=(b, s, kvh))).astype(F32)
  cmin[0, 0, 0], clev[1, 3, 1], clev[0, 5, 1] = np.inf, np.inf, -np.inf  # newest key, dead, immortal
  valid = rng.random((b, s, kvh)) < 0.7
  clev[~valid] = np.nan  # never read
  cached = ops.CachedKeys(*(jnp.asarray(x) for x in (ck, cv, clev, cmin, valid)))
  g = h // kvh
  want = ref.fpa_prefix_attention_np(
    q,
    _rep(k, g),
    _rep(v, g),
    _rep(field, g),
    _rep(level, g),
    _rep(ck, g),
    _rep(cv, g),
    _rep(clev, g),
    _rep(cmin, g),
    _rep(valid, g),
  )
  for blk in (None, 3):  # one block of all slots; blocks of 3 (padded to 9)
    got = ops.prefix_attention(*(jnp.asarray(x) for x in (q, k, v, field, level)), cached, block_size=blk)
    assert_close(np.asarray(got), want, n=s + t)


@jax.jit
def _split_prefix(q, k, v, field, level, p):
  """The rows from p on of a [B, T] sequence, as a chunk after a cache holding its first p keys.
  Fixed shapes for every p: T slots (valid below p), the chunk rolled to the front and padded."""
  t = q.shape[1]
  before = jnp.arange(t) < p  # [T]
  f = jnp.where(before[None, :, None], field, jnp.inf)  # the cached part's field, +inf after p
  cached = ops.CachedKeys(k, v, level, fp.suffix_min(f, axis=1), jnp.broadcast_to(before[None, :, None], level.shape))
  roll = lambda x: jnp.roll(x, -p, axis=1)
  return ops.prefix_attention(roll(q), roll(k), roll(v), roll(field), roll(level), cached)


def test_a_sequence_split_at_every_point_equals_whole_attention():
  q, k, v, field, level = _seq(2)
  t = q.shape[1]
  g = q.shape[2] // k.shape[2]
  whole = ref.fpa_attention_np(q, _rep(k, g), _rep(v, g), _rep(field, g), _rep(level, g))
  for p in range(t):  # p = 0: an empty cache, the plain attention of the chunk
    got = np.asarray(_split_prefix(q, k, v, field, level, p))[:, : t - p]
    assert_close(got, whole[:, p:], n=t, err_msg=f"split at {p}")


def test_fox_prefix_equals_fox_on_the_whole_sequence():
  rng = np.random.default_rng(3)
  q, k, v, _, _ = _seq(3)
  lf = np.asarray(jax.nn.log_sigmoid(rng.normal(size=k.shape[:3]) + 1.0), F32)
  g = q.shape[2] // k.shape[2]
  whole = ref.fox_attention_np(q, _rep(k, g), _rep(v, g), _rep(lf, g))
  c = np.cumsum(lf.astype(np.float64), 1).astype(F32)
  for p in (1, 4, 9):
    cached = ops.CachedKeys(
      jnp.asarray(k[:, :p]),
      jnp.asarray(v[:, :p]),
      jnp.asarray(c[:, :p]),
      jnp.zeros(c[:, :p].shape),
      jnp.ones(c[:, :p].shape, bool),
    )
    got = ops.fox_prefix_attention(q[:, p:], k[:, p:], v[:, p:], lf[:, p:], cached, jnp.asarray(c[:, p - 1]))
    assert_close(np.asarray(got), whole[:, p:], n=q.shape[1], err_msg=f"split at {p}")


def test_prefix_non_finite_values():
  q, k, v, field, level = _seq(4, b=1, t=6)
  s = 3
  cached = ops.CachedKeys(
    jnp.asarray(k[:, :s]),
    jnp.asarray(v[:, :s]),
    jnp.zeros((1, s, 2)),
    jnp.full((1, s, 2), np.inf),
    jnp.ones((1, s, 2), bool),
  )
  bad = cached._replace(level=cached.level.at[0, 1, 1].set(np.nan))
  with pytest.raises(
    ValueError, match=r"cached.level has 1 entry that is not allowed \(1 NaN; the first at batch 0, slot 1"
  ):
    ops.prefix_attention(q, k, v, field, level, bad)
  with pytest.raises(ValueError, match="field has 1 entry"):
    ops.prefix_attention(q, k, v, _nan_at(field, (0, 2, 0)), level, cached)
  run = jax.jit(ops.prefix_attention)
  out = np.asarray(run(q, k, v, _nan_at(field, (0, 2, 0)), level, cached))  # chunk rows 2.. of kv head 0
  assert np.isnan(out[0, 2:, :2]).all() and not np.isnan(out[0, :2]).any() and not np.isnan(out[0, :, 2:]).any()
  out = np.asarray(run(q, k, v, field, level, bad))  # NaN cached state: every row of kv head 1
  assert np.isnan(out[0, :, 2:]).all() and not np.isnan(out[0, :, :2]).any()


def _nan_at(x, idx):
  x = np.array(x)
  x[idx] = np.nan
  return x


# ----------------------------------------------------------------------------- a layer's cache


@functools.partial(jax.jit, static_argnames=("policy",))
def _chunk(cache, q, k, v, field, level, lengths, offsets, *, policy):
  return K.prefill_chunk(
    cache, q, k, v, field, level, field, policy=policy, scale=0.5, lengths=lengths, offsets=offsets
  )


def _chunks(cache, policy, arrays, splits):
  """Prefill `arrays` (q, k, v, field, level of the whole prompt) chunk by chunk: splits[b] is row b's
  chunk boundaries; each call is right-padded to the prompt length (one compiled program). Returns
  (the rows' outputs [B, T, H, K] in prompt order, the cache after each call)."""
  b, t = arrays[0].shape[:2]
  n_calls = max(len(s) for s in splits)
  bounds = [list(s) + [t] * (n_calls - len(s)) for s in splits]  # rows that are done: empty chunks
  out = np.zeros(arrays[0].shape, F32)
  caches = []
  for c in range(n_calls):
    starts = [0 if c == 0 else bounds[r][c - 1] for r in range(b)]
    ends = [bounds[r][c] for r in range(b)]
    take = lambda x: np.stack([np.roll(x[r], -starts[r], axis=0) for r in range(b)])
    lengths = jnp.asarray([e - s for s, e in zip(starts, ends)], jnp.int32)
    o, cache = _chunk(
      cache, *(jnp.asarray(take(x)) for x in arrays), lengths, jnp.asarray(starts, jnp.int32), policy=policy
    )
    for r in range(b):
      out[r, starts[r] : ends[r]] = np.asarray(o)[r, : ends[r] - starts[r]]
    caches.append(cache)
  return out, caches


def _state(cache, r, g):
  """{pos: (level, run_min, k)} of row r, kv head g's alive slots."""
  pos, alive = np.asarray(cache.pos)[r, :, g], np.asarray(cache.alive)[r, :, g]
  lvl, rmin = np.asarray(cache.level)[r, :, g], np.asarray(cache.run_min)[r, :, g]
  k = np.asarray(cache.k)[r, g]  # [S, K]: the cache's k is head-major
  return {int(p): (lvl[s], rmin[s], tuple(k[s])) for s, p in enumerate(pos) if alive[s]}


def test_prefill_chunk_full_equals_the_whole_prompt():
  q, k, v, field, level = _seq(5, t=9)
  arrays = (q, k, v, field, level)
  t, kvh = q.shape[1], k.shape[2]
  pol = make_policy("full", t)
  empty = K.init_layer_cache(2, t, kvh, q.shape[-1])
  whole_out, whole = K.prefill_attend(empty, *arrays, field, policy=pol, scale=0.5, lengths=jnp.full((2,), t))
  splits = [[[9], [1, 2, 3, 4, 5, 6, 7, 8, 9]], [[2, 5, 9], [4, 9]]]  # row 0 / row 1: different chunks
  splits += [[[p, 9], [9 - p, 9]] for p in range(1, 9)]  # a split at every position
  for sp in splits:
    out, caches = _chunks(empty, pol, arrays, sp)
    assert_close(out, np.asarray(whole_out), n=t, err_msg=str(sp))
    for r in range(2):
      for g in range(kvh):
        got, want = _state(caches[-1], r, g), _state(whole, r, g)
        assert got.keys() == want.keys() == set(range(t))
        for p in got:
          np.testing.assert_array_equal(got[p][0], want[p][0])  # levels: the same values
          np.testing.assert_array_equal(got[p][2], want[p][2])
          assert got[p][1] == want[p][1], (sp, r, g, p)  # running minima: a min, exact
    np.testing.assert_array_equal(np.asarray(caches[-1].carry), np.asarray(whole.carry))


def _simulate(policy, arrays, splits, scale, thr=None):
  """float64 loops: one row, one kv head (its G query heads), chunk by chunk under `policy`'s keep
  rule (`cache._keep_order`: kept first, then the protected last W positions, then the policy's
  preference, then newer). Returns (out [T, G, K], the alive positions after each chunk)."""
  q, k, v, field, level = (np.asarray(x, np.float64)[0, :, :] for x in arrays)  # [T, G | 1, ...]
  t = q.shape[0]
  keys, kept, out = [], [], np.zeros((t, q.shape[1], v.shape[-1]))
  start = 0
  for end in splits:
    for i in range(start, end):
      low_chunk = min(field[start : i + 1, 0])
      for hq in range(q.shape[1]):
        logits, vals = [], []
        for key in keys:
          low = min(key["m"], low_chunk)
          logits.append(scale * q[i, hq] @ k[key["j"], 0] - (key["l"] - low if key["l"] > low else 0.0))
          vals.append(v[key["j"], 0])
        for j in range(start, i + 1):
          low = min(field[j + 1 : i + 1, 0], default=math.inf)
          lv = level[j, 0]
          logits.append(scale * q[i, hq] @ k[j, 0] - (lv - low if lv > low else 0.0))
          vals.append(v[j, 0])
        w = np.exp(np.asarray(logits) - max(logits))
        out[i, hq] = (w / w.sum()) @ np.asarray(vals)
    for key in keys:
      key["m"] = min(key["m"], min(field[start:end, 0]))
    keys += [{"j": j, "l": level[j, 0], "m": min(field[j + 1 : end, 0], default=math.inf)} for j in range(start, end)]
    for key in keys:
      key["pen"] = key["l"] - key["m"] if key["l"] > key["m"] else 0.0
    keep = [key for key in keys if thr is None or key["pen"] < thr]

    def rank(key):
      if policy.name in ("full", "window"):
        primary = 0.0
      elif policy.name == "sink_window":
        primary = float(key["j"] < policy.n_sink)
      else:
        primary = -key["pen"]
      if policy.recent and key["j"] >= end - policy.recent:
        primary = math.inf
      return (primary, key["j"])

    keys = sorted(keep, key=rank, reverse=True)[: policy.capacity]
    kept.append({key["j"] for key in keys})
    start = end
  return out, kept


@pytest.mark.parametrize(
  "name,kw",
  [("fpa_budget", dict(budget=4, recent=1)), ("window", dict(budget=4)), ("fpa_threshold", dict(threshold=1.0))],
)
def test_prefill_chunk_with_eviction_equals_float64_loops(name, kw):
  q, k, v, field, level = _seq(6, b=1, t=12, h=2, kvh=1, d=2)
  field = (3.0 * field).astype(F32)  # deep dips: the penalties decide
  level = np.minimum(level, 50.0).astype(F32)  # finite (no +inf key in this rule check)
  level[level == -np.inf] = 0.0
  arrays = (q, k, v, field, level)
  pol = make_policy(name, 12, **kw)
  cache = K.init_layer_cache(1, pol.capacity, 1, 2, threshold=kw.get("threshold"))
  splits = [3, 4, 8, 12]
  out, caches = _chunks(cache, pol, arrays, [splits])
  want, kept = _simulate(pol, arrays, splits, 0.5, kw.get("threshold"))
  assert_close(out[0], want, n=12)
  for c, s in zip(caches, kept):
    assert set(_state(c, 0, 0)) == s
    assert len(s) <= pol.capacity
  assert len(kept[-1]) < 12, "nothing was evicted: the check would be vacuous"


def test_tolerance_policy_chunked_prefill_within_its_bound():
  """Evicted keys carry <= eps of every later query's attention, so each output component is
  within 2 eps max|v| of the full-cache output (`policies.tolerance_threshold`)."""
  rng = np.random.default_rng(7)
  t, eps, scale = 24, 1e-3, 0.5
  q, k, v = (rng.normal(size=(1, t, 1, 4)).astype(F32) for _ in range(3))
  q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # |scale q.k| <= U = scale
  field = np.cumsum(np.where(np.arange(t) % 6 < 3, 4.0, -6.0))[None, :, None].astype(F32)  # deep dips
  pol = make_policy("fpa", t, tolerance=eps)
  tau = float(tolerance_threshold(jnp.asarray(scale), t, eps))
  cache = K.init_layer_cache(1, t, 1, 4, threshold=tau)
  out, caches = _chunks(cache, pol, (q, k, v, field, field), [[5, 6, 13, 20, 24]])
  full = ref.fpa_attention_np(q, k, v, field, field, scale=scale)
  assert np.abs(out - full).max() <= 2 * eps * np.abs(v).max() + rtol(F32, t) * np.abs(v).max()
  assert 0 < len(_state(caches[-1], 0, 0)) < t, "nothing was evicted: the bound would be vacuous"
  assert not bool(np.asarray(caches[-1].overflow).any())


def test_policies_that_need_more_than_a_chunk_are_refused():
  for name, kw in (("h2o", dict(budget=4)), ("snapkv", dict(budget=4)), ("fpa_global", dict(budget=4))):
    with pytest.raises(ValueError, match=rf"policy '{name}' cannot prefill chunk by chunk"):
      K.check_chunk_policy(make_policy(name, 12, **kw))


# ----------------------------------------------------------------------------- the model


RANDOM_GATE = dict(step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)


@pytest.mark.parametrize("att", ["fpa", "fox"])
def test_extend_full_equals_parallel_logits(att):
  m = build_model(C.get_config("tiny", attention=att, **RANDOM_GATE), seed=0)
  tok = np.asarray(jax.random.randint(jax.random.key(1), (2, 11), 0, m.cfg.vocab_size))
  want = np.asarray(forward(m, jnp.asarray(tok)))
  n = m.cfg.d_model * m.cfg.n_layers
  E.TRACES["extend"] = 0
  for bounds in ([4, 8, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]):  # width-4 calls; size-1 chunks
    conv, got, start = None, [], 0
    for end in bounds:
      chunk = np.zeros((2, 4), np.int64)
      chunk[:, : end - start] = tok[:, start:end]
      kw = dict(max_len=11) if conv is None else {}
      lg, conv = E.extend(m, chunk, conv, lengths=[end - start] * 2, **kw)
      got.append(np.asarray(lg)[:, : end - start])
      start = end
    assert_close(np.concatenate(got, 1), want, n=n, err_msg=str(bounds))
    assert conv.seen.tolist() == [11, 11] and (conv.keys_held() == 11).all()
  assert E.TRACES["extend"] == 1  # one program for every call of one shape


def test_extend_one_chunk_equals_prefill_parallel_and_holds_the_budget():
  m = build_model(C.get_config("tiny", attention="fpa", **RANDOM_GATE), seed=0)
  tok = jax.random.randint(jax.random.key(2), (2, 16), 0, m.cfg.vocab_size)
  pol = make_policy("fpa_budget", 24, budget=6)
  logits, conv = E.extend(m, tok, max_len=24, policy="fpa_budget", budget=6)
  want_logits, want = D.prefill_parallel(m, tok, jnp.full((2,), 16), pol, 24)
  assert_close(np.asarray(logits), np.asarray(want_logits), n=m.cfg.d_model * m.cfg.n_layers)
  for c, w in zip(conv.caches, want):
    for r in range(2):
      for g in range(m.cfg.kv_heads):
        assert set(_state(c, r, g)) == set(_state(w, r, g))
  # more chunks: never more than the budget per (layer, row, kv head), the newest key always kept
  for i in range(3):
    _, conv = E.extend(m, tok[:, i : i + 2], conv)
    assert conv.keys_held().max() <= 6
    assert all(int(np.asarray(c.pos).max()) == conv.seen[0] - 1 for c in conv.caches)
  assert conv.nbytes() == D.cache_bytes(m, 2, pol, 24)


def test_extend_errors():
  m = build_model(C.get_config("tiny", attention="fpa"), seed=0)
  tok = np.zeros((1, 4), np.int64)
  with pytest.raises(ValueError, match="pass max_len=N"):
    E.extend(m, tok)
  with pytest.raises(ValueError, match="cannot prefill chunk by chunk"):
    E.extend(m, tok, max_len=8, policy="h2o", budget=4)
  _, conv = E.extend(m, tok, max_len=6)
  with pytest.raises(ValueError, match=r"drop \['budget', 'policy'\]"):
    E.extend(m, tok, conv, policy="fpa_budget", budget=4)
  with pytest.raises(ValueError, match="past the conversation's max_len=6"):
    E.extend(m, tok, conv)
  with pytest.raises(ValueError, match=r"lengths must be \[batch\]=1 ints in \[0, 4\]"):
    E.extend(m, tok, conv, lengths=[5])
