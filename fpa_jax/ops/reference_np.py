"""Float64 numpy loop references, written straight from the definitions (tests only).

Nothing here is vectorised or clever: every function loops over the indices of the formula it
implements, so that it can be checked by eye and used as ground truth for the JAX ops.

    penalty[i, j] = max(0, level_j - min(field_{j+1}, ..., field_i))   j <= i  (0 on the diagonal)
                    (as "level_j - min if level_j > min else 0": defined for infinite levels too,
                    e.g. level_j = +inf gives 0 on the diagonal and +inf once a finite field
                    value lies in (j, i], a dead key whose weight is exactly 0)
    out_i         = sum_j softmax_j(scale * q_i.k_j - penalty[i, j]) v_j,  j <= i,
                    and seg_j == seg_i when segment ids are given.
"""

from __future__ import annotations

import math

import numpy as np


def penalty_np(field, level):
  """First-passage penalty of one sequence.

  Args:
    field: [T] field value phi_t of each token.
    level: [T] level l_j of each key.
  Returns:
    [T, T] float64: penalty[i, j] for query i, key j; +inf for j > i (not causal).
  """
  field = np.asarray(field, np.float64)
  level = np.asarray(level, np.float64)
  assert field.shape == level.shape and field.ndim == 1
  t = field.shape[0]
  pen = np.full((t, t), np.inf)
  for i in range(t):
    for j in range(i + 1):
      if j == i:
        pen[i, j] = 0.0
      else:
        lowest = min(float(field[s]) for s in range(j + 1, i + 1))
        lv = float(level[j])
        pen[i, j] = lv - lowest if lv > lowest else 0.0  # no inf - inf for lv = lowest = +-inf
  return pen


def _attend_np(q, k, v, bias_fn, scale, segment_ids):
  """Loop attention: out[b, i, h] = sum_j softmax_j(scale q.k + bias_fn(b, h)[i, j]) v[b, j, h].

  q, k: [B, T, H, K]; v: [B, T, H, Kv]; bias_fn(b, h) -> [T, T] additive bias (j <= i used).
  Returns [B, T, H, Kv] float64.
  """
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  v = np.asarray(v, np.float64)
  bsz, t, heads, d = q.shape
  dv = v.shape[-1]
  scale = d**-0.5 if scale is None else float(scale)
  seg = None if segment_ids is None else np.asarray(segment_ids)
  out = np.zeros((bsz, t, heads, dv))
  for b in range(bsz):
    for h in range(heads):
      bias = bias_fn(b, h)
      for i in range(t):
        keys, logits = [], []
        for j in range(i + 1):
          if seg is not None and seg[b, j] != seg[b, i]:
            continue
          s = 0.0
          for e in range(d):
            s += q[b, i, h, e] * k[b, j, h, e]
          keys.append(j)
          logits.append(scale * s + bias[i, j])
        m = max(logits)
        w = [math.exp(x - m) for x in logits]
        z = sum(w)
        for j, wj in zip(keys, w):
          out[b, i, h] += (wj / z) * v[b, j, h]
  return out


def fpa_attention_np(q, k, v, field, level, scale=None, segment_ids=None):
  """First Passage Attention, float64 loops.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, Kv]; field, level: [B, T, H];
    scale: default D ** -0.5; segment_ids: optional [B, T] ints (any order).
  Returns:
    [B, T, H, Kv] float64.
  """
  field = np.asarray(field, np.float64)
  level = np.asarray(level, np.float64)
  return _attend_np(q, k, v, lambda b, h: -penalty_np(field[b, :, h], level[b, :, h]), scale, segment_ids)


def fpa_prefix_attention_np(
  q, k, v, field, level, cached_k, cached_v, cached_level, cached_run_min, cached_valid, scale=None
):
  """A chunk after a cache (`fpa_jax.ops.prefix.prefix_attention`), float64 loops.

  Query i of the chunk attends to every valid cached slot s with penalty level_s - lowest where
  level_s > lowest, lowest = min(run_min_s, field_0, ..., field_i) (run_min_s: the min of the
  field since the key was written), and to chunk keys j <= i with `penalty_np`.

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, Kv]; field, level: [B, T, H] (the chunk);
    cached_k: [B, S, H, K]; cached_v: [B, S, H, Kv]; cached_level, cached_run_min: [B, S, H];
    cached_valid: [B, S, H] bool. Heads ungrouped (repeat kv heads first).
  Returns:
    [B, T, H, Kv] float64.
  """
  q, k, v, ck, cv = (np.asarray(x, np.float64) for x in (q, k, v, cached_k, cached_v))
  field, level, clev, cmin = (np.asarray(x, np.float64) for x in (field, level, cached_level, cached_run_min))
  valid = np.asarray(cached_valid, bool)
  bsz, t, heads, d = q.shape
  scale = d**-0.5 if scale is None else float(scale)
  out = np.zeros((bsz, t, heads, v.shape[-1]))
  for b in range(bsz):
    for h in range(heads):
      pen = penalty_np(field[b, :, h], level[b, :, h])
      for i in range(t):
        logits, vals = [], []
        lowest_chunk = min(float(field[b, s, h]) for s in range(i + 1))
        for s in range(ck.shape[1]):
          if not valid[b, s, h]:
            continue
          lowest = min(float(cmin[b, s, h]), lowest_chunk)
          lv = float(clev[b, s, h])
          dot = sum(q[b, i, h, e] * ck[b, s, h, e] for e in range(d))
          logits.append(scale * dot - (lv - lowest if lv > lowest else 0.0))
          vals.append(cv[b, s, h])
        for j in range(i + 1):
          dot = sum(q[b, i, h, e] * k[b, j, h, e] for e in range(d))
          logits.append(scale * dot - pen[i, j])
          vals.append(v[b, j, h])
        m = max(logits)
        w = [math.exp(x - m) for x in logits]
        z = sum(w)
        for wj, vj in zip(w, vals):
          out[b, i, h] += (wj / z) * vj
  return out


