"""The public decoder (`inference.Decoder`) over one decode-state protocol, and `extend` built on it:
the layer's spec honoured chunk by chunk, a sharded model gathered first (CPU, tiny)."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tol import assert_close
from flax import nnx

from fpa_jax import configs as C
from fpa_jax.inference import Decoder, cache_bytes, extend, generate
from fpa_jax.inference import cache as K
from fpa_jax.inference.policies import make_policy
from fpa_jax.models import build_model

ROOT = Path(__file__).resolve().parents[2]
RANDOM_GATE = dict(step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)


@pytest.fixture(scope="module")
def tiny():
  return build_model(C.get_config("tiny", attention="fpa", **RANDOM_GATE), seed=0)


@pytest.mark.parametrize("policy, kw", [("fpa_budget", dict(budget=6)), ("fpa_global", dict(budget=6))])
def test_decoder_loop_is_generate(tiny, policy, kw):
  """A greedy loop written on the decoder (prefill, then step) emits generate's tokens, over either
  state layout (per-layer caches, fpa_global's pool) through the same methods."""
  prompt = jax.random.randint(jax.random.key(3), (2, 12), 0, tiny.cfg.vocab_size)
  want, stats = generate(tiny, np.asarray(prompt), 6, policy=policy, **kw)
  graphdef, state = nnx.split(tiny)

  @jax.jit
  def loop(state, prompt):
    dec = Decoder(nnx.merge(graphdef, state), policy, max_len=18, **kw)
    logits, cache = dec.prefill(prompt)
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

    def body(carry, pos, repack=True):
      cache, tok = carry
      logits, cache = dec.step(cache, tok, jnp.full((2,), pos, jnp.int32), repack=repack)
      nxt = jnp.argmax(logits, -1).astype(jnp.int32)
      return (cache, nxt), nxt

    (cache, _), rest = dec.scan(body, (cache, tok), jnp.arange(12, 17))
    return jnp.concatenate([tok[:, None], rest.T], 1), cache.occupancy()

  got, (peak, held) = loop(state, prompt)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert held.shape == (tiny.cfg.n_layers, 2, tiny.cfg.kv_heads) and float(peak) <= 18
  dec = Decoder(tiny, policy, max_len=18, **kw)
  assert dec.nbytes(2) == stats["cache_bytes"] == cache_bytes(tiny, 2, dec.policy, 18)
  assert dec.slots_per_row() == stats["slots_per_row"]


@pytest.mark.parametrize("policy", ["fpa_budget", "fpa_global"])
def test_both_layouts_answer_the_state_protocol(tiny, policy):
  """Per-layer caches and the slot pool answer the same methods alike: occupancy per (layer, row,
  kv head), row select and reset, bytes as `cache_bytes` counts them, no overflow or lost mass."""
  dec = Decoder(tiny, policy, max_len=16, budget=6)
  prompt = jax.random.randint(jax.random.key(6), (2, 10), 0, tiny.cfg.vocab_size)
  _, full = jax.jit(lambda p: dec.prefill(p, mode="parallel"))(prompt)
  empty = dec.init(2)
  peak, held = full.occupancy()
  assert held.shape == (tiny.cfg.n_layers, 2, tiny.cfg.kv_heads) and 0 < float(peak) <= 10
  mixed = full.select_rows(jnp.array([True, False]), empty)
  np.testing.assert_array_equal(np.asarray(mixed.occupancy()[1]), np.asarray(held) * np.array([1, 0])[None, :, None])
  np.testing.assert_array_equal(
    np.asarray(full.reset_rows(jnp.array([False, True])).occupancy()[1]), np.asarray(mixed.occupancy()[1])
  )
  assert full.nbytes() == dec.nbytes(2) and not bool(full.overflow()) and float(full.lost()) == 0.0


def test_decoder_checks_before_tracing(tiny):
  with pytest.raises(ValueError, match="max_len must be an int >= 1"):
    Decoder(tiny, "full", max_len=0)
  with pytest.raises(ValueError, match="drop \\['budget'\\]"):
    Decoder(tiny, make_policy("fpa_budget", 8, budget=4), max_len=8, budget=4)
  dec = Decoder(tiny, "h2o", max_len=8, budget=4)
  with pytest.raises(ValueError, match="use prefill='decode'"):
    dec.prefill(jnp.zeros((1, 4), jnp.int32), mode="parallel")
  with pytest.raises(ValueError, match="cannot prefill chunk by chunk"):
    dec.extend(dec.init(1), jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 4), jnp.zeros((1,), jnp.int32))


