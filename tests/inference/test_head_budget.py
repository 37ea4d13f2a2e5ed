"""The head budget (`fpa_heads`, `inference.head_budget`): a capacity of its own per (layer, kv head),
fixed before decoding. Its rule against a numpy loop (keys kept and attention, decode and prefill),
fpa_budget at a uniform split, one head given everything, the calibration from fpa_global, the
split saved with the model, bad inputs; and `budget=1.0` keeping every key in every policy."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tol import assert_close
from flax import nnx

from fpa_jax import configs as C
from fpa_jax.inference import cache as K
from fpa_jax.inference import decode as D
from fpa_jax.inference import (
  CachePolicy,
  Decoder,
  FPABudget,
  FPAGlobal,
  FPAHeads,
  cached_logits,
  export_model,
  extend,
  generate,
  make_policy,
)
from fpa_jax.inference.head_budget import (
  SPLIT_FILE,
  calibrate_head_split,
  load_head_split,
  normalise_split,
  save_head_split,
)
from fpa_jax.inference.policies import BUDGETED, SCORE, add_policy_args, policy_from_args, split_capacities
from fpa_jax.layers import GateTerms
from fpa_jax.models import build_model


@pytest.fixture(scope="module")
def tiny():
  """2 layers x 2 kv heads, head dim 16, forgetful gates (as test_policies.py's)."""
  cfg = C.get_config(
    "tiny", attention="fpa", step_init_std=0.3, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3
  )
  return build_model(cfg, seed=0), cfg


def _alive(cache, b=0, h=0):
  return {int(p) for p, a in zip(np.asarray(cache.pos[b, :, h]), np.asarray(cache.alive[b, :, h])) if a}


def _pen_np(field, j, i):
  """Penalty of key j at query i (level = field): relu(f_j - min f over (j, i])."""
  return max(0.0, float(field[j]) - float(np.min(field[j + 1 : i + 1]))) if i > j else 0.0


# ------------------------------------------------------------------------------------------------ the rule


def _heads_np(q, k, v, field, caps, recent, scale):
  """float64 loop of fpa_heads on one row: q [T, H, D], k, v [T, KVH, D], field = level [T, KVH].
  Per kv head j: before key i is written, a head holding caps[j] keys evicts its largest penalty
  among those at positions <= i - W_j (every held key where none is), ties the oldest, W_j =
  min(recent, caps[j] - 1); then each query head attends its kv head's keys with logits
  scale q.k - penalty. -> (out [T, H, D], kept [T][KVH] sets of positions)."""
  t, h, d = q.shape
  kvh = k.shape[1]
  alive = [[] for _ in range(kvh)]
  out, kept = np.zeros((t, h, d)), []
  for i in range(t):
    for j in range(kvh):
      a, f, w = alive[j], field[:, j], min(recent, caps[j] - 1)
      if len(a) >= caps[j]:
        cand = [x for x in a if x <= i - w] or a
        a.remove(min(cand, key=lambda x, f=f: (-_pen_np(f, x, i), x)))
      a.append(i)
    for hh in range(h):
      j = hh // (h // kvh)
      keys = sorted(alive[j])
      s = np.array([scale * q[i, hh] @ k[x, j] - _pen_np(field[:, j], x, i) for x in keys])
      p = np.exp(s - s.max())
      out[i, hh] = (p / p.sum()) @ v[keys, j]
    kept.append([set(a) for a in alive])
  return out, kept


def _walks(t, kvh, rng):
  """[T, KVH] integer bracket-like walks (exact in fp32: ties by penalty are real ties)."""
  return np.cumsum(rng.choice([-10.0, 0.0, 10.0], size=(t, kvh)), 0).astype(np.float32)


def _layer_rule(caps, recent, t):
  """A one-layer FPAHeads for t keys whose kv heads hold `caps` keys (split caps / t, budget their
  mean rounded up)."""
  pol = FPAHeads(budget=-(-sum(caps) // len(caps)), recent=recent, split=[[c / t for c in caps]]).resolve(t)
  assert pol.head_keys == (tuple(caps),) and pol.head_slots(0) == tuple(caps)
  return pol


class _Spec:
  """The layer's spec as a layer's cached call reads it: its logit scale; a prefill's own output (unused here)."""

  def __init__(self, scale):
    self.scale = scale

  def parallel(self, q, k, v, gates):
    return jnp.zeros_like(q)


def _layer_call(run, spec):
  """One layer's cached call on its `HeadCaches`, as the layer makes it: (state, q, k, v, field,
  positions [B]) -> (out, state); run(positions) the call's `Decode` or `Prefill`; field = level = cum."""

  def call(state, q, k, v, f, pos):
    out, view = K.layer_view(state, run(pos), 0).attend(spec, q, k, v, GateTerms(f, f, f, jnp.zeros_like(f)))
    return out, view.state

  return call


@pytest.mark.parametrize("caps,recent", [((3, 7, 1, 5), 2), ((4, 4, 9, 2), 3)])
def test_decode_matches_numpy(caps, recent):
  """4 kv heads of different capacities, grouped query heads, decoded token by token: each head
  holds numpy's keys, its attention output is numpy's, and its keys stay in its slots [0, C_h)."""
  rng = np.random.default_rng(sum(caps))
  t, kvh, h, d = 24, len(caps), 8, 4
  field = _walks(t, kvh, rng)
  q = rng.normal(size=(t, h, d)).astype(np.float32)
  k = rng.normal(size=(t, kvh, d)).astype(np.float32)
  v = rng.normal(size=(t, kvh, d)).astype(np.float32)
  pol = _layer_rule(caps, recent, t)
  rules = [pol.for_head(0, j) for j in range(kvh)]  # each head: fpa_budget at its own capacity
  assert [(r.capacity, r.recent) for r in rules] == [(c, min(recent, c - 1)) for c in caps]
  state = K.init_layer_state(pol, 0, 1, None, kvh, d)
  assert isinstance(state, K.HeadCaches) and [c.pos.shape for c in state.heads] == [(1, c, 1) for c in caps]
  want_out, want_kept = _heads_np(q, k, v, field, caps, recent, d**-0.5)
  step = jax.jit(_layer_call(lambda pos: K.Decode(pol, pos), _Spec(d**-0.5)))
  for i in range(t):
    f = jnp.asarray(field[i]).reshape(1, 1, kvh)
    x = lambda a: jnp.asarray(a[i][None, None])  # noqa: E731
    out, state = step(state, x(q), x(k), x(v), f, jnp.array([i]))
    assert [_alive(c) for c in state.heads] == want_kept[i], i
    assert_close(np.asarray(out[0, 0]), want_out[i], n=t, scale=np.abs(v).max(), err_msg=str(i))


def test_prefill_keeps_each_heads_window_then_smallest_penalties():
  """A parallel prefill: head j keeps its last W_j prompt keys, then the smallest penalties (ties:
  the newer), C_j in all, in its own cache of C_j slots."""
  rng = np.random.default_rng(3)
  t, kvh, caps, recent = 20, 3, (2, 9, 5), 3
  lengths = [t, 13]
  field = _walks(t, kvh, rng)
  pol = _layer_rule(caps, recent, t + 4)
  f = jnp.broadcast_to(jnp.asarray(field)[None], (2, t, kvh))
  z = jnp.zeros((2, t, kvh, 2))
  call = jax.jit(_layer_call(lambda pos: K.Prefill(pol, pos), _Spec(1.0)))
  _, state = call(K.init_layer_state(pol, 0, 2, None, kvh, 2), z, z, z, f, jnp.array(lengths))
  for b, n in enumerate(lengths):
    for j, c in enumerate(caps):
      w = min(recent, c - 1)
      order = sorted(range(n), key=lambda x, j=j: (x < n - w, _pen_np(field[:, j], x, n - 1), -x))
      assert _alive(state.heads[j], b) == set(order[:c]), (b, j)


def test_split_capacities_round_within_the_budget():
  assert split_capacities(((0.25, 0.25), (0.25, 0.25)), 16, 64) == ((16, 16), (16, 16))
  assert split_capacities(((0.1, 0.1, 0.1),), 7, 64) == ((7, 7, 7),)  # 6.4 up to 7: within 3 x 7
  # an exact budget (10 keys a head): the rounding up goes back where it added most, ties the later head
  assert split_capacities(((0.101, 0.099),), 10, 100) == ((10, 10),)
  assert split_capacities(((0.105, 0.105, 0.09),), 10, 100) == ((11, 10, 9),)
  caps = split_capacities(((0.0, 0.5), (0.0, 0.5)), 16, 64)
  assert caps == ((1, 32), (1, 32))  # a head given nothing keeps its newest key
  split = normalise_split(np.random.default_rng(0).random((3, 4)), 0.3)
  caps = np.asarray(split_capacities(tuple(map(tuple, split)), 77, 256))
  assert caps.sum() <= 77 * 12 and np.all(np.abs(caps - split * 256) < 1 + 1e-9)


# ------------------------------------------------------------------------------------------------ the model


def test_uniform_split_is_fpa_budget_exactly(tiny):
  model, cfg = tiny
  tok = np.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 48)))
  uniform = FPAHeads(budget=0.25, split=np.full((cfg.n_layers, cfg.kv_heads), 0.25))
  want, ws = cached_logits(model, tok, policy=FPABudget(budget=0.25))
  got, gs = cached_logits(model, tok, policy=uniform)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert gs["kept_fraction_per_head"] == ws["kept_fraction_per_head"]
  for prefill in ("parallel", "decode"):
    a, sa = generate(model, tok[:, :30], 12, policy=uniform, prefill=prefill)
    b, sb = generate(model, tok[:, :30], 12, policy="fpa_budget", budget=0.25, prefill=prefill)
    np.testing.assert_array_equal(a, b)
    assert sa["cache_bytes"] == sb["cache_bytes"] and sa["capacity"] == sb["capacity"]
  assert make_policy("fpa_heads", 48, budget=0.25).head_keys is None  # no split: fpa_budget's rule
  assert make_policy("fpa_heads", 48, budget=0.25, split=[[0.25] * 2] * 2).head_keys is None  # even: the same
  even = make_policy("fpa_heads", 48, budget=0.25, split=[[0.125] * 2] * 2)  # an even split below the budget
  assert even.head_keys is None and (even.capacity, even.recent) == (6, 1)


