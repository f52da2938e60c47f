"""horovod_spark.keras on two real local ranks: training matches the global batch.

One launch runs every check; each test reads its check's result on every rank.
"""
from __future__ import annotations

import pytest

import _keras_checks as checks
from _tf_support import assert_ok, requires_tf, run_checks

pytestmark = [pytest.mark.tf, requires_tf]


@pytest.fixture(scope="module")
def results():
    return run_checks(checks.run_all, 2, timeout=280)


def test_fit_with_the_optimizer_and_callbacks_matches_the_global_batch(results):
    assert_ok(results, "fit_matches_single_process_training_on_the_global_batch")


def test_broadcast_callback_syncs_weights_but_keeps_dropout_seeds_per_rank(results):
    assert_ok(results, "broadcast_callback_syncs_weights_but_keeps_dropout_seeds_per_rank")


def test_metric_average_callback_averages_every_rank_s_metrics(results):
    assert_ok(results, "metric_average_callback_averages_every_rank_s_metrics")


def test_backward_passes_per_step_matches_one_step_on_the_combined_batch(results):
    assert_ok(results, "backward_passes_per_step_matches_one_step_on_the_combined_batch")


def test_backward_passes_per_step_works_eagerly(results):
    assert_ok(results, "backward_passes_per_step_works_eagerly_with_apply_gradients")


def test_sparse_embedding_gradients_train_like_the_global_batch(results):
    assert_ok(results, "sparse_embedding_gradients_train_like_the_global_batch")


def test_mixed_precision_overflow_on_one_rank_skips_the_step_on_every_rank(results):
    assert_ok(results, "mixed_precision_overflow_on_one_rank_skips_the_step_on_every_rank")


def test_learning_rate_warmup_ramps_from_lr_over_size_to_lr(results):
    assert_ok(results, "learning_rate_warmup_ramps_from_lr_over_size_to_lr")


def test_learning_rate_schedule_scales_momentum_with_the_rate(results):
    assert_ok(results, "learning_rate_schedule_scales_momentum_with_the_rate")


def test_load_model_restores_a_distributed_optimizer_with_its_state(results):
    assert_ok(results, "load_model_restores_a_distributed_optimizer_with_its_state")


def test_xla_compiled_training_is_refused_with_the_fix(results):
    assert_ok(results, "xla_compiled_training_is_refused_with_the_fix")


def test_keras_value_functions_return_numpy(results):
    assert_ok(results, "keras_value_functions_return_numpy")


def test_every_check_has_a_test():
    named = {n for n in globals() if n.startswith("test_")}
    assert len(checks.CHECKS) == len(named) - 1, sorted(checks.CHECKS)
