"""Per-head gate kinds (`ModelConfig.head_gates`): which read-outs feed each head of each layer, the
same in the parallel path and in decoding; a no-walk head ("n") has a field that cannot drift."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _fwd import forward
from _tol import assert_close
from fpa_jax import configs as C
from fpa_jax.inference import cached_logits
from fpa_jax.models import build_model

RANDOM_GATE = dict(step_init_std=0.05, absolute_init_std=0.05, offset_init_std=0.05, gate_init_std=0.3)


def _cfg(**kw):
  return C.get_config("tiny", **{"attention": "fpa", "gate_forget": True, "n_heads": 4, **RANDOM_GATE, **kw})


@pytest.fixture(scope="module")
def mixed():
  """tiny (2 layers) with the lower layer FPA / FoX heads and the upper one no-walk / FPA heads."""
  return build_model(_cfg(head_gates="ppff,nnpn"), seed=0)


def test_kinds_mask_the_read_outs(mixed):
  """Each head's field and level use exactly the terms of its kind: 'n' has no accumulated part (a
  bounded field), 'f' no extremum read-out, 'p' all of them."""
  x = jax.random.normal(jax.random.key(3), (2, 9, mixed.cfg.d_model))
  for layer, kinds in enumerate(("ppff", "nnpn")):
    g = mixed.blocks[layer].attn.gate
    assert g.head_kinds == kinds
    parts = g.parts(x)
    raw_inc = jax.nn.log_sigmoid(g.forget(x)) + g.step(x)
    raw_fox = jax.nn.log_sigmoid(g.forget(x))
    for h, k in enumerate(kinds):
      want_inc = {"p": raw_inc, "f": raw_fox, "n": jnp.zeros_like(raw_inc)}[k][..., h]
      np.testing.assert_allclose(parts.increment[..., h], want_inc, rtol=1e-6, atol=1e-7)
      for name, term in (("absolute", parts.absolute), ("offset", parts.offset)):
        want = getattr(g, name)(x)[..., h] if k in "pn" else jnp.zeros_like(term[..., h])
        np.testing.assert_allclose(term[..., h], want, rtol=1e-6, atol=1e-7)
  # a no-walk head's field is its absolute read-out alone: bounded, whatever the sequence length
  field, level = mixed.blocks[1].attn.gate(x)
  np.testing.assert_allclose(field[..., 0], mixed.blocks[1].attn.gate.absolute(x)[..., 0], rtol=1e-6)


def test_fox_heads_is_the_f_kind():
  """fox_heads=N is head_gates 'f' * N + 'p' * rest on every layer: the same logits, same params."""
  a = build_model(_cfg(fox_heads=1), seed=0)
  b = build_model(_cfg(head_gates="fppp"), seed=0)
  tok = jax.random.randint(jax.random.key(1), (2, 13), 0, a.cfg.vocab_size)
  np.testing.assert_array_equal(forward(a, tok), forward(b, tok))


@pytest.mark.parametrize("name", ["mixed", "leaky"])
def test_decoding_masks_the_same_heads(name, request):
  """The cache's decode step reads each head's kind as the parallel path does (multi-tile prompt),
  and carries a leaky walk as the parallel scan computes it."""
  model = request.getfixturevalue(name)
  tok = jax.random.randint(jax.random.key(2), (2, 37), 0, model.cfg.vocab_size)
  logits, _ = cached_logits(model, tok)
  assert_close(logits, forward(model, tok), n=model.cfg.d_model * model.cfg.n_layers)


def test_a_missing_term_gets_no_gradient(mixed):
  """A head's kind holds the read-outs it lacks at 0, so their weights get no gradient there."""
  tok = jax.random.randint(jax.random.key(4), (2, 11), 0, mixed.cfg.vocab_size)

  def loss(m):
    return jnp.mean(forward(m, tok) ** 2)

  grads = nnx.grad(loss)(mixed)
  up = grads.blocks[1].attn.gate
  # upper layer "nnpn": forget and step reach head 2 only; absolute and offset every head
  for name in ("forget", "step"):
    gw = np.asarray(getattr(up, name).w[...])
    assert np.all(gw[:, [0, 1, 3]] == 0) and np.any(gw[:, 2] != 0)
  assert np.all(np.any(np.asarray(up.absolute.w[...]) != 0, axis=0))
  low = grads.blocks[0].attn.gate  # "ppff": no step / absolute / offset on heads 2, 3
  for name in ("step", "absolute", "offset"):
    gw = np.asarray(getattr(low, name).w[...])
    assert np.all(gw[:, 2:] == 0) and np.all(np.any(gw[:, :2] != 0, axis=0))