def test_decoded_layout_attends_like_the_measuring_layout(tiny):
  """An uneven split: the reused-slot cache (each head over its own slots, in place) gives the
  logits of the measuring layout (every head over all slots, masked), and each head holds at most
  its capacity."""
  model, cfg = tiny
  t, p = 40, 24
  tok = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
  pol = FPAHeads(budget=0.25, split=[[0.05, 0.45], [0.3, 0.2]])
  want, _ = cached_logits(model, tok, policy=pol)
  dec = Decoder(model, pol, max_len=t)
  caps = np.asarray(dec.policy.head_keys)
  assert caps.tolist() == [[2, 18], [12, 8]] and dec.slots_per_row() == caps.sum() == 40  # the budget's keys
  state = dec.init(2)
  step = jax.jit(dec.step)
  for i in range(t):
    logits, state = step(state, tok[:, i], jnp.full((2,), i, jnp.int32))
    assert_close(np.asarray(logits), np.asarray(want[:, i]), n=t * cfg.d_model, err_msg=str(i))
    held = np.asarray(state.occupancy()[1])  # [L, B, KVH]
    assert np.all(held <= caps[:, None, :]) and np.all(held == np.minimum(caps[:, None, :], i + 1))
  plogits, pstate = dec.prefill(tok[:, :p])  # parallel: the layers' kernel per kv head, then each head's cut
  assert_close(np.asarray(plogits), np.asarray(model(tok[:, :p])), n=p * cfg.d_model)
  assert np.all(np.asarray(pstate.occupancy()[1]) == np.minimum(caps, p)[:, None, :])
  _, conv = extend(model, tok[:, :p], max_len=t, policy=pol)  # the prompt as one chunk: the prefill's cache
  held = lambda st: [[_alive(c, b) for c in layer.heads for b in range(2)] for layer in st]  # noqa: E731
  assert held(conv.caches) == held(pstate)
  _, conv = extend(model, tok[:, p:], conv)  # a second chunk: each head cut back to its own capacity
  assert np.all(conv.keys_held() == caps[:, None, :])


