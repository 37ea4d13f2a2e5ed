"""Generate text from a trained run with a first-passage KV cache: the command line of
`fpa_jax.inference.generate`.

    python -m fpa_jax.inference --workdir runs/small_fpa --prompt "def main(" --max-new-tokens 64
    python -m fpa_jax.inference --workdir runs/small_fpa --prompt "..." --policy fpa_budget --budget 0.25
    python -m fpa_jax.inference --workdir runs/small_fpa --prompt "..." --policy fpa --tolerance 1e-3
    python -m fpa_jax.inference --workdir runs/small_fpa --prompt "..." --policy fpa_global --budget 0.25 --head-cap 0.5
    python -m fpa_jax.inference --workdir runs/small_fpa --prompt "..." --policy snapkv --budget 0.25

Prints the generated text, then one line of cache statistics (policy, capacity, peak fraction of
the keys held, bytes the cache allocates, kept fraction per layer and kv head). Policies: see
`fpa_jax.inference.policies`.
"""

from __future__ import annotations

import argparse
import json
import sys

from fpa_jax import cli
from fpa_jax.inference.policies import add_policy_args, policy_from_args


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(prog="python -m fpa_jax.inference", description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", required=True, help="a training workdir (python -m fpa_jax.train --workdir ...)")
  ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  add_policy_args(ap)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--top-k", type=int)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--prefill", choices=("parallel", "decode"))
  ap.add_argument("--data-dir", help="where an spm tokenizer lives (default: the run's data_dir)")
  return cli.parse(ap, argv)


def main(argv=None) -> int:
  a = parse_args(argv)
  from fpa_jax.data.tokenizers import load_tokenizer
  from fpa_jax.inference import generate, load_model

  try:
    model, cfg = load_model(a.workdir)
    tok = load_tokenizer(cfg.tokenizer, a.data_dir or cfg.data_dir, small=cfg.small_data)
    prompts = [[tok.bos_id] + tok.encode(p) for p in a.prompt]
    out, stats = generate(
      model,
      prompts,
      a.max_new_tokens,
      policy=policy_from_args(a),
      temperature=a.temperature,
      top_k=a.top_k,
      seed=a.seed,
      prefill=a.prefill,
    )
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for p, row in zip(a.prompt, out.tolist()):
    if tok.eos_id in row:
      row = row[: row.index(tok.eos_id)]
    print(p + tok.decode(row))
  print(json.dumps(stats))
  return 0


if __name__ == "__main__":
  sys.exit(main())
