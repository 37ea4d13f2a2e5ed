"""Eviction policies: the protected recent window, SnapKV, the global budget (fpa_global),
the per-key tolerance bound, and their argument checks. Each policy against a numpy simulation."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tol import assert_close

from fpa_jax import configs as C
from flax import nnx

from fpa_jax.inference import cache as K
from fpa_jax.inference import decode as D
from fpa_jax.inference import pool as P
from fpa_jax.inference import FPAGlobal, cached_logits, generate, make_policy
from fpa_jax.inference.policies import default_recent
from fpa_jax.models import build_model

BRACKETS = "x(a(bc)d(e)f)y(g(h)i)"


def _depth(text, step=10.0):
  return np.cumsum([1 if c == "(" else -1 if c == ")" else 0 for c in text]).astype(np.float32) * step


def _alive(cache, b=0, h=0):
  return {int(p) for p, a in zip(np.asarray(cache.pos[b, :, h]), np.asarray(cache.alive[b, :, h])) if a}


def _pen_np(field, j, i):
  """Penalty of key j after query i (level = field): relu(f_j - min f over (j, i])."""
  return max(0.0, float(field[j]) - float(np.min(field[j + 1 : i + 1]))) if i > j else 0.0


_prefill = jax.jit(K.prefill_attend, static_argnames=("policy", "scale", "block_size"))


@pytest.fixture(scope="module")
def tiny():
  """One small fpa model with forgetful gates, shared by the model-level tests."""
  cfg = C.get_config(
    "tiny", attention="fpa", step_init_std=0.3, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3
  )
  return build_model(cfg, seed=0)


@pytest.fixture(scope="module")
def tiny_qk():
  """A QK-norm fpa model with large penalties and uneven QK-norm scales (the pairwise bound is then
  tighter than K max|s_q| max|s_k|)."""
  cfg = C.get_config(
    "tiny", attention="fpa", qk_norm=True, step_init_std=0.6, absolute_init_std=0.3, offset_init_std=0.1
  )
  m = build_model(cfg, seed=0)
  for blk in m.blocks:
    blk.attn.q_norm.scale[...] = jnp.linspace(0.5, 2.0, cfg.head_dim)
    blk.attn.k_norm.scale[...] = jnp.linspace(2.0, 0.5, cfg.head_dim)
  return m


# ------------------------------------------------------------------------------------------------ arguments


def test_arguments_checked_before_tracing(tiny):
  t = 64
  with pytest.raises(ValueError, match="unknown policy"):
    make_policy("snap", t, budget=8)
  with pytest.raises(ValueError, match="budget must be > 0"):
    make_policy("fpa_global", t, budget=0)
  with pytest.raises(ValueError, match="must be <= 1"):
    make_policy("snapkv", t, budget=1.5)
  with pytest.raises(ValueError, match="needs a budget"):
    make_policy("fpa_global", t)
  with pytest.raises(ValueError, match="recent < 8"):
    make_policy("fpa_budget", t, budget=8, recent=8)
  with pytest.raises(ValueError, match="recent < 8"):
    make_policy("fpa_global", t, budget=8, recent=12)
  with pytest.raises(ValueError, match="recent must be an int"):
    make_policy("fpa_budget", t, budget=8, recent=-1)
  with pytest.raises(ValueError, match="recent .* applies to"):
    make_policy("window", t, budget=8, recent=2)
  with pytest.raises(ValueError, match="head_cap >= budget"):
    make_policy("fpa_global", t, budget=8, head_cap=4)
  with pytest.raises(ValueError, match="head_cap must be > 0"):
    make_policy("fpa_global", t, budget=8, head_cap=0)
  with pytest.raises(ValueError, match="head_cap only applies"):
    make_policy("fpa_budget", t, budget=8, head_cap=16)
  with pytest.raises(ValueError, match="bound must be one of"):
    make_policy("fpa", t, tolerance=1e-3, bound="spectral")
  assert make_policy("fpa_budget", t, budget=0.5).recent == default_recent(32) == 4
  pol = make_policy("fpa_global", t, budget=0.25)  # no per-head limit: a head may fill the pool
  assert (pol.keys, pol.capacity, pol.head_cap, pol.recent) == (16, 64, None, 2)
  # 96 keys' bytes (16 x 3 layers x 2 kv heads, head dim 16, fp32) hold 89 pool slots with their tags and index
  assert pol.pool_slots(3, 2, 16, 4) == 89
  pol = make_policy("fpa_global", t, budget=0.25, head_cap=0.5)
  assert (pol.keys, pol.capacity, pol.head_cap) == (16, 32, 32)
  # through the entry points, before anything is traced
  tok = np.zeros((1, 8), np.int32)
  before = dict(D.TRACES)
  with pytest.raises(ValueError, match="use generate"):
    cached_logits(tiny, tok, policy="snapkv", budget=4)
  with pytest.raises(ValueError, match="prefill='parallel'"):
    generate(tiny, tok, 2, policy="snapkv", budget=4, prefill="decode")
  with pytest.raises(ValueError, match="recent < 4"):
    generate(tiny, tok, 2, policy="fpa_global", budget=4, recent=4)
  with pytest.raises(ValueError, match="head_cap >= budget"):
    generate(tiny, tok, 2, policy="fpa_global", budget=4, head_cap=3)
  with pytest.raises(ValueError, match="head_cap >= budget"):
    cached_logits(tiny, tok, policy="fpa_global", budget=4, head_cap=3)
  with pytest.raises(ValueError, match="one per \\(layer, kv head\\)"):
    generate(tiny, tok, 2, policy=FPAGlobal(budget=4, head_offset=(0.0,)))
  assert D.TRACES == before
  for bad in ((), (0.0, math.nan), (True, 0.0), "0,1"):
    with pytest.raises(ValueError, match="head_offset must be a non-empty sequence"):
      FPAGlobal(budget=4, head_offset=bad)
  assert FPAGlobal(budget=4, head_offset=[0, math.inf]).head_offset == (0.0, math.inf)  # hashable, as floats


# ------------------------------------------------------------------------------------------------ recent window


def _stream(policy, fields, q=None):
  """Decode a 1-row stream with H heads (field = level = fields[:, h]); alive positions per step and head."""
  t, h = fields.shape
  cache = K.init_layer_cache(1, policy.capacity, h, 1)
  step = jax.jit(functools.partial(K.decode_attend, policy=policy, scale=1.0))
  ones = jnp.ones((1, 1, h, 1))
  sets = []
  for i in range(t):
    f = jnp.asarray(fields[i], jnp.float32).reshape(1, 1, h)
    _, cache = step(cache, ones * 0.0, ones, ones * 0.0, f, f, f, positions=jnp.array([i]))
    sets.append([_alive(cache, h=j) for j in range(h)])
  return sets


def _simulate_budget(field, capacity, recent):
  """fpa_budget with a protected window: largest penalty among keys at <= i - W, ties oldest."""
  alive, sets = [], []
  for i in range(len(field)):
    if len(alive) >= capacity:
      cand = [j for j in alive if j <= i - recent] or alive
      alive.remove(min(cand, key=lambda j: (-_pen_np(field, j, i), j)))
    alive.append(i)
    sets.append(set(alive))
  return sets


@pytest.mark.parametrize("capacity,recent", [(4, 2), (6, 3), (6, 5)])
def test_fpa_budget_protects_the_last_w_keys(capacity, recent):
  field = _depth(BRACKETS)
  pol = make_policy("fpa_budget", len(field), budget=capacity, recent=recent)
  zero = np.zeros_like(field)
  got = _stream(pol, np.stack([field, zero], 1))
  want = _simulate_budget(field, capacity, recent)
  assert [g[0] for g in got] == want
  for i, s in enumerate(want):
    assert set(range(max(0, i - recent + 1), i + 1)) <= s  # the last W keys are always there
  # zero penalties (head 1): "largest penalty, ties oldest" is exactly a window of the last C keys
  assert [g[1] for g in got] == [set(range(max(0, i - capacity + 1), i + 1)) for i in range(len(field))]


def test_prefill_keeps_the_window_then_the_smallest_penalties():
  t, cap, w = 20, 8, 3
  field = _depth("x(a(bc)d(e)f)y(g(h)i"[:t])
  lengths = jnp.array([t, 13])
  pol = make_policy("fpa_budget", t + 4, budget=cap, recent=w)
  z = jnp.zeros((2, t, 1, 2))
  f = jnp.broadcast_to(jnp.asarray(field)[None, :, None], (2, t, 1))
  cache = K.init_layer_cache(2, cap, 1, 2)
  _, cache = _prefill(cache, z, z, z, f, f, f, policy=pol, scale=1.0, lengths=lengths)
  for b, n in enumerate([t, 13]):
    window = set(range(n - w, n))
    rest = sorted(range(n - w), key=lambda j: (_pen_np(field, j, n - 1), -j))[: cap - w]
    assert _alive(cache, b) == window | set(rest)


# ------------------------------------------------------------------------------------------------ snapkv


def _snapkv_np(q, k, field, level, n, scale, window=32, kernel=7):
  """float64 SnapKV scores [T, KVH] of one row of length n (q [T, H, D], k [T, KVH, D])."""
  t, h, _ = q.shape
  kvh = k.shape[1]
  g = h // kvh
  votes = np.zeros((h, t))
  for i in range(max(0, n - window), n):
    for hh in range(h):
      kv = hh // g
      pen = np.array([max(0.0, level[j, kv] - field[j + 1 : i + 1, kv].min()) if j < i else 0.0 for j in range(i + 1)])
      s = scale * k[: i + 1, kv] @ q[i, hh] - pen
      p = np.exp(s - s.max())
      votes[hh, : i + 1] += p / p.sum()
  r = kernel // 2
  pooled = np.stack([[votes[hh, max(0, j - r) : j + r + 1].max() for j in range(t)] for hh in range(h)])
  score = pooled.reshape(kvh, g, t).sum(1).T
  score[:n][np.arange(n) >= n - window] = np.inf
  score[n:] = 0.0
  return score


def test_snapkv_keeps_what_the_last_window_attends_to():
  """Query head 0 of the window looks at key 5, head 1 at key 20 (one kv head, a group of 2): the
  window's 32 keys and the 7-key neighbourhoods of both (max-pooling) are kept, nothing else."""
  t = 64
  k = np.zeros((1, t, 1, 2), np.float32)
  k[0, 5, 0] = [6.0, 0.0]
  k[0, 20, 0] = [0.0, 6.0]
  q = np.zeros((1, t, 2, 2), np.float32)
  q[0, :, 0] = [1.0, 0.0]
  q[0, :, 1] = [0.0, 1.0]
  z = jnp.zeros((1, t, 1))
  pol = make_policy("snapkv", t, budget=32 + 14)
  cache = K.init_layer_cache(1, pol.capacity, 1, 2)
  _, cache = _prefill(
    cache, jnp.asarray(q), jnp.asarray(k), jnp.asarray(k), z, z, z, policy=pol, scale=1.0, lengths=jnp.array([t])
  )
  assert _alive(cache) == set(range(32, 64)) | set(range(2, 9)) | set(range(17, 24))