def test_one_head_given_everything_keeps_only_its_keys(tiny):
  model, cfg = tiny
  t = 32
  tok = np.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, t)))
  split = np.zeros((cfg.n_layers, cfg.kv_heads))
  split[1, 0] = 1.0  # the whole sequence, a quarter of the model's keys: budget 0.25
  dec = Decoder(model, FPAHeads(budget=0.25, split=split), max_len=t)
  assert dec.policy.head_keys == ((1, 1), (t, 1))
  _, state = dec.prefill(jnp.asarray(tok), mode="decode")
  want = np.ones((cfg.n_layers, cfg.kv_heads))  # the others: their newest key (the query's own) only
  want[1, 0] = t
  np.testing.assert_array_equal(np.asarray(state.occupancy()[1])[:, 0], want)
  assert set(np.asarray(state[1].heads[0].pos[0, :, 0]).tolist()) == set(range(t))
  assert [int(state[i].heads[j].pos[0, 0, 0]) for i, j in ((0, 0), (0, 1), (1, 1))] == [t - 1] * 3
  with pytest.raises(ValueError, match="more than budget=0.2"):
    FPAHeads(budget=0.2, split=split)


# ------------------------------------------------------------------------------------------------ calibration


def test_calibration_is_fpa_globals_split(tiny):
  model, cfg = tiny
  rows = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 64))
  split = calibrate_head_split(model, rows, 0.25, batch_size=2, show_progress=False)
  assert split.shape == (cfg.n_layers, cfg.kv_heads) and split.dtype == np.float64
  assert abs(split.mean() - 0.25) < 1e-12 and abs(split.sum() - 0.25 * split.size) < 1e-12
  assert np.all(split >= 0) and np.all(split <= 1)
  np.testing.assert_array_equal(split, calibrate_head_split(model, list(rows), 0.25, batch_size=2, show_progress=False))
  # what fpa_global's pool holds per head after each prompt's parallel prefill, scaled to the budget
  dec = Decoder(model, "fpa_global", max_len=64, budget=0.25)
  held = np.mean([np.asarray(dec.prefill(jnp.asarray(r[None]))[1].occupancy()[1], np.float64)[:, 0] for r in rows], 0)
  np.testing.assert_allclose(split, normalise_split(held, 0.25), rtol=1e-12)
  assert np.all(calibrate_head_split(model, rows[:1], 1.0, show_progress=False) == 1.0)  # budget 1: every key
  FPAHeads(budget=0.25, split=split).resolve(64)  # a calibrated split is a valid split


