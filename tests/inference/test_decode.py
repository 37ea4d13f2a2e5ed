"""Inference: cached decoding equals the parallel model, eviction policies keep what they should,
the `fpa` tolerance bound holds, generation is greedy-exact and compiles once."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _fwd import forward
from _tol import assert_bitwise, assert_close, rtol
from fpa_jax import configs as C
from fpa_jax.inference import cache as K
from fpa_jax.inference import decode as D
from fpa_jax.inference import cached_logits, generate, layer_logit_bounds, load_model, make_policy, tolerance_threshold
from fpa_jax.models import build_model
from fpa_jax.ops import reference_np as ref

RANDOM_GATE = dict(step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)


def _model(att, seed=0, **kw):
  return build_model(C.get_config("tiny", attention=att, **{**RANDOM_GATE, **kw}), seed=seed)


def _tokens(b, t, vocab, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


# ------------------------------------------------------------------------------------------------ full


@pytest.mark.xla_default
@pytest.mark.parametrize(  # stack: fpa's cache with another gate module; nope: softmax's decode path without RoPE
  "att", [pytest.param(a, marks=pytest.mark.slow) if a in ("stack", "nope") else a for a in C.ATTENTIONS]
)
def test_full_cache_equals_parallel(att):
  m = _model(att)
  tok = _tokens(2, 21, m.cfg.vocab_size)
  logits, stats = cached_logits(m, tok)
  n = m.cfg.d_model * m.cfg.n_layers  # logits: reductions over d_model in every layer
  assert_close(logits, forward(m, tok), n=n)
  assert stats["cache_fraction"] == 1.0 and stats["kept_fraction_mean"] == 1.0 and stats["lost_mass_max"] == 0.0
  # packed rows: the cache restarts at every segment change, like the parallel path's segment mask
  seg = jnp.array([[1] * 7 + [2] * 9 + [5] * 5, [3] * 21])
  logits, _ = cached_logits(m, tok, segment_ids=seg)
  assert_close(logits, forward(m, tok, seg), n=n)


@pytest.mark.parametrize("n_kv_heads", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_full_cache_equals_parallel_with_fox_heads(n_kv_heads):
  """`fox_heads`: decoding masks the read-outs of the same heads as the parallel path (GQA too)."""
  m = _model("fpa", gate_forget=True, fox_heads=1, n_heads=4, n_kv_heads=n_kv_heads)
  tok = _tokens(2, 17, m.cfg.vocab_size)
  logits, _ = cached_logits(m, tok)
  assert_close(logits, forward(m, tok), n=m.cfg.d_model * m.cfg.n_layers)


@pytest.mark.parametrize(
  "policy,kw",
  [
    ("fpa_budget", {}),
    pytest.param("window", {}, marks=pytest.mark.slow),
    pytest.param("sink_window", {}, marks=pytest.mark.slow),
    ("h2o", {}),
    pytest.param("full", {}, marks=pytest.mark.slow),
  ],
)
def test_budget_at_least_sequence_equals_full(policy, kw):
  m = _model("fpa")
  tok = _tokens(2, 16, m.cfg.vocab_size)
  full, _ = cached_logits(m, tok)
  got, stats = cached_logits(m, tok, policy=policy, budget=16)
  assert_close(got, full, n=m.cfg.d_model * m.cfg.n_layers)  # another policy's program: same keys, same math
  assert stats["lost_mass_max"] == 0.0


# ------------------------------------------------------------------------------------------------ hand-built


def _run_layer(policy, field, *, q=None, scale=1.0):
  """Decode a 1-row, 1-head stream with field = level = `field`; alive key positions per step."""
  t = len(field)
  cache = K.init_layer_cache(1, policy.capacity, 1, 1, threshold=policy.threshold)
  zeros = jnp.zeros((1, 1, 1, 1))
  sets = []
  for i in range(t):
    f = jnp.full((1, 1, 1), field[i], jnp.float32)
    qi = zeros if q is None else jnp.full((1, 1, 1, 1), q[i])
    _, cache = K.decode_attend(
      cache, qi, zeros + 1.0, zeros, f, f, f, policy=policy, scale=scale, positions=jnp.array([i])
    )
    sets.append({int(p) for p, a in zip(np.asarray(cache.pos[0, :, 0]), np.asarray(cache.alive[0, :, 0])) if a})
  return sets


BRACKETS = "x(a(bc)d(e)f)y(g(h)i)"


def _depth(text):
  return np.cumsum([1 if c == "(" else -1 if c == ")" else 0 for c in text]).astype(np.float32) * 10


def test_threshold_policy_keeps_exactly_the_stack():
  field = _depth(BRACKETS)
  pol = make_policy("fpa_threshold", len(field), threshold=5.0)
  assert _run_layer(pol, field) == ref.stack_live_sets_np(field)


def test_tolerance_policy_threshold_and_stack():
  # q = k = 0 -> U = 0 and tau = log N - log eps; a depth walk of 10 per bracket clears it.
  field = _depth(BRACKETS)
  pol = make_policy("fpa", len(field), tolerance=1e-3)
  tau = float(tolerance_threshold(jnp.zeros(()), len(field), 1e-3))
  assert 5.0 < tau < 10.0
  import dataclasses

  assert _run_layer(dataclasses.replace(pol, threshold=tau), field) == ref.stack_live_sets_np(field)


def _simulate(policy, field, capacity, n_sink=4):
  """Numpy reference of the budgeted policies (penalty = level - running min, level = field)."""
  alive, sets = [], []
  for i, f in enumerate(field):
    pen = {j: max(0.0, field[j] - min(field[j + 1 : i + 1])) for j in alive}
    if len(alive) >= capacity:
      if policy == "window":
        out = min(alive)
      elif policy == "sink_window":
        cand = [j for j in alive if j >= n_sink] or alive
        out = min(cand)
      else:  # fpa_budget: largest penalty, ties oldest
        out = min(alive, key=lambda j: (-pen[j], j))
      alive.remove(out)
    alive.append(i)
    sets.append(set(alive))
  return sets


@pytest.mark.parametrize(
  "capacity,policy",
  [  # capacity 5 of each policy in the default run
    pytest.param(3, "fpa_budget", marks=pytest.mark.slow),
    pytest.param(3, "window", marks=pytest.mark.slow),
    (3, "sink_window"),
    (5, "fpa_budget"),
    (5, "window"),
    (5, "sink_window"),
    pytest.param(8, "fpa_budget", marks=pytest.mark.slow),
    pytest.param(8, "window", marks=pytest.mark.slow),
    pytest.param(8, "sink_window", marks=pytest.mark.slow),
  ],
)
def test_budget_policies_evict_exactly(policy, capacity):
  if policy == "sink_window" and capacity <= 4:
    pytest.skip("sink_window needs a budget > 4")
  field = _depth(BRACKETS)
  pol = make_policy(policy, len(field), budget=capacity)
  assert _run_layer(pol, field) == _simulate(policy, field, capacity)


def test_h2o_keeps_recent_and_heavy():
  # Key 0 gets all the attention (q.k large only there); with capacity 4 (2 recent) it must stay.
  t = 12
  cache = K.init_layer_cache(1, 4, 1, 1)
  pol = make_policy("h2o", t, budget=4)
  for i in range(t):
    k = jnp.full((1, 1, 1, 1), 5.0 if i == 0 else 0.0)
    q = jnp.ones((1, 1, 1, 1))
    z = jnp.zeros((1, 1, 1))
    _, cache = K.decode_attend(cache, q, k, k * 0, z, z, z, policy=pol, scale=1.0, positions=jnp.array([i]))
    alive = {int(p) for p, a in zip(np.asarray(cache.pos[0, :, 0]), np.asarray(cache.alive[0, :, 0])) if a}
    assert 0 in alive and i in alive and (i < 1 or i - 1 in alive) and len(alive) == min(i + 1, 4)


# ------------------------------------------------------------------------------------------------ bound


def _forgetful_fpa(seed=0):
  """A 2-layer fpa model whose gate makes large penalties and whose q/k are small (U ~ 1)."""
  m = build_model(
    C.get_config("tiny", attention="fpa", step_init_std=0.5, absolute_init_std=0.3, offset_init_std=0.1), seed=seed
  )
  for blk in m.blocks:
    blk.attn.wq[...] = blk.attn.wq[...] * 0.25
    blk.attn.wk[...] = blk.attn.wk[...] * 0.25
  return m


@pytest.mark.parametrize("eps", [1e-2, pytest.param(1e-4, marks=pytest.mark.slow)])
def test_tolerance_bound_holds_and_evicts(eps):
  m = _forgetful_fpa()
  tok = _tokens(3, 48, m.cfg.vocab_size, seed=3)
  u = [np.asarray(x) for x in layer_logit_bounds(m)]
  assert all(np.all(x < 5) for x in u), u
  logits, stats = cached_logits(m, tok, policy="fpa", tolerance=eps)
  assert stats["kept_fraction_mean"] < 0.9, stats  # eviction happened
  assert 0.0 < stats["lost_mass_max"] <= eps, stats  # ... and lost at most eps of the mass
  assert not stats["overflow"]
  full, _ = cached_logits(m, tok)
  assert float(jnp.max(jnp.abs(jax.nn.softmax(logits) - jax.nn.softmax(full)))) < 50 * eps


def test_logit_bound_holds_on_random_inputs():
  m = _forgetful_fpa(seed=1)
  blk = m.blocks[0]
  u = np.asarray(layer_logit_bounds(m)[0])
  x = jax.random.normal(jax.random.key(0), (4, 64, m.cfg.d_model)) * jnp.exp(
    jax.random.normal(jax.random.key(1), (4, 64, 1))
  )
  h = blk.attn_norm(x)
  q, k, _ = blk.attn.project(h, jnp.broadcast_to(jnp.arange(64), (4, 64)))
  s = jnp.einsum("bthk,bshk->bhts", q, k) * m.cfg.head_dim**-0.5
  assert np.all(np.max(np.abs(np.asarray(s)), axis=(0, 2, 3)) <= u)
  # QK-norm bound too
  mq = build_model(C.get_config("tiny", attention="fpa", qk_norm=True), seed=0)
  uq = np.asarray(layer_logit_bounds(mq)[0])
  q, k, _ = mq.blocks[0].attn.project(mq.blocks[0].attn_norm(x), jnp.broadcast_to(jnp.arange(64), (4, 64)))
  s = jnp.einsum("bthk,bshk->bhts", q, k) * mq.cfg.head_dim**-0.5
  assert np.all(np.max(np.abs(np.asarray(s)), axis=(0, 2, 3)) <= uq * (1 + rtol(np.float32, mq.cfg.head_dim)))


# ------------------------------------------------------------------------------------------------ generate


def _greedy_reference(m, prompt, n):
  """Explicit greedy loop on the parallel model (right-padded to one length: one compile)."""
  graphdef, state = nnx.split(m)
  fwd = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
  toks = list(map(int, prompt))
  for _ in range(n):
    x = np.zeros((1, len(prompt) + n), np.int32)
    x[0, : len(toks)] = toks
    toks.append(int(np.argmax(np.asarray(fwd(state, x))[0, len(toks) - 1])))
  return np.asarray(toks[len(prompt) :])


@pytest.mark.xla_default
@pytest.mark.parametrize(
  "att", ["fpa", pytest.param("fox", marks=pytest.mark.slow), pytest.param("softmax", marks=pytest.mark.slow)]
)
def test_generate_greedy_equals_parallel_argmax(att):
  m = _model(att)
  prompts = [np.asarray(_tokens(1, n, m.cfg.vocab_size, seed=n))[0] for n in (5, 11, 8)]
  before = D.TRACES["generate"]
  out, stats = generate(m, prompts, 6)
  assert D.TRACES["generate"] == before + 1  # one trace for the whole generation
  generate(m, prompts, 6)
  assert D.TRACES["generate"] == before + 1  # and none when called again
  for p, row in zip(prompts, out):
    np.testing.assert_array_equal(row, _greedy_reference(m, p, 6))
  out2, _ = generate(m, prompts, 6, prefill="decode")
  np.testing.assert_array_equal(out2, out)
  assert stats["cache_fraction"] <= 1.0


@pytest.mark.xla_default
@pytest.mark.parametrize(
  "policy,kw",
  [
    pytest.param("window", dict(budget=7), marks=pytest.mark.slow),
    ("fpa_budget", dict(budget=7)),
    pytest.param("sink_window", dict(budget=7), marks=pytest.mark.slow),
    ("h2o", dict(budget=6)),
    pytest.param("fpa_threshold", dict(threshold=0.5, budget=9), marks=pytest.mark.slow),
  ],
)
def test_reused_slots_equal_measured_cache(policy, kw):
  """generate's fixed-capacity cache (slots reused) attends exactly like cached_logits' cache."""
  m = _model("fpa", step_init_std=0.3)
  prompt = _tokens(2, 10, m.cfg.vocab_size, seed=4)
  out, stats = generate(m, prompt, 8, policy=policy, prefill="decode", **kw)
  assert stats["capacity"] == kw["budget"]
  seq = jnp.concatenate([prompt, jnp.asarray(out)], axis=1)
  logits, _ = cached_logits(m, seq, policy=policy, **kw)
  np.testing.assert_array_equal(np.argmax(np.asarray(logits[:, 9:-1]), -1), out)


@pytest.mark.xla_default
@pytest.mark.parametrize(
  "policy,kw",
  [
    ("fpa_budget", dict(budget=5)),
    pytest.param("h2o", dict(budget=6), marks=pytest.mark.slow),
    pytest.param("fpa_threshold", dict(threshold=0.5, budget=7), marks=pytest.mark.slow),
  ],
)
def test_inactive_rows_keep_their_cache_bit_for_bit(policy, kw):
  """decode_attend(active=...) (a decode prefill's rows past their prompt): an inactive row's cache,
  k and v included, is the one it came in with, through steps that evict in the other rows; an
  active row's cache and output are those of the call without `active`."""
  from fpa_jax.inference import cache as K
  from fpa_jax.inference.policies import make_policy

  b, kvh, h, dk, n = 3, 2, 4, 8, 14
  pol = make_policy(policy, n, **kw)
  rng = np.random.default_rng(0)
  x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  step = jax.jit(lambda c, q, k, v, f, l, t, a: K.decode_attend(
    c, q, k, v, f, l, f, policy=pol, scale=dk**-0.5, positions=jnp.full((b,), t), active=a
  ))  # fmt: skip
  thr = None if pol.threshold is None else np.full(kvh, pol.threshold)
  cache, everyone = K.init_layer_cache(b, pol.capacity, kvh, dk, threshold=thr), None
  for t in range(n):
    args = (x(b, 1, h, dk), x(b, 1, kvh, dk), x(b, 1, kvh, dk), x(b, 1, kvh), x(b, 1, kvh), t)
    active = jnp.asarray([True, t < 6, t % 3 != 0])  # row 1 ends its prompt at 6; row 2 skips steps
    out, new = step(cache, *args, active)
    out_all, new_all = step(cache, *args, everyone)
    for f in set(K.LayerCache._fields) - {"threshold", "key_coef", "key_cap"}:  # those are per head
      got, before, want = (np.asarray(getattr(c, f)) for c in (new, cache, new_all))
      for r in range(b):
        np.testing.assert_array_equal(got[r], want[r] if active[r] else before[r], err_msg=f"{f}, row {r}, step {t}")
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(active)], np.asarray(out_all)[np.asarray(active)])
    cache = new
  assert int(np.asarray(cache.alive)[0].sum(0).max()) == pol.capacity  # row 0 filled up and evicted