def test_snapkv_matches_numpy_then_decodes_within_capacity():
  """Random q, k, penalties, grouped heads, per-row lengths (one shorter than the window)."""
  rng = np.random.default_rng(0)
  b, t, h, kvh, d = 2, 48, 4, 2, 4
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k = rng.normal(size=(b, t, kvh, d)).astype(np.float32)
  field = np.cumsum(rng.normal(size=(b, t, kvh)), 1).astype(np.float32)
  level = (field + rng.normal(size=(b, t, kvh))).astype(np.float32)
  lengths = [40, 23]
  scale = d**-0.5
  scores = jax.jit(functools.partial(K.snapkv_scores, scale=scale, window=32, kernel=7))
  got = scores(jnp.asarray(q), jnp.asarray(k), field, level, jnp.array(lengths))
  cap, w, n_new = 38, 3, 6
  pol = make_policy("snapkv", t + n_new, budget=cap, recent=w)
  cache = K.init_layer_cache(b, cap, kvh, d)
  _, cache = _prefill(
    cache, *map(jnp.asarray, (q, k, k, field, level, field)), policy=pol, scale=scale, lengths=jnp.array(lengths)
  )
  step = jax.jit(functools.partial(K.decode_attend, policy=pol, scale=scale))
  ref = [_snapkv_np(q[r], k[r], field[r], level[r], lengths[r], scale) for r in range(b)]
  states = []
  for r in range(b):
    g, s = np.asarray(got[r]), ref[r]
    np.testing.assert_array_equal(np.isinf(g), np.isinf(s))
    assert_close(g[np.isfinite(g)], s[np.isfinite(s)], n=t)
    # prefill: the best `cap` keys by score (ties: the newer), the window's included
    order = sorted(range(lengths[r]), key=lambda j, s=s: (-s[j, 0], -j))
    assert _alive(cache, r) == set(order[:cap])
    states.append({j: s[j, 0] for j in order[:cap]})
  for i in range(n_new):
    pos = jnp.array(lengths) + i
    x = jnp.asarray(rng.normal(size=(b, 1, kvh, d)), jnp.float32)
    fz = jnp.zeros((b, 1, kvh))
    _, cache = step(cache, jnp.zeros((b, 1, h, d)), x, x, fz, fz, fz, positions=pos)
    for r in range(b):
      now, held = lengths[r] + i, states[r]
      if len(held) >= cap:  # the lowest score outside the last W keys, ties oldest; new keys score 0
        cand = [j for j in held if j <= now - w] or list(held)
        del held[min(cand, key=lambda j: (held[j], j))]
      held[now] = 0.0
      assert _alive(cache, r) == set(held), (r, i)


