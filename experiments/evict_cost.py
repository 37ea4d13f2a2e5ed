"""What the evictability objective costs on text: held-out loss of the passkey study's models with the
full cache, at 1x and 4x their training length (the objective's cost in bits per byte at 1x with the
full cache is one of its targets).

    python -m experiments.evict_cost                                  # fpa_fox5, fpa_fox5_cont, fpa_fox5_evict
    python -m experiments.evict_cost --models fpa_fox5_evict fpa_fox5_cont --rows 64

Each model (its workdir from results/passkey.json) is scored by `fpa_jax.eval` (loss by position on
`--rows` held-out windows of the `fpa_text` validation split, the parallel model) at each multiple.
`fpa_fox5_evict` continues `fpa_fox5` with the objective; `fpa_fox5_cont` continues it as long without
it (the same extra steps and data), so evict / cont isolates the objective. The models were trained
on a mix of passkey prompts and text rows, not as pure LMs. Writes results/evict_cost.{json,md} and
each run's loss-by-position table under results/evict_cost/.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from experiments import _common as U

MODULE = "experiments.evict_cost"
BITS = 1.0 / 0.6931471805599453  # nats -> bits


def main(argv=None) -> dict:
  ap = U.study_parser(MODULE, __doc__)
  ap.add_argument("--models", nargs="+", default=["fpa_fox5", "fpa_fox5_cont", "fpa_fox5_evict"])
  ap.add_argument("--passkey-results", default=str(U.ROOT / "results" / "passkey.json"))
  ap.add_argument("--multiples", type=int, nargs="+", default=[1, 4])
  ap.add_argument(
    "--rows", type=int, default=64, help="held-out rows at 1x (fewer at longer multiples: the same tokens)"
  )
  ap.add_argument("--base", default="fpa_fox5_cont", help="the model the others are compared with (the control)")
  ap.add_argument("--out", default=str(U.ROOT / "results" / "evict_cost"))
  a = ap.parse_args(argv)
  from fpa_jax import eval as E

  t0 = time.perf_counter()
  pk = U.passkey_models(a.passkey_results, a.models)
  cells = {}
  for m in a.models:
    for k in a.multiples:
      run_argv = [
        "--workdir",
        str(U.ROOT / pk[m]["workdir"]),
        "--task",
        "loss_by_position",
        "--multiple",
        str(k),
        "--rows",
        str(max(1, a.rows // k)),
        "--no-progress",
        "--out",
        f"{a.out}/{m}_{k}x.json",
      ]
      res, _ = E.run(E.parse_args(run_argv), run_argv)
      cells[f"{m}/{k}x"] = {"nll_mean": res["nll_mean"], "tokens": res["tokens"], "steps": pk[m]["steps"]}
  meta = U.run_meta(MODULE, argv, wall_s=time.perf_counter() - t0)
  out = {"cells": cells, "meta": meta, "models": a.models, "multiples": a.multiples}
  rows = []
  for m in a.models:
    row = [m, pk[m]["steps"]]
    for k in a.multiples:
      c = cells[f"{m}/{k}x"]
      row.append(f"{c['nll_mean'] * BITS:.4f}")
      base = cells.get(f"{a.base}/{k}x")
      row.append(f"{c['nll_mean'] / base['nll_mean'] - 1:+.2%}" if base and m != a.base else "—")
    rows.append(row)
  head = ["model", "steps"] + [h for k in a.multiples for h in (f"bits/token {k}x", f"vs {a.base}")]
  md = (
    f"`{meta['command']}`: held-out bits per token (byte tokens) of the models of `{os.path.relpath(Path(a.passkey_results).resolve(), U.ROOT)}` "
    "with the full "
    f"cache, on `fpa_text` validation windows ({a.rows} rows of the training length; the same tokens in fewer, "
    f"longer rows at larger multiples); per-run tables in `{Path(a.out).name}/`.\n\n" + U.md_table(head, rows)
  )
  U.write_prefixed(a.out, out, md)
  return out


if __name__ == "__main__":
  main()
