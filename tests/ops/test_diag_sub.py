"""Sub-tiled diagonal tiles of the chunked kernel (`bias.DIAG_SUB`): a diagonal tile of n >=
2 * DIAG_SUB tokens takes its bias from per-sub-tile statistics instead of an in-tile scan. It
must agree with the in-tile scan (`_diag_bias`) and the numpy loop penalty in values, and with the
scan's pullback in gradients; end to end, chunked at such blocks must match `quadratic`.

The tile-level tests set DIAG_SUB small, so small tiles exercise many sub-tiles, and trace fresh
functions (no jit cache shared with other tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tol import assert_bitwise, assert_close
from fpa_jax.ops import bias
from fpa_jax.ops import reference_np as ref
from test_grad import assert_grads_close, assert_loss_close, jax_grads, make_inputs


def _tile_inputs(seed, n, gates, lead=(2, 3)):
  rng = np.random.default_rng(seed)
  if gates == "ties":  # integer shared walk: equal field values everywhere
    phi = np.cumsum(rng.integers(-1, 2, size=lead + (n,)), -1).astype(np.float32)
    lvl = phi.copy()
  else:  # distinct fields (no ties), levels around them: both penalty branches occur
    phi = np.cumsum(rng.normal(size=lead + (n,)), -1).astype(np.float32)
    lvl = (phi + rng.normal(scale=2.0, size=phi.shape)).astype(np.float32)
  return jnp.asarray(lvl), jnp.asarray(phi)


def _sub_bias(lvl, phi):
  """The sub-tiled bias of one tile, [..., n] -> [..., n, n], through `FPABias.stats`' path."""
  a, c, ps = bias._sub_stats(phi[..., None, :], bias._diag_sub(phi.shape[-1]))
  return bias._diag_bias_tiled(lvl, a[..., 0, :, :], c[..., 0, :, :], ps[..., 0, :, :])


@pytest.mark.parametrize("n,sub", [(16, 8), (32, 8), (24, 8), (64, 16)])
@pytest.mark.parametrize("gates", ["walk", "ties"])
def test_sub_tiled_bias_equals_in_tile_scan_and_loop_penalty(monkeypatch, n, sub, gates):
  monkeypatch.setattr(bias, "DIAG_SUB", sub)
  lvl, phi = _tile_inputs(0, n, gates)
  got, want = np.asarray(jax.jit(_sub_bias)(lvl, phi)), np.asarray(jax.jit(bias._diag_bias)(lvl, phi))
  causal = np.tril(np.ones((n, n), bool))
  # min and relu are exact in fp32: the two formulations agree bitwise on the causal part.
  assert_bitwise(got[..., causal], want[..., causal])
  pen = np.stack([ref.penalty_np(p, l) for p, l in zip(np.asarray(phi[0], np.float64), np.asarray(lvl[0], np.float64))])
  # float64 reference: differences of fields (a running min, no sums), at the fields' scale
  assert_close(-got[0][:, causal], pen[:, causal], dtype=np.float32, scale=np.abs(phi).max() + np.abs(lvl).max())
  assert np.all(np.isfinite(got))  # above-diagonal sub-tiles: finite (the causal mask drops them)


@pytest.mark.parametrize(
  "gates,n,sub",
  [
    pytest.param("walk", 32, 8, marks=pytest.mark.slow),
    ("walk", 64, 16),
    ("ties", 32, 8),
    pytest.param("ties", 64, 16, marks=pytest.mark.slow),
  ],
)
def test_sub_tiled_bias_pullback_matches_in_tile_scan(monkeypatch, n, sub, gates):
  monkeypatch.setattr(bias, "DIAG_SUB", sub)
  lvl, phi = _tile_inputs(1, n, gates)
  # Cotangents only on the causal part, as in the kernel (masked logits get exactly 0).
  ct = jnp.asarray(np.random.default_rng(2).normal(size=lvl.shape + (n,)) * np.tril(np.ones((n, n))), jnp.float32)
  vjp = lambda f: jax.jit(lambda l, p: jax.vjp(f, l, p)[1](ct))(lvl, phi)
  got, want = vjp(_sub_bias), vjp(bias._diag_bias)
  for name, g, w in zip(("level", "field"), got, want):
    assert np.all(np.isfinite(np.asarray(g))), name
    if gates == "walk":  # on ties the two pick different (valid) subgradients
      assert_close(g, w, n=n, err_msg=name)  # sums of n cotangents
  # Each subgradient is a valid split: the total mass routed to (level, field) is conserved. The
  # totals cancel (d/dlevel = +ct, d/dfield = -ct where a pair is active), so the rounding scale is
  # that of the summed |cotangents|, not of the near-zero totals.
  mass = float(np.abs(np.asarray(ct)).sum(axis=(-2, -1)).max())
  assert_close(got[0].sum(-1) + got[1].sum(-1), want[0].sum(-1) + want[1].sum(-1), n=n * n, scale=mass)


def test_small_tiles_keep_the_in_tile_scan():
  assert bias._diag_sub(bias.DIAG_SUB) is None  # one sub-tile: nothing to split
  assert bias._diag_sub(2 * bias.DIAG_SUB + 8) is None  # not a multiple of the sub-tile
  assert bias._diag_sub(4 * bias.DIAG_SUB) == bias.DIAG_SUB


@pytest.mark.slow
@pytest.mark.parametrize(
  "seed,t,blk,gates,seg",
  [
    # The default DIAG_SUB at the library's block sizes: 2 and 4 sub-tiles per diagonal tile, T
    # not a multiple of the block, segments across tile and sub-tile borders.
    (10, 300, 128, "kink_free", "unsorted"),
    (11, 300, 256, "spikes", "sorted"),
  ],
)
def test_chunked_with_sub_tiled_diagonal_matches_quadratic(seed, t, blk, gates, seg):
  assert bias._diag_sub(blk) is not None
  args, ct, seg = make_inputs(seed, 1, t, 2, 4, 3, gates, seg)
  val_q, want = jax_grads(args, ct, seg, "quadratic", None)
  val, got = jax_grads(args, ct, seg, "chunked", blk)
  assert_loss_close(val, val_q, ct, n=t)
  assert_grads_close(got, want, n=t, msg=f"chunked block={blk} vs quadratic")
  assert np.abs(got[3]).max() > 0 and np.abs(got[4]).max() > 0