def test_normalise_split_caps_heads_at_their_whole_sequence():
  s = normalise_split([[1.0, 0.0], [9.0, 2.0]], 0.5)
  assert abs(s.mean() - 0.5) < 1e-12 and s[1, 0] == 1.0 and s[0, 1] == 0.0
  np.testing.assert_allclose(s[0, 0] / s[1, 1], 0.5)  # the rest in proportion
  np.testing.assert_array_equal(normalise_split(np.zeros((2, 3)), 0.125), np.full((2, 3), 0.125))


def test_split_saved_with_the_model(tiny, tmp_path):
  model, cfg = tiny
  folder = tmp_path / "exported"
  export_model(model, cfg, folder)
  split = normalise_split([[1.0, 3.0], [2.0, 0.5]], 0.25)
  path = save_head_split(folder, split, 0.25, meta={"prompts": 3})
  assert path == str(folder / SPLIT_FILE) and {p.name for p in folder.iterdir()} >= {"params.npz", SPLIT_FILE}
  got, budget = load_head_split(folder)
  np.testing.assert_array_equal(got, split)
  assert budget == 0.25 and json.loads((folder / SPLIT_FILE).read_text())["meta"] == {"prompts": 3}
  assert load_head_split(path)[1] == 0.25  # the file itself
  assert FPAHeads(budget=budget, split=got).resolve(64) == FPAHeads(budget=0.25, split=split).resolve(64)
  ap = argparse.ArgumentParser()
  add_policy_args(ap)
  a = ap.parse_args(["--policy", "fpa_heads", "--head-split", str(folder)])
  assert policy_from_args(a) == CachePolicy("fpa_heads", budget=0.25, split=split)
  with pytest.raises(FileNotFoundError, match="save_head_split"):
    load_head_split(tmp_path / "nowhere")