def fox_attention_np(q, k, v, log_fgate, scale=None, segment_ids=None):
  """Forgetting Attention with the cumsum-difference bias c_i - c_j, c = cumsum(log_fgate).

  Written independently of the first-passage penalty. log_fgate: [B, T, H]; others as in
  `fpa_attention_np`. Returns [B, T, H, Kv] float64.
  """
  lf = np.asarray(log_fgate, np.float64)
  bsz, t, heads = lf.shape

  def bias(b, h):
    c = np.zeros(t)
    acc = 0.0
    for s in range(t):
      acc += lf[b, s, h]
      c[s] = acc
    out = np.full((t, t), -np.inf)
    for i in range(t):
      for j in range(i + 1):
        out[i, j] = c[i] - c[j]
    return out

  return _attend_np(q, k, v, bias, scale, segment_ids)


def softmax_attention_np(q, k, v, scale=None, segment_ids=None):
  """Plain causal softmax attention, float64 loops. Shapes as in `fpa_attention_np`."""
  t = np.asarray(q).shape[1]
  return _attend_np(q, k, v, lambda b, h: np.zeros((t, t)), scale, segment_ids)


def stack_live_sets_np(field):
  """Live keys of the shared walk (level = field) by the stack algorithm.

  For each new token t: pop every key on the stack whose level (= its field value) is above
  field_t, then push t. Keys on the stack after token i is pushed are the unpenalised keys of
  query i.

  Args:
    field: [T].
  Returns:
    list of length T; entry i is the set of live key indices for query i.
  """
  field = np.asarray(field, np.float64)
  stack, live = [], []
  for t in range(field.shape[0]):
    while stack and field[stack[-1]] > field[t]:
      stack.pop()
    stack.append(t)
    live.append(set(stack))
  return live


def live_sets_from_penalty(pen, tol=0.0):
  """Live (unpenalised) keys per query from a [T, T] penalty: {j <= i : pen[i, j] <= tol}.

  Returns a list of length T of sets of key indices.
  """
  pen = np.asarray(pen)
  t = pen.shape[0]
  return [{j for j in range(i + 1) if pen[i, j] <= tol} for i in range(t)]


def fpa_attention_vjp_np(q, k, v, field, level, ct, scale=None, segment_ids=None, drop=None):
  """First Passage Attention and its gradients, float64 loops: (out, dq, dk, dv, dfield, dlevel)
  of loss = sum(out * ct), with the keys `drop` marks removed from the softmax.

  Args:
    q, k: [B, T, H, K]; v, ct: [B, T, H, Kv]; field, level: [B, T, H] (heads ungrouped);
    segment_ids: optional [B, T]; drop: optional [B, H, T, T] bool, True where key j is left out
      of query i's softmax (the diagonal must stay).
  The penalty's derivative: -1 to level_j and +1 to the field value that sets min field over
  (j, i] (the first such position on ties) where level_j is above it, else 0.
  """
  q, k, v, ct = (np.asarray(x, np.float64) for x in (q, k, v, ct))
  field, level = np.asarray(field, np.float64), np.asarray(level, np.float64)
  bsz, t, heads, d = q.shape
  scale = d**-0.5 if scale is None else float(scale)
  seg = None if segment_ids is None else np.asarray(segment_ids)
  out, dq, dk, dv = np.zeros(v.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  dfield, dlevel = np.zeros(field.shape), np.zeros(level.shape)
  for b in range(bsz):
    for h in range(heads):
      for i in range(t):
        keys, logits, argmins, active = [], [], [], []
        for j in range(i + 1):
          if (seg is not None and seg[b, j] != seg[b, i]) or (drop is not None and drop[b, h, i, j]):
            continue
          lowest, at = math.inf, -1
          for s in range(j + 1, i + 1):
            if field[b, s, h] < lowest:
              lowest, at = float(field[b, s, h]), s
          lv = float(level[b, j, h])
          pen = lv - lowest if lv > lowest else 0.0
          keys.append(j)
          logits.append(scale * float(q[b, i, h] @ k[b, j, h]) - pen)
          argmins.append(at)
          active.append(lv > lowest)
        m = max(logits)
        w = np.array([math.exp(x - m) for x in logits])
        p = w / w.sum()
        for j, pj in zip(keys, p):
          out[b, i, h] += pj * v[b, j, h]
        delta = float(ct[b, i, h] @ out[b, i, h])
        for j, pj, at, act in zip(keys, p, argmins, active):
          ds = pj * (float(ct[b, i, h] @ v[b, j, h]) - delta)
          dq[b, i, h] += scale * ds * k[b, j, h]
          dk[b, j, h] += scale * ds * q[b, i, h]
          dv[b, j, h] += pj * ct[b, i, h]
          if act:
            dlevel[b, j, h] -= ds
            dfield[b, at, h] += ds
  return out, dq, dk, dv, dfield, dlevel
