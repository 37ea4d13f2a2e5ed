"""Evaluate a trained model: loss by position and passkey retrieval, under any KV-cache policy.

    python -m fpa_jax.eval --workdir runs/small_fpa --task loss_by_position --multiple 8 --rows 32
    python -m fpa_jax.eval --workdir runs/small_fpa --task passkey --multiples 1 2 4 8 --n 20
    python -m fpa_jax.eval --workdir runs/small_fpa --task passkey --policy fpa_budget --budget 0.25

    from fpa_jax.eval import loss_by_position, passkey_eval, passkey_cell, wilson_interval
    res = loss_by_position(model, rows, bucket=64)    # rows int [N, T + 1], or an iterable of rows / batches
    res = passkey_eval(model, 256, multiples=(1, 8), n=20, policy="window", budget=0.25)
    write_results(res, "eval/passkey.json")           # + eval/passkey.md
    python -m fpa_jax.eval retrieval --workdir runs/small_fpa --multiples 1 2 4 8 --policies full fpa_global:0.25 --out r.json
    res = run_suite(model, train_len=256, policies=["full", "window:0.125"], n=50, out_path="r.json")  # resumes

Cache policies (`fpa_jax.inference.policies`): `full` (the default) runs the parallel model, one
forward pass per batch; any other policy decodes every token through the KV cache
(`fpa_jax.inference.cached_logits`), so no query attends to more keys than the policy keeps. A
float budget is a fraction of each row's (each passkey cell's) length, an int a key count.

Passkey prompts are `fpa_jax.data.passkey.passkey_eval_examples` (the `fpa_passkey` eval splits).
A prompt counts as retrieved when greedy decoding reproduces its whole answer (the key's digits)
exactly. By default that is computed from one teacher-forced pass: greedy decoding emits answer
token k iff the argmax after prompt + answer[:k] is answer[k], so by induction it reproduces the
whole answer iff that holds at every answer position; under a cache policy this is the cache fed
the prompt token by token (`generate(prefill="decode")`), since the cache only ever sees the
tokens a correct generation would have produced. `prefill="parallel"|"decode"` instead generates
the answer with `fpa_jax.inference.generate` (parallel prefill: the prompt goes through the
chunked kernel with all of it in view, then the policy cuts the cache). Accuracies carry a 95%
Wilson score interval.

Modules, by concern: `stats` (Wilson intervals, pooled cells, merged cache stats, the policy's
record), `text_loss` (`token_nll`, `loss_by_position`), `passkey` (the scorers, `passkey_cell`,
`passkey_eval`), `tables` (progress bar, markdown tables, results files), `cli` (the command line;
`__main__`). Every name stays importable from `fpa_jax.eval`.
`retrieval`: the RULER-style suite (`retrieval_cell`, `run_suite`, `suite_table`, `removal_plot`;
`python -m fpa_jax.eval retrieval`, its own flags), resumable cell by cell.
"""

# ruff: noqa: F401  (the private names too: importable from fpa_jax.eval, as from the module it was)
from fpa_jax.eval.cli import TASKS, _policy_args, _text_rows, default_out, main, parse_args, run
from fpa_jax.eval.passkey import (
  _argmax_logits,
  _argmax_parallel,
  _has_digit,
  answer_span,
  argmax_fn,
  cached_argmax_fn,
  digit_accuracy,
  eval_batch,
  generated_exact_match,
  passkey_cell,
  passkey_eval,
  passkey_examples,
  teacher_forced_argmax,
  teacher_forced_exact_match,
  teacher_forced_predictor,
)
from fpa_jax.eval.retrieval import (
  SUITE_MULTIPLES,
  SUITE_TASKS,
  cell_key,
  expand_tasks,
  params_digest,
  parse_policy,
  removal_plot,
  removed_fraction,
  retrieval_cell,
  run_suite,
  suite_cells,
  suite_examples,
  suite_policies,
  suite_table,
  suite_task,
)
from fpa_jax.eval.stats import (
  Z95,
  _merge_stats,
  _pool,
  _summary,
  check_policy,
  merge_stats,
  pool_cells,
  summary,
  wilson_interval,
)
from fpa_jax.eval.tables import LN2, _acc_ci, _md_table, markdown, md_table, policy_label, progress, write_results
from fpa_jax.eval.text_loss import (
  _check_ids,
  _nll_from_logits,
  _nll_parallel,
  _row_stream,
  _rows_of,
  _segment_positions,
  loss_by_position,
  token_nll,
  token_nll_fn,
)

__all__ = [
  "TASKS",
  "Z95",
  "LN2",
  "wilson_interval",
  "check_policy",
  "merge_stats",
  "summary",
  "pool_cells",
  "policy_label",
  "progress",
  "md_table",
  "markdown",
  "write_results",
  "token_nll",
  "token_nll_fn",
  "loss_by_position",
  "argmax_fn",
  "cached_argmax_fn",
  "answer_span",
  "eval_batch",
  "teacher_forced_exact_match",
  "generated_exact_match",
  "digit_accuracy",
  "passkey_cell",
  "passkey_examples",
  "passkey_eval",
  "teacher_forced_argmax",
  "teacher_forced_predictor",
  "SUITE_TASKS",
  "SUITE_MULTIPLES",
  "suite_task",
  "expand_tasks",
  "parse_policy",
  "suite_policies",
  "suite_cells",
  "suite_examples",
  "cell_key",
  "params_digest",
  "retrieval_cell",
  "run_suite",
  "suite_table",
  "removed_fraction",
  "removal_plot",
  "parse_args",
  "default_out",
  "run",
  "main",
]