def test_bad_inputs_raise_before_tracing(tiny):
  model, cfg = tiny
  tok = np.zeros((1, 16), np.int32)
  for bad, msg in [
    ([0.25, 0.25], "must be \\[layers, kv heads\\]"),
    ([[0.25, float("nan")], [0.25, 0.25]], "NaN refused"),
    ([[0.25, -0.1], [0.25, 0.25]], "in \\[0, 1\\]"),
    ([[1.5, 0.0], [0.0, 0.0]], "in \\[0, 1\\]"),
    ([[0.5, 0.5], [0.25, 0.25]], "scale it to a mean of 0.25"),
    ([], "at least one head"),
  ]:
    with pytest.raises(ValueError, match=msg):
      FPAHeads(budget=0.25, split=bad)
  with pytest.raises(ValueError, match="split only applies to policy 'fpa_heads'"):
    CachePolicy("fpa_budget", budget=0.25, split=[[0.25]])
  with pytest.raises(ValueError, match="needs a budget"):
    FPAHeads(split=[[0.25]])
  with pytest.raises(ValueError, match="more than the budget's 4"):
    FPAHeads(budget=4, split=[[0.5, 0.5], [0.5, 0.5]]).resolve(16)  # an int budget: checked at the length
  before = dict(D.TRACES)
  for shape in ((3, 2), (2, 4)):
    with pytest.raises(ValueError, match="the model has 2 attention layers with \\[2, 2\\] kv heads"):
      generate(model, tok, 2, policy=FPAHeads(budget=0.25, split=np.full(shape, 0.25)))
  with pytest.raises(ValueError, match="the model has 2 attention layers"):
    cached_logits(model, tok, policy=FPAHeads(budget=0.25, split=np.full((1, 2), 0.25)))
  with pytest.raises(ValueError, match="recent < 4"):
    Decoder(model, FPAHeads(budget=4, recent=4, split=np.full((2, 2), 0.25)), max_len=16)
  assert D.TRACES == before
  with pytest.raises(ValueError, match="fractional budget"):
    calibrate_head_split(model, tok, 4, show_progress=False)
  with pytest.raises(ValueError, match="at least one non-empty prompt"):
    calibrate_head_split(model, [], 0.25, show_progress=False)
  with pytest.raises(ValueError, match="share must be finite"):
    normalise_split([[1.0, np.inf]], 0.25)


# ------------------------------------------------------------------------------------------------ budget=1.0


def _keep_rank(q, k, field, level, penalty, positions):
  return -penalty  # a policy of your own: fpa_budget's rule


def _budget_one(name: str, model):
  if name == SCORE:
    return CachePolicy(score=_keep_rank, budget=1.0)
  if name == "fpa_heads":
    return FPAHeads(budget=1.0, split=np.ones((model.cfg.n_layers, model.cfg.kv_heads)))
  return CachePolicy(name, budget=1.0)