@pytest.mark.slow  # test_policies' prefill checks
def test_parallel_prefill_keeps_the_same_keys_as_decode():
  m = _model("fpa", step_init_std=0.3)
  prompt = _tokens(2, 16, m.cfg.vocab_size, seed=5)
  for policy, kw in [
    ("fpa_threshold", dict(threshold=1.0)),
    ("fpa_budget", dict(budget=6)),
    ("window", dict(budget=6)),
    ("sink_window", dict(budget=6)),
  ]:
    pol = make_policy(policy, 17, **kw)
    caches = D.init_caches(m, 2, pol, 17)
    graphdef, state = nnx.split(m)
    lengths = jnp.array([16, 11])
    pos16 = jnp.broadcast_to(jnp.arange(16), (2, 16))
    run = K.Prefill(pol, lengths)
    # jitted (an eager prefill dispatches the chunked kernel op by op); the per-layer caches come out
    prefill = jax.jit(
      lambda state, c: nnx.merge(graphdef, state)(prompt, positions=pos16, cache=K.LayerCaches(c, run))[1].layers
    )
    par = prefill(state, caches)
    step = jax.jit(
      lambda state, c, tok, t: D.Decoder(nnx.merge(graphdef, state), pol, max_len=17).step(c, tok, jnp.full((2,), t))[1]
    )
    dec = D.init_caches(m, 2, pol, 17)
    for t in range(16):
      dec = step(state, dec, prompt[:, t], t).select_rows(t < lengths, dec)
    key_set = lambda c: [
      [sorted(np.asarray(c.pos[b, :, h])[np.asarray(c.alive[b, :, h])].tolist()) for h in range(c.pos.shape[2])]
      for b in range(2)
    ]
    # Layer 0 sees the same inputs either way (deeper layers see the prompt's full-cache attention
    # under parallel prefill); fpa_budget's greedy order may keep other keys than its final ranking.
    if policy != "fpa_budget":
      assert key_set(par[0]) == key_set(dec[0]), policy
    assert_close(par[0].carry, dec[0].carry, n=16 * m.cfg.d_model)  # a sum over 16 steps of gate read-outs
    assert all(int(jnp.max(jnp.sum(c.alive, 1))) <= pol.capacity for c in par)


