"""The utility target of the levels (`fpa_jax.ops.utility`) against float64 loops, and its objective
(`fpa_jax.losses.utility_loss`): labels, the balanced cross-entropy, and where its gradient goes."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fpa_jax.configs import ModelConfig, TrainConfig
from fpa_jax.losses import objective, utility_loss
from fpa_jax.models import DecoderLM
from fpa_jax.ops import evictability as E
from fpa_jax.ops import utility as UT


def utility_loops(q, k, v, field, level, queries, seg=None):
  """U [B, Q, T, KVH] by the definition, float64 loops."""
  q, k, v, field, level = (np.asarray(a, np.float64) for a in (q, k, v, field, level))
  b, t, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  seg = np.zeros((b, t), int) if seg is None else np.asarray(seg)
  a = np.zeros((b, h, t, t))
  for bi in range(b):
    for hi in range(h):
      kh = hi // g
      for i in range(t):
        logits = np.full(t, -np.inf)
        for j in range(i + 1):
          if seg[bi, j] != seg[bi, i]:
            continue
          low = min(field[bi, j + 1 : i + 1, kh], default=np.inf)
          pen = max(0.0, level[bi, j, kh] - low)
          logits[j] = q[bi, i, hi] @ k[bi, j, kh] / math.sqrt(d) - pen
        w = np.exp(logits - logits.max())
        a[bi, hi, i] = w / w.sum()
  out = np.zeros((b, queries.shape[1], t, kvh))
  for bi in range(b):
    for qq, i in enumerate(queries[bi]):
      for j in range(t):
        for kh in range(kvh):
          best = 0.0
          for i2 in range(i, t):
            for hi in range(kh * g, (kh + 1) * g):
              best = max(best, a[bi, hi, i2, j] * np.linalg.norm(v[bi, j, kh]))
          out[bi, qq, j, kh] = best
  return out


@pytest.mark.parametrize("h,kvh,with_seg", [(2, 2, False), (4, 2, True), (2, 1, False)])
def test_key_utility_matches_loops(h, kvh, with_seg):
  rng = np.random.default_rng(h * 10 + kvh)
  b, t, d = 2, 11, 4
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k, v = (rng.normal(size=(b, t, kvh, d)).astype(np.float32) for _ in range(2))
  field = rng.normal(size=(b, t, kvh)).astype(np.float32)
  level = (field + rng.normal(size=field.shape)).astype(np.float32)
  queries = np.array([[3, 7, 10], [0, 5, 9]], np.int32)
  seg = np.array([[0] * 6 + [1] * 5, [0] * t]) if with_seg else None
  got = UT.key_utility(*(jnp.asarray(a) for a in (q, k, v, field, level, queries)), segment_ids=seg)
  want = utility_loops(q, k, v, field, level, queries, seg)
  # fp32 softmax of O(1) logits, a max of products: relative error a few ulps of fp32
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_key_utility_is_zero_after_the_query_and_has_no_gradient():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 4)), jnp.float32) for _ in range(2))
  f = jnp.asarray(rng.normal(size=(1, 8, 2)), jnp.float32)
  qi = jnp.array([[4]])
  u = UT.key_utility(q, k, v, f, f, qi)
  # a key after the query can still be read by a later query: U is a max over i' >= i, so only
  # keys no query at or after i reads are 0 (none here) -- but the gradient is always 0
  assert np.all(np.asarray(u) > 0)
  grads = jax.grad(lambda q, f: UT.key_utility(q, k, v, f, f, qi).sum(), argnums=(0, 1))(q, f)
  assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)


def test_key_utility_rejects_bad_shapes():
  z = jnp.zeros((1, 4, 3, 2))
  with pytest.raises(ValueError, match="multiple of the kv heads"):
    UT.key_utility(
      z,
      jnp.zeros((1, 4, 2, 2)),
      jnp.zeros((1, 4, 2, 2)),
      jnp.zeros((1, 4, 2)),
      jnp.zeros((1, 4, 2)),
      jnp.zeros((1, 1), int),
    )
  with pytest.raises(ValueError, match=r"field and level must both be \[B, T, KVH\]"):
    UT.key_utility(z, z, z, jnp.zeros((1, 4, 2)), jnp.zeros((1, 4, 2)), jnp.zeros((1, 1), int))


def test_keep_labels_top_share_of_eligible():
  u = jnp.asarray([[[[5.0], [1.0], [3.0], [2.0], [9.0], [0.0]]]])  # [1, 1, 6, 1]
  elig = jnp.asarray([[[True, True, True, True, False, False]]])  # 4 eligible; the 9 is not
  np.testing.assert_array_equal(np.asarray(UT.keep_labels(u, elig, 0.25))[0, 0, :, 0], [1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(np.asarray(UT.keep_labels(u, elig, 0.5))[0, 0, :, 0], [1, 0, 1, 0, 0, 0])
  # ceil: 0.3 of 4 keeps 2
  np.testing.assert_array_equal(np.asarray(UT.keep_labels(u, elig, 0.3))[0, 0, :, 0], [1, 0, 1, 0, 0, 0])
  none = UT.keep_labels(u, jnp.zeros_like(elig), 0.5)
  assert not bool(none.any())
  with pytest.raises(ValueError, match="keep must be in"):
    UT.keep_labels(u, elig, 0.0)


def test_utility_bce_against_the_formula():
  rng = np.random.default_rng(1)
  pen = rng.uniform(0, 8, size=(2, 3, 5, 2))
  lab = rng.uniform(size=pen.shape) < 0.3
  elig = rng.uniform(size=pen.shape[:3]) < 0.8
  tau, temp = 4.0, 1.0
  live = 1 / (1 + np.exp(-(tau - pen) / temp))
  e = np.broadcast_to(elig[..., None], pen.shape)
  pos, neg = e & lab, e & ~lab
  want = 0.5 * (-np.log(live[pos]).mean() + -np.log(1 - live[neg]).mean())
  got = UT.utility_bce(jnp.asarray(pen, jnp.float32), jnp.asarray(lab), jnp.asarray(elig), tau=tau, temp=temp)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_pair_penalties_sum_to_live_counts():
  rng = np.random.default_rng(2)
  f = jnp.asarray(rng.normal(size=(2, 12, 3)), jnp.float32)
  lv = f + jnp.asarray(rng.normal(size=f.shape), jnp.float32)
  qi = jnp.array([[4, 11], [7, 9]])
  pen, hard, elig = E.pair_penalties(f, lv, qi, window=2, soft=0.5)
  c = E.live_counts(f, lv, qi, window=2, tau=4.0, temp=1.0, soft=0.5)
  np.testing.assert_allclose(np.asarray(c.eligible), np.asarray(elig.sum(-1)))
  soft = (elig[..., None] * jax.nn.sigmoid(4.0 - pen)).sum(2)
  np.testing.assert_allclose(np.asarray(c.soft), np.asarray(soft), rtol=1e-6)


@pytest.fixture(scope="module")
def tiny():
  cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, attention="fpa")
  return DecoderLM(cfg, rngs=nnx.Rngs(0))


@pytest.mark.slow  # its wiring into the objective: test_objective_adds_the_weighted_utility
def test_utility_loss_reaches_only_the_gate(tiny):
  """The labels carry no gradient: only the gates and what feeds them move."""
  tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 32)
  graph, params, rest = nnx.split(tiny, nnx.Param, ...)

  def loss(p):
    _, u, m = utility_loss(nnx.merge(graph, p, rest), tokens, key=jax.random.key(0), window=4, queries=4)
    return u, m

  (u, m), g = jax.value_and_grad(loss, has_aux=True)(params)
  assert np.isfinite(float(u)) and float(u) > 0
  assert {"utility_loss", "utility_recall", "utility_evicted", "utility_recall_l1"} <= set(m)
  moved = {"/".join(map(str, p)) for p, x in nnx.to_flat_state(g) if float(jnp.abs(x.get_value()).max()) > 0}
  # the labels carry no gradient: the loss reaches the gates, and what feeds them (the layers below,
  # the embedding), never the last layer's projections, its MLP or the read-out
  assert any("blocks/1/attn/gate" in p for p in moved) and any("blocks/0/attn/gate" in p for p in moved)
  fed = ("/gate/", "attn_norm")  # the gate reads the normed block input
  assert not [p for p in moved if p.startswith("blocks/1/") and not any(f in p for f in fed)], sorted(moved)
  with pytest.raises(ValueError, match="unknown argument"):
    utility_loss(tiny, tokens, key=jax.random.key(0), target=0.1)


def test_objective_adds_the_weighted_utility(tiny):
  from fpa_jax.configs import Config

  cfg = Config(**{**tiny.cfg.__dict__}, utility_weight=0.5, evict_window=4, evict_queries=4, seq_len=40)
  tokens = jax.random.randint(jax.random.key(1), (2, 41), 0, 32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": jnp.ones((2, 40), jnp.int32),
    "loss_mask": jnp.ones((2, 40), jnp.int32),
  }
  total, aux = objective(tiny, batch, cfg, 0, jax.random.key(3))
  assert float(aux["count"]) == 80
  # the weighted term is exactly what the utility loss on the same draw gives
  assert total == pytest.approx(float(aux["lm_sum"]) + 80 * 0.5 * float(aux["utility_loss"]), rel=1e-5)
  with pytest.raises(ValueError, match="utility_weight > 0 needs a gated attention"):
    Config(**{**tiny.cfg.__dict__, "attention": "softmax"}, utility_weight=0.5).validate()
  assert TrainConfig().utility_weight == 0.0  # off by default: the objective is the plain LM loss


def test_objective_layers_press_only_the_named_layers(tiny):
  from fpa_jax.configs import Config
  from fpa_jax.losses import gated_attention_inputs, utility_terms

  cfg = Config(**{**tiny.cfg.__dict__}, utility_weight=1.0, evict_window=4, evict_queries=4, seq_len=40)
  tokens = jax.random.randint(jax.random.key(1), (2, 41), 0, 32)
  seg = jnp.ones((2, 40), jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "loss_mask": seg}
  key = jax.random.key(3)
  _, top = objective(tiny, batch, dataclasses.replace(cfg, objective_layers="1"), 0, key)
  _, per_layer = gated_attention_inputs(tiny, batch["inputs"], seg)
  opts = dict(keep=0.1, window=4, tau=4.0, temp=1.0, soft=0.5, queries=4)
  want, _ = utility_terms(per_layer[1:], jax.random.fold_in(key, 2), seg, **opts)
  assert float(top["utility_loss"]) == pytest.approx(float(want), rel=1e-6)
  assert "utility_recall_l1" not in top  # one layer pressed: its metrics are _l0
  with pytest.raises(ValueError, match="objective_layers='1' \\(the top layer\\)"):
    dataclasses.replace(cfg, objective_layers="2").validate()
