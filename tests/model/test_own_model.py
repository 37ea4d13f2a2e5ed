"""A model of one's own: decoding, generation and evaluation under any policy on an NNX model made of
`FirstPassageAttention` layers (found in its graph, no `model.cfg`), the policy objects (a fraction
kept, kvpress's compression ratio, a key count, a policy from a score function), the LM recipe on the
plain-argument layer, its optimizer parts and the evictability loss outside the trainer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tol import assert_bitwise, assert_close
from flax import nnx

from fpa_jax import configs as C
from fpa_jax import eval as ev
from fpa_jax import losses, optim
from fpa_jax.inference import cache as K
from fpa_jax.inference import decode as D
from fpa_jax.inference import (
  CachePolicy,
  as_policy,
  attention_layers,
  cached_logits,
  extend,
  generate,
  make_policy,
  slots_per_row,
)
from fpa_jax.layers import FirstPassageAttention, segment_positions
from fpa_jax.models import build_model

V, D_MODEL = 64, 32
FORGETFUL = dict(step_init_std=0.3, absolute_init_std=0.05, offset_init_std=0.05)


class Mixed(nnx.Module):
  """An FPA layer, an MLP, a plain (softmax) attention layer with another number of kv heads, a
  learned position embedding (it reads the `positions` decoding passes) and an untied head."""

  def __init__(self, *, rngs: nnx.Rngs, kv=(2, 4), qk_norm=True):
    d = D_MODEL
    self.embed = nnx.Embed(V, d, rngs=rngs)
    self.pos = nnx.Embed(64, d, rngs=rngs)
    mk = functools.partial(FirstPassageAttention.from_args, d_model=d, n_heads=4, qk_norm=qk_norm, rngs=rngs)
    self.layers = nnx.List(
      [mk(n_kv_heads=kv[0], gate="fpa", attn_impl="chunked", **FORGETFUL), mk(n_kv_heads=kv[1], gate="softmax")]
    )
    self.mlp = nnx.Sequential(nnx.Linear(d, 2 * d, rngs=rngs), nnx.gelu, nnx.Linear(2 * d, d, rngs=rngs))
    self.norms = nnx.List([nnx.RMSNorm(d, rngs=rngs) for _ in range(3)])
    self.head = nnx.Linear(d, V, rngs=rngs)

  def __call__(self, tokens, segment_ids=None, positions=None, *, cache=None):
    b, t = tokens.shape
    pos = segment_positions(segment_ids, b, t) if positions is None else positions
    x = self.embed(tokens) + self.pos(pos)
    for i, attn in enumerate(self.layers):
      h = attn(self.norms[i](x), segment_ids, cache=cache)
      if cache is not None:
        h, cache = h
      x = x + h
      if i == 0:
        x = x + self.mlp(self.norms[2](x))
    logits = self.head(x)
    return logits if cache is None else (logits, cache)


@pytest.fixture(scope="module")
def mixed():
  return Mixed(rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny():
  """A DecoderLM with forgetful gates (the score policies against the built-in ones)."""
  return build_model(C.get_config("tiny", attention="fpa", gate_init_std=0.3, **FORGETFUL), seed=0)


@nnx.jit
def _forward(model, tokens, segment_ids=None):
  return model(tokens, segment_ids)


def _tokens(b, t, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, V)


N = D_MODEL * 2  # logits: reductions over d_model in each of the two attention layers


# ------------------------------------------------------------------------------------------------ decoding


def test_layers_found_in_the_graph(mixed, tiny):
  found = attention_layers(mixed)
  assert [f.path for f in found] == [("layers", 0), ("layers", 1)]
  assert [f.layer.cfg.kv_heads for f in found] == [2, 4] and all(f.norm_scale is None for f in found)
  dl = attention_layers(tiny)
  assert [f.path for f in dl] == [("blocks", 0, "attn"), ("blocks", 1, "attn")]
  assert all(f.norm_scale is not None for f in dl)


def test_own_model_decodes_like_its_parallel_forward(mixed):
  """cached_logits under `full` (packed rows too) and greedy generation equal the model's own
  parallel forward; the per-head stats keep each layer's own kv heads."""
  tok = _tokens(2, 20)
  logits, stats = cached_logits(mixed, tok)
  assert_close(logits, _forward(mixed, tok), n=N)
  assert [len(r) for r in stats["kept_fraction_per_head"]] == [2, 4] and stats["kept_fraction_mean"] == 1.0
  seg = jnp.array([[1] * 7 + [2] * 13, [3] * 20])
  logits, _ = cached_logits(mixed, tok, segment_ids=seg)
  assert_close(logits, _forward(mixed, tok, seg), n=N)
  # greedy generation (parallel and token-by-token prefill) against the parallel argmax, step by step
  prompt = np.asarray(tok[:, :9])
  out, gstats = generate(mixed, prompt, 5)
  seq = prompt
  for i in range(5):
    nxt = np.argmax(np.asarray(_forward(mixed, jnp.asarray(seq)))[:, -1], -1)
    np.testing.assert_array_equal(out[:, i], nxt)
    seq = np.concatenate([seq, nxt[:, None]], 1)
  np.testing.assert_array_equal(generate(mixed, prompt, 5, prefill="decode")[0], out)
  assert [len(r) for r in gstats["kept_fraction_per_head"]] == [2, 4]
  assert gstats["slots_per_row"] == 14 * (2 + 4)


