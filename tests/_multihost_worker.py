"""One process of the two-process training test (tests/train/test_multihost.py); also its single-process
reference. argv: workdir steps out.npz [single]. Env: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID (multi-process) and XLA_FLAGS for the simulated CPU devices."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fpa_jax import sharding as S  # noqa: E402

S.maybe_initialize_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils as mhu  # noqa: E402

from _helpers_train import GlobalSynthetic, ProcessTaggedSynthetic  # noqa: E402
from fpa_jax import configs as C  # noqa: E402
from fpa_jax.train import train  # noqa: E402

N_PROCESSES = 2  # the global batch is always that of the 2-process job


def config(steps: int) -> C.Config:
  return C.get_config(
    "tiny", task="synthetic", steps=steps, n_layers=1, log_every=1, ckpt_every=1000, lr_decay_steps=8, warmup_steps=2
  )


def main() -> None:
  workdir, steps, out, single = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["single"]
  cfg = config(steps)
  devices = jax.devices()[:4]
  assert len(devices) == 4, jax.devices()
  mesh = S.make_mesh(None, devices=devices)
  pi, pc = jax.process_index(), jax.process_count()
  data = GlobalSynthetic(cfg, N_PROCESSES) if single else ProcessTaggedSynthetic(cfg, pi, pc)
  res = train(cfg, workdir=workdir, data=data, mesh=mesh, progress=False, log=lambda s: None)
  params = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(res["state"][0])}
  params = {
    k: np.asarray(mhu.process_allgather(v, tiled=True)) if not v.is_fully_addressable else np.asarray(v)
    for k, v in params.items()
  }
  if pi == 0:
    np.savez(out, **params)
    with open(out + ".json", "w") as f:
      json.dump(
        {
          "losses": [r["loss"] for r in res["history"]],
          "steps": [r["step"] for r in res["history"]],
          "start": res["start_step"],
          "data_state": data.get_state(),
          "process_count": pc,
        },
        f,
      )


if __name__ == "__main__":
  main()