def test_no_layout_branches_or_private_imports_outside_the_package():
  """Only the pool's own module names `GlobalCache` in an isinstance; nothing outside
  fpa_jax/inference imports a private name from it (experiments, the eval, the rest of fpa_jax)."""
  files = [p for p in (ROOT / "fpa_jax").rglob("*.py")] + list((ROOT / "experiments").rglob("*.py"))
  for path in files:
    tree = ast.parse(path.read_text())
    inside = "fpa_jax/inference" in path.as_posix()
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
        assert "GlobalCache" not in ast.unparse(node.args[1]) or path.name == "pool.py", path
      if not inside and isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fpa_jax.inference"):
        private = [a.name for a in node.names if a.name.startswith("_")]
        assert not private, (path, private)


# ----------------------------------------------------------------------------- extend: the layer's spec

SKIP_EPS = 0.5  # large, so that what is dropped shows in fp32
DOWN = dict(step_bias_init=-0.07)  # a downward fpa walk: old tiles die (tests/model/test_dropin.py)


def _skip_model(skip_tolerance):
  cfg = C.get_config(
    "tiny", attention="fpa", attn_impl="chunked", block_size=4, skip_tolerance=skip_tolerance, n_layers=1, **DOWN
  )
  return build_model(cfg, seed=0)


def test_extend_runs_the_layers_kernel_and_tile():
  """A conversation's first chunk runs the layer's own parallel kernel (its impl, tiles and dead-tile
  skipping): its logits are the parallel forward's, skipped tiles included; later chunks read the
  cache in the layer's tiles and equal the parallel forward too (chunked, block 4, exact)."""
  skip, exact = _skip_model(SKIP_EPS), _skip_model(None)
  tok = jax.random.randint(jax.random.key(1), (2, 40), 0, skip.cfg.vocab_size)
  want, want_exact = np.asarray(skip(tok)), np.asarray(exact(tok))
  assert np.abs(want - want_exact).max() > 1e-4  # tiles were dropped: the kernel shows in the logits
  lg, _ = extend(skip, tok, max_len=40)
  assert_close(np.asarray(lg), want, n=skip.cfg.d_model)
  assert np.abs(np.asarray(lg) - want_exact).max() > 1e-4
  got, conv = [], None
  for a, b in ((0, 13), (13, 14), (14, 29), (29, 40)):
    lg, conv = extend(exact, tok[:, a:b], conv, **({} if conv else dict(max_len=40)))
    got.append(np.asarray(lg))
  assert_close(np.concatenate(got, 1), want_exact, n=exact.cfg.d_model * 40)


def test_extend_skip_tolerance_drops_dead_cached_keys_within_the_bound():
  """With a skip tolerance, a chunk leaves out the cached keys the skip bound shows dead for all its
  queries (`cache.dead_for_chunk`): some go, and every output component moves by <= 2 eps max|v|."""
  rng = np.random.default_rng(0)
  b, s, t, kvh, h, dk = 2, 24, 6, 2, 4, 8
  pol = make_policy("full", s + t)
  field = jnp.asarray(np.cumsum(-np.abs(rng.normal(size=(b, s + t, kvh))), axis=1) * 1.5, jnp.float32)
  rnd = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  q, k, v = rnd(b, s + t, h, dk), rnd(b, s + t, kvh, dk), rnd(b, s + t, kvh, dk)
  cum = jnp.zeros((b, s + t, kvh))
  cache = K.init_layer_cache(b, s + t, kvh, dk)
  kw = dict(policy=pol, scale=dk**-0.5)
  cache = K.prefill_chunk(
    cache, q[:, :s], k[:, :s], v[:, :s], field[:, :s], field[:, :s], cum[:, :s], lengths=jnp.full((b,), s),
    offsets=jnp.zeros((b,), jnp.int32), **kw,
  )[1]  # fmt: skip
  args = (q[:, s:], k[:, s:], v[:, s:], field[:, s:], field[:, s:], cum[:, s:])
  more = dict(lengths=jnp.full((b,), t), offsets=jnp.full((b,), s, jnp.int32), **kw)
  out0, _ = K.prefill_chunk(cache, *args, **more)
  out1, _ = K.prefill_chunk(cache, *args, skip_tolerance=SKIP_EPS, **more)
  dead = K.dead_for_chunk(cache, *args[:2], args[3], jnp.full((b,), t), scale=dk**-0.5, skip_tolerance=SKIP_EPS)
  assert 0 < int(dead.sum()) < int(cache.alive.sum())
  assert np.abs(np.asarray(out1) - np.asarray(out0)).max() <= 2 * SKIP_EPS * float(jnp.abs(v).max())
  assert not np.array_equal(np.asarray(out1), np.asarray(out0))