def test_own_model_under_budgets_and_in_eval(mixed):
  """A budget of the whole sequence is the full cache; compression_ratio is budget = 1 - it (the
  same program); a quarter of the cache holds a quarter; `fpa_jax.eval` runs on the model."""
  tok = _tokens(2, 16, seed=2)
  full, _ = cached_logits(mixed, tok)
  whole, _ = cached_logits(mixed, tok, policy="fpa_budget", budget=1.0)
  assert_close(whole, full, n=N)
  a, sa = cached_logits(mixed, tok, policy="fpa_budget", budget=0.25)
  b, sb = cached_logits(mixed, tok, policy=CachePolicy("fpa_budget", compression_ratio=0.75))
  assert_bitwise(a, b)
  assert sa["capacity"] == sb["capacity"] == 4 and sa["cache_fraction"] == 0.25
  rows = np.asarray(_tokens(3, 17, seed=3))
  res = ev.loss_by_position(mixed, rows, bucket=4, batch_size=2, show_progress=False)
  cut = ev.loss_by_position(mixed, rows, bucket=4, batch_size=2, policy="window", budget=4, show_progress=False)
  assert res["cache"] == {"policy": "full"} and np.isfinite(res["nll_mean"])
  assert cut["cache"]["policy"] == "window" and cut["cache"]["cache_fraction"] == 0.25
  assert cut["nll"][0] == pytest.approx(res["nll"][0], rel=1e-5)  # positions 0..3 see every key either way
  assert cut["nll"][-1] != pytest.approx(res["nll"][-1], rel=1e-4)  # the last ones do not


@pytest.mark.slow  # extend: ops/test_prefix.py on DecoderLM
def test_own_model_extends_chunk_by_chunk(mixed):
  """`extend` on a model of one's own: chunk by chunk under `full` is the parallel forward; a score
  policy chunks too (score = -penalty keeps fpa_budget's keys)."""
  tok = _tokens(2, 18, seed=7)
  want = _forward(mixed, tok)
  got, conv = extend(mixed, tok[:, :7], max_len=18)
  logits = [got]
  for a, b in ((7, 12), (12, 18)):
    got, conv = extend(mixed, tok[:, a:b], conv)
    logits.append(got)
  assert_close(jnp.concatenate(logits, 1), want, n=N)
  assert conv.keys_held().shape == (2, 2, 4) and conv.keys_held()[0, 0, 2] == -1  # layer 0 has 2 kv heads
  runs = []
  for policy in (CachePolicy(score=_neg_penalty, budget=6), CachePolicy("fpa_budget", budget=6)):
    got, conv = extend(mixed, tok[:, :9], max_len=18, policy=policy)
    got2, conv = extend(mixed, tok[:, 9:], conv)
    runs.append((np.asarray(got2), conv.keys_held()))
  assert_close(runs[0][0], runs[1][0], n=N)
  np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.slow  # test_own_model_under_budgets_and_in_eval