# ------------------------------------------------------------------------------------------------ global budget


def _simulate_global(fields, keys, cap, recent, offset=None):
  """fields [T, L, H] -> alive sets [T][L][H] of fpa_global (numpy/Python, the docstring's rule);
  cap: the per-head limit (None: none); offset: `head_offset` (L * H numbers, None: zeros)."""
  t, n_l, h = fields.shape
  off = [0.0] * (n_l * h) if offset is None else list(offset)
  alive = {(l, j): [] for l in range(n_l) for j in range(h)}
  out = []
  for i in range(t):
    for (l, j), a in alive.items():  # per head: the cap, as fpa_budget with capacity `cap`
      f = fields[:, l, j]
      if cap is not None and len(a) >= cap:
        cand = [x for x in a if x <= i - recent] or a
        a.remove(min(cand, key=lambda x, f=f: (-_pen_np(f, x, i), x)))
      a.append(i)
    excess = sum(map(len, alive.values())) - (keys - 1) * n_l * h
    cand = [
      (-(_pen_np(fields[:, l, j], x, i) + off[l * h + j]), x, l * h + j, (l, j))
      for (l, j), a in alive.items()
      for x in a
      if x <= i + 1 - recent
    ]
    for _, x, _, lj in sorted(cand)[: max(excess, 0)]:
      alive[lj].remove(x)
    out.append([[set(alive[(l, j)]) for j in range(h)] for l in range(n_l)])
  return out


