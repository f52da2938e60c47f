"""horovod_spark.tensorflow on real local ranks (2 and 3): every op against numpy.

One launch per world size runs every check (TensorFlow takes seconds to
import); each test below reads its check's result on every rank.
"""
from __future__ import annotations

import pytest

import _tf_ops_checks as checks
from _tf_support import assert_ok, requires_tf, run_checks

pytestmark = [pytest.mark.tf, requires_tf]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def results(request):
    return run_checks(checks.run_all, request.param)


def _ok(results, name):
    assert_ok(results, name)


def test_rank_before_init_is_a_clear_error(results):
    _ok(results, "not_initialized_is_a_clear_error")


def test_rank_size_and_placement_match_the_launcher(results):
    _ok(results, "placement_matches_the_launcher")


def test_ops_go_through_the_fusion_engine(results):
    _ok(results, "ops_run_through_the_fusion_engine")


def test_allreduce_of_every_op_and_dtype_matches_numpy(results):
    _ok(results, "allreduce_every_op_and_dtype_matches_numpy")


def test_allreduce_of_scalars_empties_and_scale_factors_matches_numpy(results):
    _ok(results, "allreduce_scalars_empties_and_scale_factors")


def test_fp16_compression_keeps_dtype_and_value(results):
    _ok(results, "fp16_compression_keeps_the_dtype_and_the_value")


def test_grouped_allreduce_of_mixed_dtypes_matches_numpy(results):
    _ok(results, "grouped_allreduce_of_mixed_dtypes_matches_numpy")


def test_allgather_with_different_first_dims_matches_numpy(results):
    _ok(results, "allgather_with_different_first_dims_matches_numpy")


def test_broadcast_from_every_root_matches_numpy(results):
    _ok(results, "broadcast_from_every_root_matches_numpy")


def test_alltoall_with_and_without_splits_matches_numpy(results):
    _ok(results, "alltoall_with_and_without_splits_matches_numpy")


def test_reducescatter_gives_each_rank_its_rows(results):
    _ok(results, "reducescatter_gives_each_rank_its_rows")


def test_ops_inside_tf_function_match_eager_with_static_shapes(results):
    _ok(results, "ops_inside_tf_function_match_eager_and_keep_static_shapes")


def test_gradients_of_allreduce_allgather_broadcast_reducescatter_are_horovods(results):
    _ok(results, "gradients_of_the_ops_are_horovods")


def test_gradient_of_alltoall_goes_back_along_the_splits(results):
    _ok(results, "gradient_of_alltoall_sends_the_gradient_back")


def test_min_max_product_allreduce_has_no_gradient(results):
    _ok(results, "min_max_product_have_no_gradient")


def test_distributed_gradient_tape_averages_eagerly_and_in_tf_function(results):
    _ok(results, "distributed_gradient_tape_averages_eagerly_and_in_tf_function")


def test_two_distributed_tapes_over_one_variable_in_one_tf_function(results):
    _ok(results, "two_distributed_tapes_over_one_variable_in_one_tf_function")


def test_distributed_gradient_tape_keeps_nesting_and_none_gradients(results):
    _ok(results, "distributed_gradient_tape_keeps_nesting_and_none_gradients")


def test_a_gradient_group_of_one_dtype_travels_packed(results):
    _ok(results, "a_group_of_one_dtype_travels_packed_and_mixed_dtypes_do_not")


def test_sparse_gradients_are_allgathered_or_densified(results):
    _ok(results, "sparse_gradients_are_allgathered_or_densified")


def test_broadcast_variables_and_objects_agree_with_the_root(results):
    _ok(results, "broadcast_variables_and_objects_agree_with_root")


def test_barrier_and_join_return_on_every_rank(results):
    _ok(results, "barrier_and_join_return_on_every_rank")


def test_join_lets_a_rank_stop_early(results):
    _ok(results, "join_lets_a_rank_stop_early")


def test_unsupported_requests_fail_with_a_reason(results):
    _ok(results, "unsupported_requests_fail_with_a_reason")


def test_the_timeline_records_tf_ops_by_name(results):
    _ok(results, "the_timeline_records_tf_ops_by_name")


def test_allreduce_in_tf_function_runs_the_native_op_through_the_lane(results):
    _ok(results, "allreduce_in_tf_function_runs_the_native_op_through_the_lane")


def test_a_mismatch_across_ranks_is_named_on_every_rank(results):
    _ok(results, "a_mismatch_across_ranks_is_named_on_every_rank")


def test_every_check_has_a_test():
    named = {n for n in globals() if n.startswith("test_")}
    assert len(checks.CHECKS) == len(named) - 1, sorted(checks.CHECKS)