@pytest.mark.parametrize(
  "kw,msg",
  [
    (dict(head_gates="ppp"), "one group of kv_heads=4 letters"),
    (dict(head_gates="pppp,pppp,pppp"), "one per layer (n_layers=2)"),
    (dict(head_gates="ppxp"), "unknown kind(s) ['x']"),
    (dict(head_gates="pppn", fox_heads=1), "set fox_heads=0"),
    (dict(head_gates="pppp,nnnn", scan_layers=True), "set scan_layers=False"),
    (dict(head_gates="pppn", gate_terms_override="step"), "kind 'n' keeps ('absolute', 'offset')"),
    (dict(head_gates="ppll"), "a leaky head ('l') needs walk_leak in (0, 1)"),
    (dict(head_gates="pppp", walk_leak=0.1), "walk_leak > 0 needs an 'l' head"),
    (dict(head_gates="pppl", walk_leak=1.0), "walk_leak"),
    (dict(attention="fox", head_gates="ffff,ffll", walk_leak=0.1), "set attention='fpa'"),
  ],
)
def test_bad_head_gates_say_what_to_change(kw, msg):
  with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
    _cfg(**kw).validate()


def test_same_kinds_everywhere_scan():
  """One group for every layer is what a scanned stack can hold: same logits as the unscanned model."""
  from fpa_jax.models import convert_layers

  m = build_model(_cfg(head_gates="pnfn"), seed=0)
  s = convert_layers(m, True)
  tok = jax.random.randint(jax.random.key(5), (2, 13), 0, m.cfg.vocab_size)
  assert_close(forward(s, tok), forward(m, tok), n=m.cfg.d_model * m.cfg.n_layers)


# --- the leaky walk ("l" heads, `walk_leak`) ---


def leaky_walk_np(inc, retain, carry=None, seg=None):
  """walk_t = r_h walk_{t-1} + inc_t by loops in float64: inc [B, T, H], carry [B, H], seg [B, T]."""
  inc = np.asarray(inc, np.float64)
  b, t, h = inc.shape
  out = np.zeros_like(inc)
  for bi in range(b):
    for hi in range(h):
      w = 0.0 if carry is None else float(carry[bi, hi])
      for ti in range(t):
        if seg is not None and ti and seg[bi, ti] != seg[bi, ti - 1]:
          w = 0.0
        w = retain[hi] * w + inc[bi, ti, hi]
        out[bi, ti, hi] = w
  return out


@pytest.mark.parametrize("t", [1, 7, 40])
@pytest.mark.parametrize("with_carry", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_leaky_walk_matches_loop_reference(t, with_carry, packed):
  """Values against the float64 loop (carry, packed segments, a head that does not leak), and the
  gradient against finite differences of the loop."""
  from fpa_jax.gates import leaky_walk

  rng = np.random.default_rng(t + 10 * with_carry + 100 * packed)
  b, h = 2, 3
  retain = (1.0, 0.9, 0.5)
  inc = rng.normal(size=(b, t, h))
  carry = rng.normal(size=(b, h)) if with_carry else None
  seg = np.sort(rng.integers(1, 4, size=(b, t)), axis=1) if packed else None
  j = lambda a: None if a is None else jnp.asarray(a)
  got = leaky_walk(jnp.asarray(inc, jnp.float32), retain, j(carry), j(seg))
  assert_close(got, leaky_walk_np(inc, retain, carry, seg), dtype=np.float32, n=t)
  ct = rng.normal(size=(b, t, h))
  g = jax.grad(lambda x: jnp.sum(leaky_walk(x, retain, j(carry), j(seg)) * ct))(jnp.asarray(inc, jnp.float32))
  eps, fd = 1e-6, np.zeros_like(inc)
  for idx in np.ndindex(inc.shape):
    up, dn = inc.copy(), inc.copy()
    up[idx] += eps
    dn[idx] -= eps
    fd[idx] = np.sum((leaky_walk_np(up, retain, carry, seg) - leaky_walk_np(dn, retain, carry, seg)) * ct) / (2 * eps)
  assert_close(g, fd, dtype=np.float32, n=t)


@pytest.fixture(scope="module")
def leaky():
  """tiny with leaky heads beside plain, FoX and no-walk ones, a fast leak (visible in 40 tokens)."""
  return build_model(_cfg(head_gates="plfp,nlpl", walk_leak=0.25), seed=0)


def test_leaky_heads_walk_within_their_band(leaky):
  """A leaky head's field is its leaky walk plus its absolute read-out; every other head's as before."""
  x = jax.random.normal(jax.random.key(3), (2, 40, leaky.cfg.d_model))
  g = leaky.blocks[1].attn.gate
  parts = g.parts(x)
  field, _ = g(x)
  walk = leaky_walk_np(parts.increment, (1.0, 0.75, 1.0, 0.75))
  assert_close(field, walk + np.asarray(parts.absolute), dtype=np.float32, n=40)
  band = np.abs(np.asarray(parts.increment)).max(axis=1) / 0.25  # |walk| <= max |inc| / leak
  assert np.all(np.abs(walk[..., [1, 3]]) <= band[:, None, [1, 3]] * (1 + 1e-9))


def test_leaky_walk_restarts_per_packed_document(leaky):
  """A packed row's second document sees the logits it has alone: nothing leaks across documents."""
  tok = jax.random.randint(jax.random.key(6), (1, 30), 0, leaky.cfg.vocab_size)
  seg = jnp.asarray([[1] * 12 + [2] * 18])
  packed = forward(leaky, tok, seg)[:, 12:]
  alone = forward(leaky, tok[:, 12:])
  assert_close(packed, alone, n=leaky.cfg.d_model * leaky.cfg.n_layers)