def test_extend_gathers_a_sharded_model(tiny):
  """A model spread over the 8 simulated devices extends as generate decodes it: gathered onto one
  device first (outputs and cache on one device), with the unsharded model's logits."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  graphdef, state = nnx.split(tiny)
  spread = nnx.merge(graphdef, jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  tok = jax.random.randint(jax.random.key(2), (2, 9), 0, tiny.cfg.vocab_size)
  want, conv0 = extend(tiny, tok[:, :5], max_len=9, policy="fpa_budget", budget=6)
  got, conv = extend(spread, tok[:, :5], max_len=9, policy="fpa_budget", budget=6)
  got2, conv = extend(spread, tok[:, 5:], conv)
  assert len(got.sharding.device_set) == 1 and len(got2.sharding.device_set) == 1
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(conv.caches))
  assert_close(np.asarray(got), np.asarray(want), n=tiny.cfg.d_model * tiny.cfg.n_layers)


# ----------------------------------------------------------------------------- a budget is a budget


@pytest.mark.parametrize("impl", ["packed", "masked", "gather"])
@pytest.mark.parametrize("config, tokens", [("tiny", 256), ("small", 256), ("small", 2112)])
def test_global_pool_allocates_no_more_than_its_budget(config, tokens, impl):
  """fpa_global at budget b allocates (pool, owner tags, gate carries, the packed index: every array)
  at most b of `full`'s bytes and at most `fpa_budget`'s at b, and nearly all of it (what is left:
  packed's index, which G counts for every implementation, and less than a slot)."""
  from fpa_jax.models import abstract_model

  m = abstract_model(C.get_config(config, attention="fpa"))
  for b in (0.25, 0.5):
    glob = cache_bytes(m, 4, make_policy("fpa_global", tokens, budget=b, pool_impl=impl), tokens)
    full = cache_bytes(m, 4, make_policy("full", tokens), tokens)
    per_head = cache_bytes(m, 4, make_policy("fpa_budget", tokens, budget=b), tokens)
    assert glob <= b * full and glob <= per_head, (glob / full, b)
    assert glob >= 0.95 * b * full, glob / full


# ----------------------------------------------------------------------------- the docs' block


def test_docs_decoder_block_runs_as_written(tiny):
  """docs/inference.md's decoder loop: generate's tokens, and no head holding more than its budget."""
  import re

  text = (ROOT / "docs" / "inference.md").read_text()
  block = re.search(r"```python\n(.*?)```", text[text.index("## The decoder") :], re.S).group(1)
  prompts = np.asarray(jax.random.randint(jax.random.key(5), (2, 16), 0, tiny.cfg.vocab_size))
  ns = {"model": tiny, "prompts": prompts}
  exec(compile(block, "docs/inference.md", "exec"), ns)
  want, _ = generate(tiny, prompts, 16, policy="fpa_budget", budget=0.25)
  np.testing.assert_array_equal(np.asarray(ns["tokens"]), want)
  held = np.asarray(ns["held"])
  assert held.shape == (tiny.cfg.n_layers, 2, tiny.cfg.kv_heads) and held.max() <= 8


def test_global_pool_too_small_for_its_budget_raises_before_tracing(tiny):
  with pytest.raises(ValueError, match="no room for a key beside"):
    Decoder(tiny, "fpa_global", max_len=64, budget=1)
