"""Test-wide setup: 8 simulated CPU devices for the sharding tests (must precede `import jax`)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# JIT compiles make first examples slow: no per-example deadline; CI keeps example counts modest.
settings.register_profile("default", deadline=None, max_examples=25, print_blob=True)
settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


# Duplicates of paths the default run covers elsewhere, and long end-to-end trainings: run on demand
# with `-m slow` (README, "Tests"). One place, so the default run's cost is visible and easy to
# tune; each entry is a test's node id below tests/ (a whole function, or one parametrized case).
SLOW = {
  # end-to-end scripts and notebooks (their library paths have fast tests of their own)
  "test_quickstart.py::test_quickstart_smoke",
  "test_studies_lm.py::test_lm_ablations_script_tiny_run",
  "test_studies_lm.py::test_passkey_script_tiny_run",
  "test_notebooks.py::test_notebook_runs[03_train_and_decode.ipynb]",
  "test_experiments.py::test_kv_compression_tiny_run",
  "test_experiments.py::test_bench_decode_tiny_run_writes_results",
  "test_experiments.py::test_bench_attention_tiny_run_writes_results",
  "test_live_sets.py::test_run_smoke_writes_results_and_resumes",
  "test_evictability.py::test_train_logs_evict_metrics",
  "test_train.py::test_cli_profile_steps_writes_trace",
  # one variant of a parametrized check stays in the default run
  "test_scan.py::test_scanned_equals_unscanned_logits_and_grads[softmax]",
  "test_scan.py::test_remat_policies_give_the_same_grads[scanned-full]",
  "test_ops_gqa.py::test_grads_match_repeated_heads[4-2-True-fpa]",
  "test_ops_gqa.py::test_grads_match_repeated_heads[4-2-True-fox]",
  "test_ops_gqa.py::test_grads_match_repeated_heads[3-1-False-fox]",
  "test_ops_gqa.py::test_values_match_repeated_reference[4-2-True-fpa]",
  "test_ops_diag_sub.py::test_chunked_with_sub_tiled_diagonal_matches_quadratic[10-300-128-kink_free-unsorted]",
  "test_ops_grad.py::test_chunked_large_tiles_grads_match_quadratic[9-70-16-iid-unsorted]",
  "test_ops_grad.py::test_chunked_large_tiles_grads_match_quadratic[7-100-32-kink_free-sorted]",
  "test_model.py::test_default_gate_gets_gradient_at_init[stack]",
  "test_train.py::test_tiny_model_overfits_tiny_batch[stack]",
  "test_train.py::test_tiny_model_overfits_tiny_batch[softmax]",  # the fox kernel with a zero gate
  "test_train.py::test_tiny_model_overfits_tiny_batch[nope]",
  "test_pallas_sharded.py::test_layer_under_mesh_matches_plain_and_gathers_nothing[data=2,model=4-6]",
  "test_pallas_sharded.py::test_grouped_heads_under_mesh_match_chunked[data=4,model=2-False]",
  "test_model_gqa.py::test_kv_heads_equal_heads_is_unchanged[fpa]",
  # long or multi-process runs of the trainer (their paths have cheaper tests in the default run)
  "test_train.py::test_resume_in_new_process_is_exact",  # in-process: test_checkpoint_fallback's resume
  "test_multihost.py::test_two_process_train_matches_one_process",  # test_sharded_step_matches_single_device
  "test_train.py::test_periodic_eval_scores_the_fixed_heldout_set",  # make_heldout: test_data_pipeline
  "test_train.py::test_tiny_model_overfits_tiny_batch[fpa]",  # losses fall: test_dropin's README model
  "test_train.py::test_tiny_model_overfits_tiny_batch[fox]",
  "test_train.py::test_no_retracing_in_process",  # one trace per program: the inference TRACES tests
  "test_studies_lm.py::test_perplexity_script_tiny_run",
  "test_notebooks.py::test_notebook_runs[01_mechanism.ipynb]",
  # heavy compiles whose property a smaller default case checks
  "test_ops_gqa.py::test_grads_match_repeated_heads[3-1-False-fpa]",  # test_grads_match_finite_differences_tiny
  "test_ops_gqa.py::test_values_match_repeated_reference[4-2-True-fox]",
  "test_ops_gqa.py::test_pallas_grouped_matches_quadratic[fpa-2-1-False-block2]",
  "test_ops_skip.py::test_fox_skipping_within_bound",  # test_mostly_dead_tiles_are_skipped_within_bound
  "test_ops_skip.py::test_segments_and_padding",
  "test_ops_diag_sub.py::test_chunked_with_sub_tiled_diagonal_matches_quadratic[11-300-256-spikes-sorted]",
  "test_ops_grad.py::test_chunked_large_tiles_grads_match_quadratic[8-130-64-spikes-None]",
  "test_ops_grad.py::test_grads_match_fd_of_float64_reference[1-2-9-2-3-2-unsorted-4]",
  "test_ops_pallas.py::test_pallas_matches_quadratic_and_chunked[3-2-19-2-4-4-sorted-True-8-True]",
  "test_ops_edges.py::test_inf_level_every_impl_agrees_values_and_grads[chunked-4-0.001]",
  "test_ops_edges.py::test_inf_level_every_impl_agrees_values_and_grads[pallas-8-None]",
  "test_pallas_sharded.py::test_grouped_heads_under_mesh_match_chunked[data=2,model=4-True]",
  "test_inference.py::test_parallel_prefill_keeps_the_same_keys_as_decode",  # test_policies' prefill checks
  "test_inference.py::test_generate_greedy_equals_parallel_argmax[softmax]",
  "test_inference.py::test_generate_greedy_equals_parallel_argmax[fox]",
  "test_model_gqa.py::test_full_cache_equals_parallel[fpa-2]",
  "test_dropin.py::test_layer_skip_tolerance_within_the_ops_bound",  # the op's bound: test_ops_skip
  # covered by a sibling test of the same property
  "test_ops_skip.py::test_random_fields_within_bound",  # test_mostly_dead_tiles_are_skipped_within_bound
  "test_ops_skip.py::test_near_threshold_dips_move_the_output_within_bound",
  "test_scan.py::test_scanned_remat_train_step_on_the_8_device_mesh",  # remat grads + sharded step tests
  "test_scan.py::test_weight_decay_mask_is_layout_independent",
  "test_scan.py::test_scanned_step_keeps_activations_sharded",
  "test_scan.py::test_cached_decoding_of_a_scanned_model",
  "test_model_gqa.py::test_generate_parallel_prefill_equals_decode_prefill",  # test_inference's
  "test_sharding.py::test_train_step_activations_are_batch_sharded_on_data8",
  "test_train.py::test_no_host_transfer_between_log_steps",
  "test_train.py::test_nonfinite_loss_stops_and_keeps_last_good_checkpoint",  # ..._step_is_skipped_...
  "test_configs.py::test_trainer_resumes_across_train_fields_and_refuses_another_model",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  ids = {item.nodeid.removeprefix("tests/") for item in items}
  for item in items:
    if item.nodeid.removeprefix("tests/") in SLOW:
      item.add_marker(pytest.mark.slow)
  # A renamed test must not silently drop out of SLOW (and back into the default run): every entry
  # of a collected file must name a collected test.
  files = {i.split("::")[0] for i in ids}
  stale = sorted(e for e in SLOW if e.split("::")[0] in files and e not in ids and not config.getoption("-k"))
  if stale:
    raise pytest.UsageError(f"tests/conftest.py SLOW names tests that were not collected: {stale}")