def _global_fields(t):
  """[T, L=2, H=2] integer fields (exact in fp32): a forgetful head, a head that never forgets
  (zero penalties: ties across heads), two bracket walks."""
  return np.stack(
    [
      np.stack([_depth(BRACKETS[:t]), np.zeros(t, np.float32)], 1),
      np.stack([_depth(BRACKETS[::-1][:t], 3.0), _depth("((a)(b(c)))(d)(e)f(g)"[:t], 7.0)], 1),
    ],
    1,
  )


def _pool_sets(cache, b=0):
  """[L][KVH] positions each (layer, kv head) holds in row b of a `pool.GlobalCache`."""
  pool, kvh = cache.pool, cache.kv_heads
  pos, alive, owner = (np.asarray(x[b]) for x in (pool.pos, pool.alive, pool.owner))
  assert np.all((owner >= 0) == alive)
  return [[set(pos[alive & (owner == l * kvh + j)].tolist()) for j in range(kvh)] for l in range(cache.n_layers)]


_OFFSET = (0.0, math.inf, 1.5, 0.0)  # layer 0 head 1 streams (its window only); layer 1 head 0 pays 1.5 nats


@pytest.mark.parametrize(
  "keys,cap,recent,impl,offset",
  [
    (3, 6, 1, "packed", None),
    (3, 6, 1, "masked", None),
    pytest.param(4, 8, 2, "packed", None, marks=pytest.mark.slow),
    pytest.param(4, 8, 2, "masked", None, marks=pytest.mark.slow),
    pytest.param(3, 3, 0, "packed", None, marks=pytest.mark.slow),
    pytest.param(3, 3, 0, "masked", None, marks=pytest.mark.slow),
    pytest.param(3, None, 1, "packed", None, marks=pytest.mark.slow),
    pytest.param(3, None, 1, "masked", None, marks=pytest.mark.slow),
    pytest.param(4, None, 2, "packed", None, marks=pytest.mark.slow),  # the same with a head_offset is fast
    pytest.param(4, None, 2, "masked", None, marks=pytest.mark.slow),
    (4, None, 2, "packed", _OFFSET),
    pytest.param(4, None, 2, "masked", _OFFSET, marks=pytest.mark.slow),
  ],
)
def test_global_budget_matches_numpy(keys, cap, recent, impl, offset):
  """2 layers x 2 heads, decoded token by token: the shared pool (exactly G slots per row; "packed"
  repacked every 4 steps by `pool_evict`) and the per-head measuring layout (`global_evict`, what
  cached_logits uses) both hold numpy's sets, with and without a `head_offset`."""

  fields = _global_fields(len(BRACKETS))
  t, n_l, h = fields.shape
  pol = make_policy("fpa_global", t, budget=keys, head_cap=cap, recent=recent)
  pol = dataclasses.replace(pol, pool_impl=impl, repack_every=4, head_offset=offset)
  g = keys * n_l * h  # a pool sized by hand: the rule holds G - L * KVH = (keys - 1) * L * KVH keys
  pool = P.prepare(P.init_global_cache(1, g, n_l, h, 1), pol)
  caches = tuple(K.init_layer_cache(1, t, h, 1) for _ in range(n_l))  # measuring: one slot per token
  ones = jnp.ones((1, 1, h, 1))

  @jax.jit
  def step(pool, caches, f, i):
    pos = jnp.reshape(i, (1,))
    run, new = pool.with_run(K.Decode(pol, pos)), []  # layer l's view holds the pool layer l - 1 left
    for layer, (c, fl) in enumerate(zip(caches, f)):
      fl = fl.reshape(1, 1, h)
      kw = dict(policy=pol, scale=1.0, positions=pos)
      run = run.update(layer, P.pool_decode_attend(run.layer(layer), ones * 0, ones, ones * 0, fl, fl, fl, **kw)[1])
      new.append(K.decode_attend(c, ones * 0, ones, ones * 0, fl, fl, fl, step=i, measure=True, **kw)[1])
    return P.pool_evict(run._replace(run=None), pol, pos), K.global_evict(new, pol, pos, g)

  want = _simulate_global(fields, keys, cap, recent, offset)
  if offset is not None:  # the streaming head holds its window alone (W - 1 keys between steps)
    assert want[-1][0][1] == set(range(t - recent + 1, t))
  for i in range(t):
    pool, caches = step(pool, caches, jnp.asarray(fields[i]), i)
    assert pool.pool.pos.shape == (1, g)
    assert _pool_sets(pool) == want[i], i
    assert [[_alive(c, h=j) for j in range(h)] for c in caches] == want[i], i
    assert sum(map(len, sum(want[i], []))) <= (keys - 1) * n_l * h