@pytest.mark.parametrize(
  "att,kw",
  [
    ("fpa", dict(attn_impl="pallas")),  # the Pallas kernels (interpret mode on CPU)
    pytest.param("fpa", dict(skip_tolerance=0.5, skip="keys", block_size=4), marks=pytest.mark.slow),
    ("fox", dict(skip_tolerance=0.5, skip="keys", block_size=4)),
  ],
)
def test_parallel_prefill_runs_the_layers_impl(att, kw, monkeypatch):
  """A prefill attends through the layers' own kernel (`layers.AttentionSpec`: impl, tiles,
  skipping), not a default chunked one: its logits equal the parallel forward's."""
  from fpa_jax import ops

  m = _model(att, **kw)
  prompt = _tokens(2, 12, m.cfg.vocab_size, seed=6)
  calls = []
  for name in ("fpa_attention", "fox_attention"):
    orig = getattr(ops, name)

    def spy(*a, _orig=orig, _name=name, **k):
      calls.append((_name, k.get("impl"), k.get("block_size"), k.get("skip", "tiles"), k.get("skip_tolerance")))
      return _orig(*a, **k)

    monkeypatch.setattr(ops, name, spy)
  pol = make_policy("full", 12)
  graphdef, state = nnx.split(m)
  run = jax.jit(lambda state: D.prefill_parallel(nnx.merge(graphdef, state), prompt, jnp.array([12, 7]), pol, 12)[0])
  logits = run(state)
  spec = m.blocks[0].attn.spec
  op = "fpa_attention" if att == "fpa" else "fox_attention"
  want = (op, spec.impl, spec.block_size, spec.skip, spec.skip_tolerance)
  assert want[1:] == (
    kw.get("attn_impl", "chunked"),
    kw.get("block_size"),
    kw.get("skip", "tiles"),
    kw.get("skip_tolerance"),
  )
  assert calls == [want] * m.cfg.n_layers  # one call per layer, with the model's impl and skipping
  assert_close(logits, forward(m, prompt), n=m.cfg.d_model * m.cfg.n_layers)


