"""Lowering the Pallas kernels for a target without its hardware (docs/ops.md, "Lowering without
the hardware").

Build the kernels for the target (`pallas_attention(..., backend="tpu" | "gpu")`, or
`fpa_attention(..., impl="pallas", pallas_backend=...)`) and export the function for that platform
on any machine, CPU included: `lower_for(fn, *args, platform="tpu" | "cuda")` returns the
`jax.export.Exported`, whose StableHLO holds one custom call per pallas_call (`lowered_kernels`
lists them). That runs the whole Mosaic / Triton lowering of every kernel, so the block specs,
shapes, dtypes and grid are accepted there; it does not run the backend's compiler or the kernel.

Two things make it work off the device: Mosaic reads the TPU generation while lowering (from the
default device, or from the abstract mesh's `jax.sharding.AbstractDevice`: `lower_for` sets one of
`tpu_device_kind` where JAX's device is not a TPU), and the export's serialization check refuses
custom calls without a compatibility guarantee, which Triton's are (Mosaic's are guaranteed):
`lower_for` allows exactly the kernel call targets of the platform.
"""

from __future__ import annotations

import contextlib
import re
from typing import Literal, get_args

import jax

Platform = Literal["tpu", "cuda"]
PLATFORMS: tuple[str, ...] = get_args(Platform)
# The `backend` that builds the kernels each platform lowers.
BACKEND_OF = {"tpu": "tpu", "cuda": "gpu"}
# The custom call targets a pallas_call lowers to: Mosaic's, and Triton's (jaxlib <= 0.10.2 emits
# the first, whose Triton IR XLA compiles; later ones compile in the lowering: the second).
CALL_TARGETS = {"tpu": ("tpu_custom_call",), "cuda": ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")}
# The TPU Mosaic lowers for where JAX's device is not one (any `jax.sharding.AbstractDevice` kind
# Mosaic knows: "TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite", ...).
DEFAULT_TPU_DEVICE_KIND = "TPU v5 lite"

# A kernel custom call in StableHLO text: its target and its name (Mosaic's `kernel_name`, Triton's
# `name` in the backend config; the kernel bodies are escaped strings, so no quote ends early).
_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)\(")
_NAME = re.compile(r'(?:kernel_name|\bname) = "([^"]*)"')


def _tpu_device(kind):
  """The context Mosaic lowers for `kind` in: the abstract mesh in use with a TPU device, unless
  JAX runs on a TPU or that mesh already names one (then nothing changes)."""
  mesh = jax.sharding.get_abstract_mesh()
  if jax.default_backend() == "tpu" or (mesh.abstract_device is not None and mesh.abstract_device.platform == "tpu"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
  return jax.sharding.use_abstract_mesh(mesh.update(abstract_device=device))


def lowered_kernels(exported: jax.export.Exported) -> list[tuple[str, str]]:
  """The (call target, kernel name) of each Pallas kernel custom call in `exported`, in module order,
  e.g. ("tpu_custom_call", "fpa_attention_fwd")."""
  targets = {t for p in PLATFORMS for t in CALL_TARGETS[p]}
  calls = []
  for line in exported.mlir_module().splitlines():
    call = _CALL.search(line)
    if call and call.group(1) in targets:
      name = _NAME.search(line, call.end())
      calls.append((call.group(1), name.group(1) if name else ""))
  return calls


def lower_for(
  fn, *args, platform: Platform, tpu_device_kind: str = DEFAULT_TPU_DEVICE_KIND, **kwargs
) -> jax.export.Exported:
  """`jax.export` of fn(*args, **kwargs) for `platform`, on any backend (CPU included).

  Args:
    fn: a function of arrays that calls the Pallas kernels built for the platform (backend="tpu"
      for "tpu", backend="gpu" for "cuda"), e.g. the kernels' output or its `jax.grad`; plain or
      jitted.
    args, kwargs: fn's arguments: arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes count).
    platform: "tpu" (Mosaic) or "cuda" (Triton).
    tpu_device_kind: the TPU Mosaic lowers for where JAX's device is not a TPU (`DEFAULT_TPU_DEVICE_KIND`).
  Returns:
    The `jax.export.Exported` (`.mlir_module()` its StableHLO text, `.platforms` == (platform,));
    `lowered_kernels` lists its kernel calls.
  Raises:
    ValueError: an unknown platform (before tracing); a module without a kernel call for the
      platform (fn ran the kernels interpreted: build them with backend=BACKEND_OF[platform]).
  """
  if platform not in PLATFORMS:
    raise ValueError(f"unknown platform {platform!r}: the platform must be one of {PLATFORMS}")
  targets = CALL_TARGETS[platform]
  # Mosaic's call is on the export's list of stable targets; Triton's is not, and is expected here.
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets if t != "tpu_custom_call"]
  context = _tpu_device(tpu_device_kind) if platform == "tpu" else contextlib.nullcontext()
  with context:
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args, **kwargs)
  if not any(t in targets for t, _ in lowered_kernels(exported)):
    raise ValueError(
      f"fn lowered for {platform!r} without a Pallas kernel call {targets}: it ran no kernels, or ran "
      f"them interpreted; build them with backend={BACKEND_OF[platform]!r} (pallas_attention) or "
      f"pallas_backend={BACKEND_OF[platform]!r} (fpa_attention / fox_attention with impl='pallas')"
    )
  return exported
