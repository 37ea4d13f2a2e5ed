"""Field checks: the one validator of each config field.

`fpa_jax.configs` attaches a check to every field (`dataclasses.field(metadata={"check": ...})`) and
each config part's `validate` runs them; the layer's plain-argument constructor
(`FirstPassageAttention.from_args`) reaches the same checks through `ModelConfig.validate`, with its
own argument names. A check is `check(name, value)`: it raises ValueError naming `name` (the field,
or the argument that sets it), the value and what to use instead, and returns None otherwise.

The op-level settings (attn_impl, block_size, skip_tolerance, skip) are checked by the functions of
`fpa_jax.ops.validate`, which an op call runs too; the array checks of the ops live there as well.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

Check = Callable[[str, Any], None]


def _why(why: str) -> str:
  return f" ({why})" if why else ""


def integer(minimum: int, why: str = "") -> Check:
  """An int >= minimum (a bool, float or string is an error too: `--set` parses ints, but
  `get_config(steps="10")` or a hand-edited config.json need not)."""

  def check(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
      raise ValueError(f"{name}={v!r}: use an int >= {minimum}{_why(why)}")

  return check


def real(lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False, why: str = "") -> Check:
  """A finite real in the interval [lo, hi] (open ends with lo_open / hi_open; None: unbounded); the
  error names the interval and `why` (what the value does / a usual value)."""
  a, b = ("-inf" if lo is None else lo), ("inf" if hi is None else hi)
  interval = f"{'(' if lo_open or lo is None else '['}{a}, {b}{')' if hi_open or hi is None else ']'}"

  def check(name: str, v: Any) -> None:
    ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)
    if ok and lo is not None:
      ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
      ok = v < hi if hi_open else v <= hi
    if not ok:
      raise ValueError(f"{name}={v!r}: use a finite number in {interval}{_why(why)}")

  return check


def flag(optional: bool = False) -> Check:
  """A bool (`optional`: or None); a string such as "false" would otherwise be truthy."""

  def check(name: str, v: Any) -> None:
    if not (isinstance(v, bool) or (optional and v is None)):
      raise ValueError(f"{name}={v!r} must be True or False" + (" (or None)" if optional else ""))

  return check


def choice(options: tuple, what: str = "{name}", why: str = "", shown: tuple | None = None) -> Check:
  """One of `options` (the error lists `shown`, default options); `what` names the value in the
  error, e.g. "{name} policy"."""

  def check(name: str, v: Any) -> None:
    if v not in options:
      raise ValueError(f"unknown {what.format(name=name)} {v!r}; use one of {shown or options}{_why(why)}")

  return check


def text(nonempty: bool = False, why: str = "") -> Check:
  """A string (`nonempty`: not "")."""

  def check(name: str, v: Any) -> None:
    if not isinstance(v, str) or (nonempty and not v):
      raise ValueError(f"{name}={v!r}: use a{' non-empty' if nonempty else ''} string{_why(why)}")

  return check