@pytest.mark.parametrize("keys,cap,recent,offset", [(3, None, 2, None), (4, 5, 1, None), (3, None, 2, _OFFSET)])
def test_global_parallel_prefill_matches_numpy(keys, cap, recent, offset):
  """Parallel prefill: every layer's prompt keys are candidates (per head at most the cap: its last
  W, then the smallest penalties, then the newest), then the global rule down to G - L*KVH keys,
  packed into the pool: the steps `decode.prefill_parallel` takes after the forward pass."""
  t = 20
  fields = _global_fields(t)
  n_l, h = fields.shape[1:]
  lengths = [t, 13]
  pol = make_policy("fpa_global", t + 4, budget=keys, head_cap=cap, recent=recent)
  pol = dataclasses.replace(pol, head_offset=offset)
  off = [0.0] * (n_l * h) if offset is None else offset
  g = keys * n_l * h  # sized by hand, as above
  z = jnp.zeros((2, t, h, 2))
  caches = []
  for l in range(n_l):
    f = jnp.broadcast_to(jnp.asarray(fields[:, l])[None], (2, t, h))
    c = K.init_layer_cache(2, min(pol.capacity, t), h, 2)
    caches.append(_prefill(c, z, z, z, f, f, f, policy=pol, scale=1.0, lengths=jnp.array(lengths))[1])
  cache = jax.jit(lambda cs: P.pool_from_caches(K.global_evict(cs, pol, jnp.array(lengths) - 1, g), g))(caches)
  assert cache.pool.pos.shape == (2, g)
  for b, n in enumerate(lengths):
    per_head = {}
    for l in range(n_l):
      for j in range(h):
        f = fields[:, l, j]
        order = sorted(range(n), key=lambda x, f=f: (x < n - recent, _pen_np(f, x, n - 1), -x))
        per_head[(l, j)] = set(order[: cap or n])
    excess = sum(map(len, per_head.values())) - (keys - 1) * n_l * h
    cand = sorted(
      (-(_pen_np(fields[:, l, j], x, n - 1) + off[l * h + j]), x, l * h + j, (l, j))
      for (l, j), a in per_head.items()
      for x in a
      if x <= n - recent
    )
    for _, x, _, lj in cand[: max(excess, 0)]:
      per_head[lj].remove(x)
    assert _pool_sets(cache, b) == [[per_head[(l, j)] for j in range(h)] for l in range(n_l)], b
    assert sum(map(len, per_head.values())) <= (keys - 1) * n_l * h


def _membership(caches, n):
  """[B, L, KVH, n] bool: position p is held by (layer, kv head), in either layout."""
  if isinstance(caches, P.GlobalCache):
    pool, n_l, kvh = caches.pool, caches.n_layers, caches.kv_heads
    tags = jnp.arange(n_l * kvh)
    own = pool.alive[..., None] & (pool.owner[..., None] == tags)  # [B, G, L*KVH]
    at = pool.pos[..., None] == jnp.arange(n)  # [B, G, n]
    m = jnp.einsum("bgh,bgp->bhp", own.astype(jnp.int32), at.astype(jnp.int32)) > 0
    return m.reshape(m.shape[0], n_l, kvh, n)
  return jnp.stack([jnp.any(c.alive[..., None] & (c.pos[..., None] == jnp.arange(n)), axis=1) for c in caches], 1)


@pytest.mark.xla_default
def test_pool_attends_like_the_measuring_layout(tiny):
  """The tiny model decoded token by token through both layouts of fpa_global in one program: at
  every step each (layer, kv head) holds the same keys in the pool (G slots per row) as in
  cached_logits' one-slot-per-token caches, and the logits agree."""
  b, t = 2, 16
  tok = jax.random.randint(jax.random.key(7), (b, t), 0, tiny.cfg.vocab_size)
  pol = make_policy("fpa_global", t, budget=4)
  graphdef, state = nnx.split(tiny)

  @jax.jit
  def run(state, tok):
    m = nnx.merge(graphdef, state)
    dec = D.Decoder(m, pol, max_len=t)

    def body(carry, xs):
      pool, per = carry
      x, i = xs
      pos = jnp.full((b,), i, jnp.int32)
      lp, pool = dec.step(pool, x, pos)
      lm, per = dec.step(per, x, pos, slot=i, measure=True)
      return (pool, per), (lp, lm, _membership(pool, t), _membership(per, t))

    init = (D.init_caches(m, b, pol, t), D.init_caches(m, b, pol, t, slots=t))
    return jax.lax.scan(body, init, (tok.T, jnp.arange(t)))[1]

  lp, lm, mp, mm = run(state, tok)
  np.testing.assert_array_equal(np.asarray(mp), np.asarray(mm))
  held = np.asarray(mp).sum((2, 3, 4))  # [T, B] keys held per row after each step
  assert held.max() <= (4 - 1) * tiny.cfg.n_layers * tiny.cfg.kv_heads
  assert not np.all(np.asarray(mp).sum(-1) == np.asarray(mp).sum(-1)[..., :1, :1])  # heads share unevenly
  assert_close(np.asarray(lp), np.asarray(lm), n=t * tiny.cfg.d_model * tiny.cfg.n_layers)