def _decoded(model, policy, tokens, p):
  """Logits [B, T, V] of a prefill of tokens[:, :p] (the policy's own mode) and teacher-forced
  decode steps through the rest, in the reused-slot layout `generate` runs; keys held at the end."""
  b, t = tokens.shape
  pol = Decoder(model, policy, max_len=t).policy
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens):
    dec = Decoder(nnx.merge(graphdef, state), pol, max_len=t)
    logits, st = dec.prefill(tokens[:, :p], mode=pol.default_prefill())

    def body(carry, x, repack=True):  # the carry starts with the state (`Decoder.scan`)
      lg, st = dec.step(carry[0], x[0], jnp.full((b,), x[1], jnp.int32), repack=repack)
      return (st,), lg

    (st,), rest = dec.scan(body, (st,), (tokens[:, p:].T, jnp.arange(p, t)))
    return jnp.concatenate([logits, rest.swapaxes(0, 1)], 1), st.occupancy()[1]

  return run(state, tokens)


T_ONE, P_ONE = 256, 192


@pytest.fixture(scope="module")
def full_at_one(tiny):
  """(tokens [2, 256], full's measured logits, full's decoded logits): the reference of every policy."""
  model, cfg = tiny
  tok = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, T_ONE)), jnp.int32)
  return tok, cached_logits(model, tok)[0], _decoded(model, "full", tok, P_ONE)[0]


@pytest.mark.parametrize("name", BUDGETED)
def test_budget_one_keeps_every_key(tiny, full_at_one, name):
  """budget=1.0: every budgeted policy keeps every key and gives `full`'s logits within 1e-5, at
  256 tokens, measured (cached_logits; snapkv has no such run) and decoded (a prefill of 192 tokens,
  then 64 steps)."""
  model, cfg = tiny
  tok, measured, decoded = full_at_one
  pol = _budget_one(name, model)
  if "none" in pol.kind.prefills:
    got, stats = cached_logits(model, tok, policy=pol)
    assert stats["kept_fraction_mean"] == 1.0
    assert float(jnp.max(jnp.abs(got - measured))) <= 1e-5
  got, held = _decoded(model, pol, tok, P_ONE)
  want, t = decoded, T_ONE
  assert np.all(np.asarray(held) == t)
  assert float(jnp.max(jnp.abs(got - want))) <= 1e-5


def test_fpa_global_pool_holds_the_whole_sequence_at_budget_one():
  pol = make_policy("fpa_global", 256, budget=1.0)
  assert pol.pool_slots(2, 2, 16, 4) == 257 * 4  # every key of the 4 heads plus a step's new ones
  assert make_policy("fpa_global", 256, budget=0.5).pool_slots(2, 2, 16, 4) < 128 * 4  # inside its bytes
  assert isinstance(make_policy("fpa_global", 256, budget=1.0), FPAGlobal)


def test_docs_head_budget_block_runs_as_written(tiny, tmp_path, monkeypatch):
  """docs/inference.md's block: calibrate, decode under the split, save it beside the model, read it back."""
  import re
  from pathlib import Path

  model, cfg = tiny
  text = (Path(__file__).resolve().parents[2] / "docs" / "inference.md").read_text()
  block = re.search(r"```python\n(.*?)```", text[text.index("## A head budget") :], re.S).group(1)
  monkeypatch.chdir(tmp_path)
  prompts = np.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 64)))
  ns = {"model": model, "prompts": prompts}
  exec(compile(block, "docs/inference.md", "exec"), ns)
  split, stats = ns["split"], ns["stats"]
  assert split.shape == (cfg.n_layers, cfg.kv_heads) and abs(split.mean() - 0.125) < 1e-12
  assert ns["budget"] == 0.125 and (tmp_path / "my_model" / SPLIT_FILE).exists()
  assert ns["tokens"].shape == (2, 32) and stats["policy"] == "fpa_heads"
  caps = np.asarray(split_capacities(tuple(map(tuple, split)), 12, 96))  # a float budget: of P + N = 96
  assert stats["slots_per_row"] == caps.sum() <= 12 * split.size