# ------------------------------------------------------------------------------------------------ errors, loading


def test_clear_errors():
  m = _model("fpa")
  tok = _tokens(1, 8, m.cfg.vocab_size)
  with pytest.raises(ValueError, match="unknown policy"):
    cached_logits(m, tok, policy="lru")
  with pytest.raises(ValueError, match="budget must be > 0"):
    cached_logits(m, tok, policy="window", budget=0)
  with pytest.raises(ValueError, match="needs a budget"):
    cached_logits(m, tok, policy="fpa_budget")
  with pytest.raises(ValueError, match="tolerance in"):
    cached_logits(m, tok, policy="fpa", tolerance=2.0)
  with pytest.raises(ValueError, match="keeps all"):
    generate(m, tok, 4, policy="full", budget=10)
  with pytest.raises(ValueError, match="vocab_size"):
    cached_logits(m, tok + 1000)
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    load_model("/nonexistent/run")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A 2-step `tiny` fpa run with a byte vocabulary on one device: (workdir, trainer summary)."""
  from fpa_jax import sharding as S
  from fpa_jax.train import train

  wd = tmp_path_factory.mktemp("run")
  cfg = C.get_config("tiny", attention="fpa", task="synthetic", steps=2, ckpt_every=2, vocab_size=259)
  mesh = S.make_mesh(None, devices=jax.devices()[:1])  # loading is mesh-independent; one compile
  return wd, train(cfg, workdir=str(wd), progress=False, log=lambda s: None, mesh=mesh)


def test_load_model_round_trip(trained_run):
  wd, out = trained_run
  model, cfg = load_model(wd)
  assert cfg == out["config"]
  trained, _ = nnx.merge(out["graphdef"], out["state"])
  tok = _tokens(2, 12, cfg.vocab_size)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(trained, nnx.Param))):
    assert_bitwise(a, b)  # the restored weights are exactly the trained ones
  # ... and the forward pass of each (jitted: eager dispatch compiles op by op) agrees; they are
  # two compiles of one program, equal up to reduction order.
  fwd = nnx.jit(lambda m, t: m(t))
  assert_close(fwd(model, tok), fwd(trained, tok), n=cfg.d_model * cfg.n_layers)


def test_generate_cli(trained_run, tmp_path, capsys):
  from fpa_jax.inference import __main__ as cli

  wd, _ = trained_run
  rc = cli.main(
    ["--workdir", str(wd), "--prompt", "ab", "--max-new-tokens", "3", "--policy", "fpa_budget", "--budget", "0.5"]
  )
  out = capsys.readouterr().out.splitlines()
  assert rc == 0 and out[0].startswith("ab") and '"policy": "fpa_budget"' in out[-1]
  assert cli.main(["--workdir", str(tmp_path / "nope"), "--prompt", "x"]) == 2


def test_export_round_trip_and_mismatch(tmp_path):
  """export_model / load_exported: the same logits after the round trip; arrays that do not fit the
  config are refused with the parameter's name."""
  from fpa_jax.inference import export_model, load_exported
  from fpa_jax.models import DecoderLM

  cfg = C.get_config("tiny")
  model = DecoderLM(cfg.model, rngs=nnx.Rngs(params=5))
  export_model(model, cfg, tmp_path / "m", meta={"command": "test"})
  got, cfg2, meta = load_exported(tmp_path / "m")
  t = jnp.arange(24)[None] % cfg.model.vocab_size
  assert_bitwise(got(t), model(t))
  assert cfg2 == cfg and meta == {"command": "test"}
  z = dict(np.load(tmp_path / "m" / "params.npz"))
  name = sorted(z)[0]
  z[name] = z[name][..., :1]
  np.savez(tmp_path / "m" / "params.npz", **z)
  with pytest.raises(ValueError, match=name.replace(".", r"\.")):
    load_exported(tmp_path / "m")