@pytest.mark.xla_default
@pytest.mark.parametrize("head_cap", [None, pytest.param(9, marks=pytest.mark.slow)])
def test_global_budget_generates_like_its_measured_cache(tiny, head_cap):
  """generate's shared pool (slots reused) attends exactly like cached_logits' measured cache when
  the prompt is fed token by token (same greedy tokens); one compiled program per generation; the
  pool holds the G slots whose bytes, owner tags and index included, fit in fpa_budget's at the
  same budget (`FPAGlobal.pool_slots`). The parallel prefill keeps at most G - L * KVH keys too."""
  prompt = np.asarray(jax.random.randint(jax.random.key(4), (2, 12), 0, tiny.cfg.vocab_size))
  kw = dict(policy="fpa_global", budget=5, head_cap=head_cap)
  n_l, kvh = tiny.cfg.n_layers, tiny.cfg.kv_heads
  before = D.TRACES["generate"]
  out, stats = generate(tiny, prompt, 8, prefill="decode", **kw)
  assert D.TRACES["generate"] == before + 1
  seq = np.concatenate([prompt, out], axis=1)
  logits, cstats = cached_logits(tiny, seq, **kw)
  np.testing.assert_array_equal(np.argmax(np.asarray(logits[:, 11:-1]), -1), out)
  kept = np.asarray(stats["kept_fraction_per_head"])
  assert kept.shape == (n_l, kvh)
  # (keys - 1) per head on average between steps; the heads share it unevenly
  assert np.mean(kept) * 19 <= 4 + 1e-6 and np.max(kept) * 19 <= (head_cap or 20)
  pol = make_policy("fpa_global", 20, budget=5, head_cap=head_cap)
  g = pol.pool_slots(n_l, kvh, tiny.cfg.head_dim, 4)  # the budget's 5 keys per head, tags and index inside
  assert stats["slots_per_row"] == g < 5 * n_l * kvh
  shapes = jax.eval_shape(lambda: D.init_caches(tiny, 2, pol, 20))
  assert isinstance(shapes, P.GlobalCache) and shapes.pool.k.shape == (2, g, tiny.cfg.head_dim)
  ref = D.cache_bytes(tiny, 2, make_policy("fpa_budget", 20, budget=5))
  assert 0.9 * ref <= stats["cache_bytes"] == cstats["cache_bytes"] <= ref


@pytest.mark.slow  # the pool's bytes: ..._measured_cache
def test_global_budget_parallel_prefill_holds_its_pool(tiny):
  """The parallel prefill keeps at most G - L * KVH keys and allocates the decode's pool."""
  prompt = np.asarray(jax.random.randint(jax.random.key(4), (2, 12), 0, tiny.cfg.vocab_size))
  n_l, kvh = tiny.cfg.n_layers, tiny.cfg.kv_heads
  _, pstats = generate(tiny, prompt, 8, prefill="parallel", policy="fpa_global", budget=5)
  assert pstats["cache_bytes"] == D.cache_bytes(tiny, 2, make_policy("fpa_global", 20, budget=5))
  assert not pstats["overflow"] and pstats["cache_fraction"] <= 5 * n_l * kvh / 20


# ------------------------------------------------------------------------------------------------ tolerance bound


def test_query_and_key_norm_bounds_hold_on_random_inputs(tiny, tiny_qk):
  """||q|| <= Q (layer_query_bounds) and the pairwise QK-norm U hold, with and without QK-norm."""
  x = jax.random.normal(jax.random.key(0), (2, 48, 32)) * jnp.exp(jax.random.normal(jax.random.key(1), (2, 48, 1)))
  pos = jnp.broadcast_to(jnp.arange(48), (2, 48))
  for qk_norm, m in ((False, tiny), (True, tiny_qk)):
    blk = m.blocks[0]
    q, k, _ = blk.attn.project(blk.attn_norm(x), pos)
    qn = np.asarray(jnp.linalg.norm(q, axis=-1)).max((0, 1))  # [H]
    qb = np.asarray(D.layer_query_bounds(m)[0])
    assert np.all(qn.reshape(m.cfg.kv_heads, -1).max(-1) <= qb * (1 + 1e-5))
    u = np.asarray(D.layer_logit_bounds(m)[0])
    s = np.abs(np.asarray(jnp.einsum("bthk,bshk->bhts", q, k))).max((0, 2, 3)) * m.cfg.head_dim**-0.5
    assert np.all(s <= u * (1 + 1e-5))
    if qk_norm:
      assert u[0] < m.cfg.head_dim**0.5 * 4.0  # K * scale * max|s_q| max|s_k| = sqrt(K) * 4


