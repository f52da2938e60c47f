"""The NCCL dtype/op map, int16 widening, NCCL error translation and the unique id's bytes."""
from __future__ import annotations

import numpy as np
import pytest

from collectives.backends import _nccl_types as T
from collectives.errors import CollectiveError, NotSupported, PeerLostError
from collectives.types import DType, ReduceOp

OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
NEW, OLD = 22105, 2804  # NCCL 2.21.5, NCCL 2.8.4


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_every_dtype_has_a_transfer_type_of_its_width(dtype):
    width = {T.NCCL_UINT8: 1, T.NCCL_FLOAT16: 2, T.NCCL_INT32: 4, T.NCCL_INT64: 8}
    assert width[T.transfer_type(dtype)] == dtype.itemsize


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_every_dtype_and_op_has_a_reduce_plan_on_current_nccl(dtype, op):
    plan = T.reduce_plan(dtype, op, NEW)
    assert plan.nccl_op in (T.NCCL_SUM, T.NCCL_PROD, T.NCCL_MAX, T.NCCL_MIN)
    assert (plan.widen_to is not None) == (dtype == DType.INT16)


def test_native_types_are_nccls_own():
    assert T.reduce_plan(DType.FLOAT32, ReduceOp.SUM, NEW) == T.ReducePlan(T.NCCL_FLOAT32, T.NCCL_SUM)
    assert T.reduce_plan(DType.FLOAT16, ReduceOp.MAX, NEW) == T.ReducePlan(T.NCCL_FLOAT16, T.NCCL_MAX)
    assert T.reduce_plan(DType.BFLOAT16, ReduceOp.PRODUCT, NEW) == T.ReducePlan(T.NCCL_BFLOAT16, T.NCCL_PROD)
    assert T.reduce_plan(DType.INT64, ReduceOp.MIN, NEW) == T.ReducePlan(T.NCCL_INT64, T.NCCL_MIN)


def test_bool_reduces_as_any_or_all_on_uint8():
    assert [T.reduce_plan(DType.BOOL, op, NEW).nccl_op for op in OPS] == \
        [T.NCCL_MAX, T.NCCL_MIN, T.NCCL_MAX, T.NCCL_MIN]


def test_bfloat16_reductions_are_refused_on_nccl_before_2_10_with_the_version():
    with pytest.raises(NotSupported, match=r"cannot reduce bfloat16 with NCCL 2\.8\.4; NCCL 2\.10"):
        T.reduce_plan(DType.BFLOAT16, ReduceOp.SUM, OLD)
    assert T.transfer_type(DType.BFLOAT16) == T.NCCL_FLOAT16  # moving bits still works


def test_average_must_be_lowered_by_the_front_end():
    with pytest.raises(ValueError, match="AVERAGE is SUM plus a postscale"):
        T.reduce_plan(DType.FLOAT32, ReduceOp.AVERAGE, NEW)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_int16_widened_to_int32_and_narrowed_back_equals_int16_arithmetic(op):
    rng = np.random.default_rng(3)
    ranks = [rng.integers(-2**15, 2**15, 5000).astype(np.int16) for _ in range(5)]
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
             ReduceOp.PRODUCT: np.multiply}[op]
    want = ranks[0].copy()
    for r in ranks[1:]:
        want = ufunc(want, r)  # int16, wrapping
    wide = ranks[0].astype(np.int32)
    for r in ranks[1:]:
        wide = ufunc(wide, r.astype(np.int32))  # what NCCL does on the temporary (wraps mod 2^32)
    assert np.array_equal(wide.astype(np.int16), want)


def test_nccl_versions_print_as_nccl_does():
    assert T.version_text(22105) == "2.21.5" and T.version_text(2804) == "2.8.4"


def test_nccl_errors_keep_nccls_words_and_name_rank_op_and_sequence():
    err = T.translate_nccl_error(5, "NCCL_ERROR_INVALID_USAGE: invalid usage", rank=1, size=4,
                                 op="allgather", seq=9, tensor="float32[12]")
    assert type(err) is CollectiveError
    assert str(err).startswith("allgather #9 float32[12] on rank 1/4: NCCL error: "
                               "NCCL_ERROR_INVALID_USAGE: invalid usage")
    assert "NCCL_DEBUG=INFO" in str(err)


@pytest.mark.parametrize("status", [2, 6])
def test_a_remote_or_system_nccl_error_is_a_lost_peer(status):
    err = T.translate_nccl_error(status, "NCCL_ERROR_REMOTE_ERROR: remote process exited",
                                 rank=0, size=2, op="allreduce")
    assert isinstance(err, PeerLostError) and "a peer process died" in str(err)


def test_the_unique_id_survives_the_trip_through_bytes_as_signed_chars():
    uid = tuple(((i * 37) % 256) - 128 for i in range(128))  # both signs
    data = T.encode_unique_id(uid)
    assert isinstance(data, bytes) and len(data) == 128
    assert T.decode_unique_id(data) == uid
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        T.decode_unique_id(b"abc")


def test_round_bf16_on_numpy_matches_torch():
    torch = pytest.importorskip("torch")
    values = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1000
    ours = T.round_bf16(np, values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_the_unique_id_forms_are_bytes_then_signed_then_unsigned_chars():
    data = bytes((i * 37) % 256 for i in range(128))
    raw, signed, unsigned = T.unique_id_forms(data)
    assert raw == data and isinstance(raw, bytes)
    assert min(signed) < 0 and max(signed) <= 127 and bytes(b & 0xFF for b in signed) == data
    assert min(unsigned) >= 0 and bytes(unsigned) == data


def test_the_status_of_an_nccl_error_and_of_an_old_cupys_key_error():
    class nccl:  # noqa: N801 - the shape of cupy.cuda.nccl
        class NcclError(Exception):
            status = 5

    assert T.status_of(nccl.NcclError("NCCL_ERROR_INVALID_USAGE: bad"), nccl) == \
        (5, "NCCL_ERROR_INVALID_USAGE: bad")
    assert T.status_of(KeyError(6), nccl) == (6, "ncclRemoteError (6)")
    assert T.status_of(KeyError("a key of ours"), nccl) is None
    assert T.status_of(ValueError(), nccl) is None
