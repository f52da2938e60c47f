"""DType and ReduceOp mapped onto NCCL's data types and reduction ops.

Terms: a *transfer type* is the NCCL type a buffer moves as in ops that do
not look at values (allgather, broadcast, alltoall): any type of the same
width moves the bits unchanged.  A *reduce plan* says how a reduction runs:
the NCCL type and op, and whether the buffer must first be *widened* into a
temporary of a wider type because NCCL cannot reduce it natively.

* int16 has no NCCL type: it widens to int32, reduces, and narrows back.
  That is exact for every op: narrowing keeps the low 16 bits, and sum and
  product modulo 2^32 agree with them modulo 2^16; min and max never leave
  the int16 range.
* bool moves as uint8 (0 / 1) and reduces with MAX for "any" (SUM, MAX) and
  MIN for "all" (MIN, PRODUCT), as on the other backends.
* bfloat16 is NCCL's own type from NCCL 2.10; older NCCL is refused.

The numbers are NCCL's `ncclDataType_t` / `ncclRedOp_t` values, stable
across NCCL 2.x, so this file needs no GPU library and is tested anywhere.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np

from ..errors import CollectiveError, NotSupported, PeerLostError, describe
from ..types import DType, ReduceOp

__all__ = ["ReducePlan", "reduce_plan", "transfer_type", "version_text", "translate_nccl_error",
           "encode_unique_id", "decode_unique_id", "unique_id_forms", "status_of", "NCCL_RESULTS",
           "round_bf16"]

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32 = 0, 1, 2, 3
NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32 = 4, 5, 6, 7
NCCL_FLOAT64, NCCL_BFLOAT16 = 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

#: ncclGetVersion() codes: X*10000 + Y*100 + Z since NCCL 2.9.
BF16_MIN_VERSION = 21000
UNIQUE_ID_BYTES = 128

_NATIVE = {
    DType.FLOAT16: NCCL_FLOAT16, DType.BFLOAT16: NCCL_BFLOAT16, DType.FLOAT32: NCCL_FLOAT32,
    DType.FLOAT64: NCCL_FLOAT64, DType.INT8: NCCL_INT8, DType.INT32: NCCL_INT32,
    DType.INT64: NCCL_INT64, DType.UINT8: NCCL_UINT8, DType.BOOL: NCCL_UINT8,
}
_OPS = {ReduceOp.SUM: NCCL_SUM, ReduceOp.PRODUCT: NCCL_PROD, ReduceOp.MAX: NCCL_MAX,
        ReduceOp.MIN: NCCL_MIN}
_BY_WIDTH = {1: NCCL_UINT8, 2: NCCL_FLOAT16, 4: NCCL_INT32, 8: NCCL_INT64}

#: ncclResult_t values that mean a peer or the network is gone.
_LOST = {2: "ncclSystemError", 6: "ncclRemoteError"}


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    nccl_type: int
    nccl_op: int
    widen_to: Optional[str] = None  # numpy dtype name of the temporary, or None


def version_text(code: int) -> str:
    """'2.21.5' from ncclGetVersion()'s 22105 (and the pre-2.9 X*1000+Y*100+Z codes)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def transfer_type(dtype: DType) -> int:
    """The NCCL type a `dtype` buffer moves as (bits unchanged)."""
    return _BY_WIDTH[DType(dtype).itemsize]


def reduce_plan(dtype: DType, op: ReduceOp, version: int) -> ReducePlan:
    """How NCCL reduces `dtype` with `op`.

    Raises:
        NotSupported: bfloat16 on NCCL < 2.10.
        ValueError: an op the front end should have lowered (AVERAGE).
    """
    dtype, op = DType(dtype), ReduceOp(op)
    if op not in _OPS:
        raise ValueError(f"ReduceOp.{op.name} must be lowered by the front end "
                         "(AVERAGE is SUM plus a postscale)")
    if dtype == DType.BOOL:
        any_op = op in (ReduceOp.SUM, ReduceOp.MAX)
        return ReducePlan(NCCL_UINT8, NCCL_MAX if any_op else NCCL_MIN)
    if dtype == DType.INT16:
        return ReducePlan(NCCL_INT32, _OPS[op], widen_to="int32")
    if dtype == DType.BFLOAT16 and version < BF16_MIN_VERSION:
        raise NotSupported(describe(
            f"backend nccl cannot reduce bfloat16 with NCCL {version_text(version)}",
            op="allreduce", hint="NCCL 2.10 or newer has bfloat16 (pip install -U nvidia-nccl-cu12)"))
    return ReducePlan(_NATIVE[dtype], _OPS[op])


def translate_nccl_error(status: int, text: str, *, rank: int, size: int, op: str,
                         seq: Optional[int] = None, tensor: Optional[str] = None) -> CollectiveError:
    """The one place an NCCL failure becomes a Python exception; keeps NCCL's own words."""
    if status in _LOST:
        return PeerLostError(describe(f"NCCL error: {text}", rank=rank, size=size, op=op, seq=seq,
                                      tensor=tensor, hint="a peer process died or the network "
                                      "failed; NCCL_DEBUG=WARN shows which connection"))
    hint = "run with NCCL_DEBUG=INFO for NCCL's own trace" if status else None
    return CollectiveError(describe(f"NCCL error: {text}", rank=rank, size=size, op=op, seq=seq,
                                    tensor=tensor, hint=hint))


def encode_unique_id(uid) -> bytes:
    """cupy's unique id (128 C chars, signed) -> 128 bytes."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    return bytes(int(c) & 0xFF for c in uid)


def decode_unique_id(data: bytes) -> tuple:
    """128 bytes -> the tuple of signed chars CuPy < 14 takes (x86 builds)."""
    if len(data) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return tuple(b - 256 if b > 127 else b for b in data)


def unique_id_forms(data: bytes) -> list:
    """The forms NcclCommunicator has taken for the 128 bytes, to try in order: bytes
    (CuPy >= 14), signed chars (CuPy < 14 where char is signed: x86), unsigned chars
    (CuPy < 14 where char is unsigned: ARM).  A wrong form fails with TypeError or
    OverflowError before NCCL is called."""
    signed = decode_unique_id(data)
    return [bytes(data), signed, tuple(b & 0xFF for b in signed)]


#: NCCL's result codes (nccl.h); CuPy < 13.4 knows only 0-5 and raises KeyError(code) for
#: the others while it builds its NcclError.
NCCL_RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
                3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
                6: "ncclRemoteError", 7: "ncclInProgress"}


def status_of(exc, nccl) -> Optional[Tuple[int, str]]:
    """(NCCL status, text) of an exception NCCL's Python binding raised, else None: its
    NcclError, or the KeyError(status) an older CuPy raises for codes it does not know."""
    if isinstance(exc, nccl.NcclError):
        return int(getattr(exc, "status", -1)), str(exc)
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], int):
        code = exc.args[0]
        return code, f"{NCCL_RESULTS.get(code, 'unknown NCCL result')} ({code})"
    return None

def round_bf16(xp, f32):
    """float32 -> bfloat16 bits, round to nearest even (as _mpi_types.f32_to_bf16, on any xp)."""
    bits = f32.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + (np.uint32(0x7FFF) + lsb)) >> np.uint32(16)).astype(np.uint16)
    quiet = ((bits >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return xp.where(xp.isnan(f32), quiet, rounded)