def test_key_bound_evicts_more_and_loses_at_most_eps(tiny_qk):
  """The per-key bound on a QK-norm model with forgetful gates: lost mass <= eps, measured, and it
  keeps fewer keys than the parameter bound (both sound)."""
  m = tiny_qk
  tok = jax.random.randint(jax.random.key(3), (2, 48), 0, m.cfg.vocab_size)
  eps = 1e-3
  _, keys = cached_logits(m, tok, policy="fpa", tolerance=eps)
  _, params = cached_logits(m, tok, policy="fpa", tolerance=eps, bound="params")
  assert keys["lost_mass_max"] <= eps and params["lost_mass_max"] <= eps, (keys, params)
  assert not keys["overflow"]
  assert keys["kept_fraction_mean"] <= params["kept_fraction_mean"]
  assert keys["kept_fraction_mean"] < 1.0, keys


def test_evict_few_is_evict_largest():
  """pool_evict's top-k eviction (at most L * KVH keys a step) picks exactly fp.evict_largest's keys:
  many exact penalty and position ties or none, (position, owner) unique as in a pool, counts from
  none to more than the rows' candidates; more than `most` takes the sort."""
  from fpa_jax.ops import first_passage as fp

  rng = np.random.default_rng(0)
  for trial in range(20):
    b, n, most = 3, 96, 8
    u = np.stack([rng.permutation(40 * 6)[:n] for _ in range(b)])  # unique (pos, owner) per row
    ties = trial % 2  # odd trials: exact ties; even: distinct penalties (the penalty pass alone decides)
    pen = jnp.asarray((rng.integers(0, 3, (b, n)) if ties else rng.random((b, n))) * rng.random((b, 1)), jnp.float32)
    pos, owner = jnp.asarray(u // 6, jnp.int32), jnp.asarray(u % 6, jnp.int32)
    cand = jnp.asarray(rng.random((b, n)) < rng.choice([0.05, 0.5, 1.0]))
    count = jnp.asarray(rng.integers(0, most + 1, b) if trial % 5 else [most + 3, 0, n], jnp.int32)
    want = fp.evict_largest(pen, pos, owner, cand, count)
    np.testing.assert_array_equal(np.asarray(P.evict_few(pen, pos, owner, cand, count, most)), np.asarray(want))


@pytest.mark.xla_default
@pytest.mark.parametrize("head_cap", [None, pytest.param(10, marks=pytest.mark.slow)])
def test_pool_impls_agree(tiny, head_cap):
  """The tiny model decoded token by token through fpa_global's pool with each implementation in
  one program: "masked" (the default: top-k eviction), "gather" (each head over its own slots) and
  "packed" (repacked by owner every 1, 3 and 7 steps: steps on both sides of a repack) hold exactly
  the keys of "reference" (the whole pool masked, one sort per eviction) at every step, and their
  logits agree (the first repack sees the empty pool: every head holds no key)."""

  b, t = 2, 24
  tok = jax.random.randint(jax.random.key(3), (b, t), 0, tiny.cfg.vocab_size)
  base = make_policy("fpa_global", t, budget=6, head_cap=head_cap, recent=0)  # "packed": widths 12, 24
  pols = [dataclasses.replace(base, pool_impl=i) for i in ("reference", "masked", "gather")]
  pols += [dataclasses.replace(base, pool_impl="packed", repack_every=n) for n in (1, 3, 7)]
  graphdef, state = nnx.split(tiny)

  @jax.jit
  def run(state, tok):
    decs = [D.Decoder(nnx.merge(graphdef, state), p, max_len=t) for p in pols]

    def body(caches, xs):
      x, i = xs
      pos = jnp.full((b,), i, jnp.int32)
      out = [dec.step(c, x, pos) for c, dec in zip(caches, decs)]
      return tuple(c for _, c in out), tuple((lg, _membership(c, t)) for lg, c in out)

    init = tuple(dec.init(b) for dec in decs)
    return jax.lax.scan(body, init, (tok.T, jnp.arange(t)))[1]

  (l_ref, m_ref), *rest = run(state, tok)
  assert np.asarray(m_ref).sum((2, 3, 4)).max() <= 5 * tiny.cfg.n_layers * tiny.cfg.kv_heads
  for lg, mem in rest:
    np.testing.assert_array_equal(np.asarray(mem), np.asarray(m_ref))
    assert_close(np.asarray(lg), np.asarray(l_ref), n=t * tiny.cfg.d_model * tiny.cfg.n_layers)


@pytest.mark.parametrize(
  "head_cap,held,seed",
  [pytest.param(None, (30, 0, 14, 0), 0, marks=pytest.mark.slow), (None, (0, 20, 0, 24), 1), (20, (18, 0, 14, 0), 2)],
)
def test_packed_pool_attends_like_float64(head_cap, held, seed):
  """pool_impl "packed" on random pools (2 layers x 2 kv heads, 4 query heads, random keys, levels
  and fields), started from a pool built by hand (`held`: keys per owner, in shuffled slots; two
  heads hold none), repacked every 3 steps, read through windows of 11, 22 or 44 slots (20 with
  the cap) that overlap the neighbouring ranges: at every step and layer it holds the keys of
  "masked" and every query head's output is the float64 softmax over its head's keys (scale q.k -
  penalty)."""

  rng = np.random.default_rng(seed)
  b, n_l, kvh, h, dk, p0, t = 2, 2, 2, 4, 3, 32, 44
  base = make_policy("fpa_global", t, budget=12, head_cap=head_cap, recent=0)
  pols = [dataclasses.replace(base, pool_impl=i, repack_every=3) for i in ("masked", "packed")]
  g = 12 * n_l * kvh  # the budget's keys, sized by hand
  owner = np.full((b, g), -1)
  pos = np.full((b, g), -1)
  for r in range(b):
    slots, at = rng.permutation(g), 0
    for o, n in enumerate(held):
      owner[r, slots[at : at + n]], pos[r, slots[at : at + n]] = o, rng.permutation(p0)[:n]
      at += n
  empty = P.init_global_cache(b, g, n_l, kvh, dk)
  pool = empty.pool._replace(
    k=jnp.asarray(rng.normal(size=(b, g, dk)), jnp.float32),
    v=jnp.asarray(rng.normal(size=(b, g, dk)), jnp.float32),
    level=jnp.asarray(rng.normal(size=(b, g)) * 2, jnp.float32),
    run_min=jnp.asarray(np.where(owner >= 0, rng.normal(size=(b, g)) * 2, np.inf), jnp.float32),
    pos=jnp.asarray(pos, jnp.int32),
    alive=jnp.asarray(owner >= 0),
    owner=jnp.asarray(owner, jnp.int32),
  )
  caches = [P.prepare(empty._replace(pool=pool), pol) for pol in pols]
  assert (np.asarray(caches[1].index.count) == np.asarray(held)).all()

  @jax.jit
  def step(caches, xs, i):
    positions = jnp.full((b,), i, jnp.int32)
    outs, done = [], []
    for cache, pol in zip(caches, pols):
      run, per = cache.with_run(K.Decode(pol, positions)), []
      for layer in range(n_l):
        q, k, v, f = (x[layer] for x in xs)
        out, view = P.pool_decode_attend(run.layer(layer), q, k, v, f, f, f, policy=pol, scale=0.7, positions=positions)
        run = run.update(layer, view)
        per.append((out, view.pool))
      outs.append(per)
      done.append(P.pool_evict(run._replace(run=None), pol, positions))
    return done, outs

  for i in range(p0, t):
    xs = [
      jnp.asarray(rng.normal(size=(n_l, b, 1, h, dk)), jnp.float32),
      jnp.asarray(rng.normal(size=(n_l, b, 1, kvh, dk)), jnp.float32),
      jnp.asarray(rng.normal(size=(n_l, b, 1, kvh, dk)), jnp.float32),
      jnp.asarray(rng.normal(size=(n_l, b, 1, kvh)) * 2, jnp.float32),
    ]
    caches, outs = step(caches, xs, i)
    assert _pool_sets(caches[1], 0) == _pool_sets(caches[0], 0) and _pool_sets(caches[1], 1) == _pool_sets(caches[0], 1)
    for layer in range(n_l):
      (out_m, pm), (out_p, _) = outs[0][layer], outs[1][layer]
      q = np.asarray(xs[0][layer][:, 0], np.float64)  # [B, H, K]
      k, v = np.asarray(pm.k, np.float64), np.asarray(pm.v, np.float64)
      lv, rm = np.asarray(pm.level, np.float64), np.asarray(pm.run_min, np.float64)
      pen = np.where(np.isinf(rm), 0.0, np.maximum(lv - rm, 0.0))
      want = np.zeros((b, h, dk))
      for r in range(b):
        for hh in range(h):
          mine = np.asarray(pm.alive[r]) & (np.asarray(pm.owner[r]) == layer * kvh + hh // (h // kvh))
          s = 0.7 * k[r, mine] @ q[r, hh] - pen[r, mine]
          w = np.exp(s - s.max())
          want[r, hh] = (w / w.sum()) @ v[r, mine]
      for out in (out_m, out_p):
        assert_close(np.asarray(out[:, 0]), want, n=g * dk, err_msg=f"step {i} layer {layer}")


def test_pool_impl_checked():
  """Policy names fpa_global's implementations and their repack interval before anything is traced."""

  pol = make_policy("fpa_global", 64, budget=8)
  assert pol.pool_impl == "packed" and pol.pack_steps == 8  # at most the mean budget
  with pytest.raises(ValueError, match="pool_impl must be one of"):
    dataclasses.replace(pol, pool_impl="paged")
  with pytest.raises(ValueError, match="repack_every must be an int >= 1"):
    dataclasses.replace(pol, repack_every=0)
