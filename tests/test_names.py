"""One meaning per name: the renamed public names still import, as the same objects, with a warning
that names the new one."""

from __future__ import annotations

import importlib
import sys

import pytest

from fpa_jax import inference, ops
from fpa_jax.inference import cache
from fpa_jax.ops import bias, chunked, recurrent


@pytest.mark.parametrize(
  "module,old,new",
  [
    (chunked, "FPAGate", bias.FPABias),
    (chunked, "FoXGate", bias.FoXBias),
    (ops, "FPACache", ops.RecurrentCache),
    (ops, "init_cache", ops.init_recurrent_cache),
    (recurrent, "init_cache", recurrent.init_recurrent_cache),
    (inference, "init_cache", inference.init_layer_cache),
    (cache, "init_cache", cache.init_layer_cache),
  ],
)
def test_old_names_warn_and_are_the_new_objects(module, old, new):
  with pytest.warns(DeprecationWarning, match=new.__name__):
    assert getattr(module, old) is new
  with pytest.raises(AttributeError):
    getattr(module, old + "_nope")


def test_generate_module_is_the_inference_command_line():
  sys.modules.pop("fpa_jax.generate", None)
  with pytest.warns(FutureWarning, match="python -m fpa_jax.inference"):
    shim = importlib.import_module("fpa_jax.generate")
  from fpa_jax.inference import __main__ as cli

  assert shim.main is cli.main and shim.parse_args is cli.parse_args
  assert callable(inference.generate)  # the name `generate` in the package: the function
