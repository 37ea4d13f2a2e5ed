"""Central finite differences of a float64 loop reference: the gradient every fast path is checked
against (`tests/_tol.py` says how close)."""

import numpy as np


def finite_differences(f, args, ct, eps=1e-6):
  """Central differences of sum(f(*args) * ct) in every element of every float64 argument.

  f: numpy function of the arrays `args`; ct: cotangent of f's output. -> one array per argument."""
  out = []
  for n, a in enumerate(args):
    fd = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
      up, dn = [x.copy() for x in args], [x.copy() for x in args]
      up[n][idx] += eps
      dn[n][idx] -= eps
      fd[idx] = (np.sum(f(*up) * ct) - np.sum(f(*dn) * ct)) / (2 * eps)
    out.append(fd)
  return out
