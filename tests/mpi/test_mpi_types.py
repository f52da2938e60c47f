"""The float16 / bfloat16 reduction kernels of the MPI backend, without MPI."""
from __future__ import annotations

import numpy as np
import pytest

from collectives.backends._mpi_types import _bf16_kernel, _f16_kernel, bf16_to_f32, f32_to_bf16


def _special_floats() -> np.ndarray:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 3.3895314e38, 1e-40, -1e-45,
                         1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20], dtype=np.float32)
    return np.concatenate([bits.view(np.float32), specials])


def test_float32_to_bfloat16_rounds_to_nearest_even_like_torch():
    torch = pytest.importorskip("torch")
    values = _special_floats()
    ours = f32_to_bf16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.all(np.isnan(bf16_to_f32(ours[~finite])))


def test_bfloat16_to_float32_is_exact_for_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    back = f32_to_bf16(bf16_to_f32(bits))
    nan = np.isnan(bf16_to_f32(bits))
    assert np.array_equal(back[~nan], bits[~nan])


@pytest.mark.parametrize("ufunc", [np.add, np.minimum, np.maximum, np.multiply])
def test_bfloat16_kernel_folds_in_place_as_float32_then_rounds(ufunc):
    rng = np.random.default_rng(1)
    a = f32_to_bf16(rng.standard_normal(1001).astype(np.float32))
    b = f32_to_bf16(rng.standard_normal(1001).astype(np.float32))
    want = f32_to_bf16(ufunc(bf16_to_f32(a), bf16_to_f32(b)))
    inout = bytearray(b.tobytes())
    _bf16_kernel(ufunc)(memoryview(a.tobytes()), memoryview(inout))
    assert np.array_equal(np.frombuffer(inout, dtype=np.uint16), want)


def test_float16_kernel_matches_numpy_float16_arithmetic():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(999).astype(np.float16)
    b = rng.standard_normal(999).astype(np.float16)
    inout = bytearray(b.tobytes())
    _f16_kernel(np.add)(memoryview(a.tobytes()), memoryview(inout))
    assert np.array_equal(np.frombuffer(inout, dtype=np.float16), a + b)
