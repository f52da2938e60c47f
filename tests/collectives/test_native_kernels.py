"""The native reduction kernels against numpy, in this process, for every
dtype and op; the dtype and op codes agree with collectives.types."""
import numpy as np
import pytest

from collectives import _native
from collectives.types import DType, ReduceOp

torch = pytest.importorskip("torch")

NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
             ReduceOp.PRODUCT: np.multiply}
TORCH_OPS = {ReduceOp.SUM: torch.add, ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
             ReduceOp.PRODUCT: torch.mul}
OPS = list(NUMPY_OPS)


def test_native_codes_are_the_codes_of_collectives_types():
    assert {name: code for name, (code, _) in _native.DTYPES.items()} == \
        {d.name.lower(): int(d) for d in DType}
    assert {name: size for name, (_, size) in _native.DTYPES.items()} == \
        {d.name.lower(): d.itemsize for d in DType}
    assert _native.OPS == {o.name.lower(): int(o) for o in ReduceOp}


def _operands(dtype, n=1037):
    rng = np.random.default_rng(7)
    if np.issubdtype(dtype, np.floating):
        a, b = rng.standard_normal(n) * 30, rng.standard_normal(n) * 30
        a[:4], b[:4] = [np.nan, 1.0, np.inf, -0.0], [2.0, np.nan, -np.inf, 0.0]
        return a.astype(dtype), b.astype(dtype)
    info = np.iinfo(dtype)
    lo, hi = int(info.min), int(info.max) + 1
    return rng.integers(lo, hi, n, dtype=dtype), rng.integers(lo, hi, n, dtype=dtype)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name.lower())
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.int16,
                                   np.int32, np.int64, np.uint8], ids=lambda d: np.dtype(d).name)
def test_kernel_matches_numpy_bit_for_bit(dtype, op):
    a, b = _operands(dtype)
    out = np.empty_like(a)
    _native.reduce(out, a, b, int(DType[np.dtype(dtype).name.upper()]), int(op))
    with np.errstate(all="ignore"):
        want = NUMPY_OPS[op](a, b)
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)) or \
        np.array_equal(out, want, equal_nan=True)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name.lower())
def test_bfloat16_kernel_matches_torch_rounding(op):
    a, b = _operands(np.float32)
    ta, tb = torch.from_numpy(a).bfloat16(), torch.from_numpy(b).bfloat16()
    bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    out = np.empty_like(bits(ta))
    _native.reduce(out, bits(ta), bits(tb), int(DType.BFLOAT16), int(op))
    want = TORCH_OPS[op](ta, tb)
    got = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("op,want", [(ReduceOp.SUM, [1, 1, 1, 0]), (ReduceOp.MAX, [1, 1, 1, 0]),
                                     (ReduceOp.PRODUCT, [1, 0, 0, 0]), (ReduceOp.MIN, [1, 0, 0, 0])],
                         ids=["sum-is-or", "max-is-or", "product-is-and", "min-is-and"])
def test_bool_reduces_as_logic(op, want):
    a, b = np.array([1, 1, 0, 0], np.bool_), np.array([1, 0, 1, 0], np.bool_)
    out = np.empty_like(a)
    _native.reduce(out, a, b, int(DType.BOOL), int(op))
    assert out.tolist() == [bool(w) for w in want]


def test_kernels_reduce_in_place_into_either_operand():
    a, b = np.arange(100, dtype=np.float32), np.full(100, 0.5, np.float32)
    x = a.copy()
    _native.reduce(x, x, b, int(DType.FLOAT32), int(ReduceOp.SUM))
    y = a.copy()
    _native.reduce(y, b, y, int(DType.FLOAT32), int(ReduceOp.SUM))
    assert np.array_equal(x, a + b) and np.array_equal(y, a + b)


def test_average_never_reaches_native_code():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="unsupported op"):
        _native.reduce(x, x, x, int(DType.FLOAT32), int(ReduceOp.AVERAGE))