def test_fpa_global_and_tolerance_on_own_model():
  """fpa_global's pool across the layers of a model with one kv-head count; the tolerance policy
  with the layers' QK-norm bound (lost mass <= eps)."""
  m = Mixed(rngs=nnx.Rngs(1), kv=(2, 2))
  prompt = np.asarray(_tokens(2, 10, seed=4))
  kw = dict(policy="fpa_global", budget=5)
  out, stats = generate(m, prompt, 6, prefill="decode", **kw)
  logits, _ = cached_logits(m, np.concatenate([prompt, out], 1), **kw)
  np.testing.assert_array_equal(np.argmax(np.asarray(logits[:, 9:-1]), -1), out)
  # the pool of the budget's 5 keys per (layer, kv head), its tags and index inside their bytes
  assert stats["slots_per_row"] == slots_per_row(m, make_policy("fpa_global", 16, budget=5)) < 5 * 2 * 2
  _, tstats = cached_logits(m, prompt, policy="fpa", tolerance=1e-3)
  assert tstats["lost_mass_max"] <= 1e-3


def test_own_model_errors_name_the_fix(mixed):
  class NoCache(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(V, D_MODEL, rngs=rngs)
      self.attn = FirstPassageAttention.from_args(d_model=D_MODEL, n_heads=2, rngs=rngs)

    def __call__(self, tokens):
      return self.embed.attend(self.attn(self.embed(tokens)))  # tied head: [B, T, V]

  class Forgets(Mixed):  # the second layer never sees the cache
    def __call__(self, tokens, segment_ids=None, *, cache=None):
      x = self.embed(tokens)
      h, cache = self.layers[0](x, cache=cache) if cache is not None else (self.layers[0](x), None)
      x = x + h + self.layers[1](x)
      return self.head(x) if cache is None else (self.head(x), cache)

  class Twice(Mixed):  # one layer applied twice: one cache cannot hold two layers' keys
    def __call__(self, tokens, segment_ids=None, *, cache=None):
      x = self.embed(tokens)
      for _ in range(2):
        h = self.layers[0](x, cache=cache)
        if cache is not None:
          h, cache = h
        x = x + h
      return self.head(x) if cache is None else (self.head(x), cache)

  class LogitsOnly(Mixed):
    def __call__(self, tokens, segment_ids=None, *, cache=None):
      out = super().__call__(tokens, segment_ids, cache=cache)
      return out[0] if cache is not None else out

  class Foreign(Mixed):
    def __init__(self, rngs):
      super().__init__(rngs=rngs)
      self.mha = nnx.MultiHeadAttention(2, D_MODEL, decode=False, rngs=rngs)

  tok = np.asarray(_tokens(1, 6))
  with pytest.raises(ValueError, match="takes no `cache` argument"):
    cached_logits(NoCache(nnx.Rngs(0)), tok)
  with pytest.raises(ValueError, match=r"did not hand `cache` to its layer\(s\) at \[\('layers', 1\)\]"):
    cached_logits(Forgets(rngs=nnx.Rngs(0)), tok)
  with pytest.raises(ValueError, match="attended twice"):
    generate(Twice(rngs=nnx.Rngs(0)), tok, 2)
  with pytest.raises(ValueError, match=r"must return \(logits, cache\)"):
    cached_logits(LogitsOnly(rngs=nnx.Rngs(0)), tok)
  with pytest.raises(ValueError, match="gate='softmax' is plain attention"):
    cached_logits(Foreign(nnx.Rngs(0)), tok)
  with pytest.raises(ValueError, match="no FirstPassageAttention layer"):
    cached_logits(nnx.Sequential(nnx.Embed(V, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, V, rngs=nnx.Rngs(0))), tok)
  before = dict(D.TRACES)
  with pytest.raises(ValueError, match="qk_norm=True"):
    cached_logits(Mixed(rngs=nnx.Rngs(0), qk_norm=False), tok, policy="fpa", tolerance=1e-3)
  with pytest.raises(ValueError, match="use fpa_budget"):
    generate(mixed, tok, 2, policy="fpa_global", budget=4)
  with pytest.raises(ValueError, match=r"vocab_size=64\)"):
    cached_logits(mixed, tok + V)
  assert D.TRACES == before  # all of these before tracing


# ------------------------------------------------------------------------------------------------ policy objects


def test_policy_objects_check_their_arguments():
  assert CachePolicy("window", compression_ratio=0.75).resolve(64) == make_policy("window", 64, budget=0.25)
  assert make_policy("fpa_budget", 64, compression_ratio=0.5).capacity == 32
  assert CachePolicy("snapkv", budget=20).resolve(64).capacity == 20  # an int: a key count
  assert CachePolicy().name == "full" and CachePolicy(score=_neg_penalty, budget=4).name == "score"
  assert as_policy("fpa_budget", budget=0.25, tolerance=None) == CachePolicy("fpa_budget", budget=0.25)
  for kw, match in [
    (dict(name="window", budget=0.25, compression_ratio=0.75), "either budget .* or compression_ratio"),
    (dict(name="window", compression_ratio=1.0), r"compression_ratio is the fraction of keys removed, in \[0, 1\)"),
    (dict(name="window", compression_ratio=-0.1), "compression_ratio is the fraction"),
    (dict(name="window", compression_ratio=True), "compression_ratio is the fraction"),
    (dict(name="window"), "needs a budget .* or a compression_ratio"),
    (dict(name="window", budget=1.5), "must be <= 1"),
    (dict(name="lru", budget=4), "unknown policy"),
    (dict(name="fpa_budget", score=_neg_penalty, budget=4), "leave name unset"),
    (dict(name="score", budget=4), "needs score=fn"),
    (dict(score="penalty", budget=4), "score must be a function"),
    (dict(score=_neg_penalty), "needs a budget"),
    (dict(name="fpa", tolerance=2.0), "tolerance in"),
    (dict(name="window", budget=4, recent=2), "recent .* applies to"),
  ]:
    with pytest.raises(ValueError, match=match):
      CachePolicy(**kw)
  with pytest.raises(ValueError, match="recent < 4"):
    CachePolicy("fpa_budget", budget=4, recent=4).resolve(64)
  with pytest.raises(ValueError, match="give its arguments in it"):
    as_policy(CachePolicy("window", budget=4), budget=8)
  rec = CachePolicy(score=_neg_penalty, budget=0.25, recent=2).record()
  assert rec == {"policy": "score", "budget": 0.25, "recent": 2, "score": "_neg_penalty"}
  assert ev.check_policy("window", 64, compression_ratio=0.75) == {"policy": "window", "compression_ratio": 0.75}
  # the CLIs: --compression-ratio beside --budget
  from fpa_jax.inference.__main__ import parse_args as generate_args

  a = ev.parse_args(["--workdir", "w", "--task", "passkey", "--policy", "window", "--compression-ratio", "0.75"])
  assert (
    a.compression_ratio == 0.75
    and generate_args(["--workdir", "w", "--prompt", "x", "--compression-ratio", "0.5"]).compression_ratio == 0.5
  )
  rec = ev.check_policy(a.policy, 64, compression_ratio=a.compression_ratio)
  assert ev.default_out("w", "passkey", rec).name == "passkey_window_cr0.75.json"


def _neg_penalty(q, k, field, level, penalty, positions):
  return -penalty  # the lowest score is the largest penalty: fpa_budget's rule


def _position(q, k, field, level, penalty, positions):
  return positions  # the oldest goes: a window


def _key_norm(q, k, field, level, penalty, positions):
  return jnp.sum(jnp.square(k.astype(jnp.float32)), -1)  # [B, S, KVH]


def attention_now(q, k, field, level, penalty, positions):
  """docs/inference.md's example, as written there."""
  b, h, d = q.shape
  kvh = k.shape[2]
  logits = jnp.einsum("bhgk,bshk->bsh", q.reshape(b, kvh, h // kvh, d), k) * d**-0.5
  return logits - penalty * (h // kvh)  # what the gate already took off, for each query head


def test_docs_score_policy_runs_within_its_budget(mixed):
  tok = np.asarray(_tokens(2, 16, seed=6))
  policy = CachePolicy(score=attention_now, budget=0.25)
  _, stats = cached_logits(mixed, tok, policy=policy)
  assert stats["cache_fraction"] == 0.25 and stats["policy"] == "score"
  out, gstats = generate(mixed, tok[:, :10], 4, policy=policy)
  assert out.shape == (2, 4) and gstats["capacity"] == 4


def test_score_policies_reproduce_the_built_in_rules(tiny):
  """score = -penalty is fpa_budget and score = position is window, decode and prefill alike, on
  the same recent window: the same logits (up to rounding: the programs differ by the unused
  scores), the same generated tokens."""
  tok = np.asarray(jax.random.randint(jax.random.key(3), (2, 24), 0, tiny.cfg.vocab_size))
  for fn, name in [(_neg_penalty, "fpa_budget"), (_position, "window")]:
    own = CachePolicy(score=fn, budget=8)  # recent: the last 8 // 8 = 1 key protected
    a, sa = cached_logits(tiny, tok, policy=own)
    b, _ = cached_logits(tiny, tok, policy=name, budget=8)
    assert_close(a, b, n=tiny.cfg.d_model * tiny.cfg.n_layers)  # the same keys (another key: far apart)
    assert sa["policy"] == "score" and sa["capacity"] == 8
    g, _ = generate(tiny, tok[:, :14], 6, policy=own)
    np.testing.assert_array_equal(g, generate(tiny, tok[:, :14], 6, policy=name, budget=8)[0])


def test_score_policy_keeps_the_best_scored_keys():
  """A key-norm score on one stream, against a numpy simulation: when full, the smallest ||k||^2
  outside the protected window goes (ties oldest); the function sees the cache's keys."""
  pol = make_policy("score", 20, budget=5, recent=1, score=_key_norm)
  norms = np.random.default_rng(0).permutation(20).astype(np.float32) + 1.0
  cache = K.init_layer_cache(1, pol.capacity, 1, 1)
  step = jax.jit(functools.partial(K.decode_attend, policy=pol, scale=1.0))
  alive = []
  for i in range(20):
    k = jnp.full((1, 1, 1, 1), np.sqrt(norms[i]))
    z = jnp.zeros((1, 1, 1))
    _, cache = step(cache, jnp.zeros((1, 1, 1, 1)), k, k, z, z, z, positions=jnp.array([i]))
    if len(alive) >= 5:
      alive.remove(min((j for j in alive if j <= i - 1), key=lambda j: (norms[j], j)))
    alive.append(i)
    held = {int(p) for p, a in zip(np.asarray(cache.pos[0, :, 0]), np.asarray(cache.alive[0, :, 0])) if a}
    assert held == set(alive), (i, held, alive)

  bad = make_policy("score", 20, budget=5, score=lambda q, k, *_: k)  # [B, S, KVH, K]: one too many axes
  with pytest.raises(ValueError, match="one score per cached key"):
    jax.eval_shape(
      functools.partial(K.decode_attend, policy=bad, scale=1.0, positions=jnp.array([0])),
      K.init_layer_cache(1, 5, 1, 2),
      *(jnp.zeros((1, 1, 1, 2)),) * 3,
      *(jnp.zeros((1, 1, 1)),) * 3,
    )


# ------------------------------------------------------------------------------------------------ the recipe


def test_from_args_recipe_is_the_lm_gate():
  lm = C.gate_recipe("lm", "model")
  assert set(lm) == {k for k in C.LM_DEFAULT if k in C.GATE_OPTIONS} and "gate_lr_scale" not in lm
  a = FirstPassageAttention.from_args(d_model=32, n_heads=4, n_kv_heads=2, recipe="lm", rngs=nnx.Rngs(0))
  b = FirstPassageAttention.from_args(d_model=32, n_heads=4, n_kv_heads=2, rngs=nnx.Rngs(0), **lm)
  assert a.cfg == b.cfg and a.cfg.gate_forget and a.cfg.gate_bias_init == 5.0 and a.cfg.step_scale == 1.0
  for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
    assert_bitwise(x.get_value(), y.get_value(), err_msg=str(p))
  over = FirstPassageAttention.from_args(d_model=32, n_heads=4, recipe="lm", fox_heads=1, rngs=nnx.Rngs(0))
  assert over.cfg.fox_heads == 1 and over.cfg.gate_forget  # an option given beats the recipe's
  with pytest.raises(ValueError, match="unknown recipe 'LM'"):
    FirstPassageAttention.from_args(d_model=32, n_heads=4, recipe="LM", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="set fox_heads=0"):  # the recipe's fields pass the layer's checks
    FirstPassageAttention.from_args(d_model=32, n_heads=4, n_kv_heads=1, recipe="lm", fox_heads=1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="optim.gate_optimizer; recipe='lm'"):
    FirstPassageAttention.from_args(d_model=32, n_heads=4, rngs=nnx.Rngs(0), **C.LM_DEFAULT)


def test_gate_optimizer_is_the_trainers():
  """The public optimizer parts are the trainer's: the same state layout and the same updates as
  `train.make_optimizer` for the LM presets' config; errors name the argument."""
  from fpa_jax.train import lr_schedule, make_optimizer
  from fpa_jax.models import weight_decay_mask

  cfg = C.get_config("tiny", **C.LM_DEFAULT, n_heads=4, n_kv_heads=2, warmup_steps=0)
  model = build_model(cfg)
  params = nnx.state(model, nnx.Param)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  adamw = optax.adamw(
    lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=weight_decay_mask(cfg)
  )
  mine, theirs = optim.gate_optimizer(adamw, recipe="lm"), make_optimizer(cfg)
  sm, st = mine.init(params), theirs.init(params)
  assert jax.tree.structure(sm) == jax.tree.structure(st)
  for _ in range(3):
    um, sm = mine.update(grads, sm, params)
    ut, st = theirs.update(grads, st, params)
    jax.tree.map(assert_bitwise, um, ut)
  assert optim.gate_optimizer(adamw, recipe=None, clip_norm=0.0, **C.gate_recipe("single_head", "train")) is adamw
  for kw, match in [
    (dict(recipe=None), "recipe=None needs every optimizer setting"),
    (dict(gate_lr_scale=0.0), "gate_lr_scale=0.0"),
    (dict(gate_lr_warmup=5), "unknown argument"),
    (dict(clip_norm=-1.0), "clip_norm=-1.0"),
    (dict(recipe="fox"), "unknown recipe"),
  ]:
    with pytest.raises(ValueError, match=match):
      optim.gate_optimizer(adamw, **kw)


@pytest.mark.slow  # eager; the hinge on an own model: test_dropin's README recipe trains with it; the trainer's: ops/test_evictability.py
def test_evictability_loss_is_the_trainers_and_trains_an_own_model(mixed):
  """On a DecoderLM, `evictability_loss` is the trainer's hinge (the objective's metrics, bit for
  bit); on a model of one's own its gradient reaches the gate read-outs."""
  cfg = C.get_config("tiny", attention="fpa", evict_weight=1.0, evict_window=4, evict_ramp_steps=10)
  model = build_model(cfg)
  tok = _tokens(2, 17)
  batch = {
    "inputs": tok[:, :-1],
    "targets": tok[:, 1:],
    "segment_ids": jnp.ones((2, 16), jnp.int32),
    "loss_mask": jnp.ones((2, 16)),
  }
  key = jax.random.key(5)
  _, aux = losses.objective(model, batch, cfg, step=3, key=key)
  opts = dict(window=4, target=losses.evict_target(3, cfg))
  logits, hinge, metrics = losses.evictability_loss(model, batch["inputs"], batch["segment_ids"], key=key, **opts)
  assert_bitwise(hinge, aux["evict_loss"])
  assert set(metrics) <= set(aux) and logits.shape == (2, 16, cfg.vocab_size)
  g = nnx.grad(lambda m: losses.evictability_loss(m, tok[:, :-1], key=key, window=4)[1])(mixed)
  step = g["layers"][0]["gate"]["step"]["w"].get_value()
  assert float(jnp.abs(step).max()) > 0
  with pytest.raises(ValueError, match="no FirstPassageAttention"):
    losses.evictability_loss(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.ones((1, 3, 4)), key=key)
