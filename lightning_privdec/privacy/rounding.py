"""Floating-point error bounds for clipping (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, ch. 3):
the per-example norms that set clip factors are upper bounds of the true norms whatever the inputs, so these are the
unit roundoffs, the gamma_n of a sum of n products, the underflow of a product, and a context in which float32
matrix products run in float32 (docs/privacy.md, "What clipping guarantees")."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TypeVar

import torch
from torch import Tensor

K = TypeVar("K")
U64 = torch.finfo(torch.float64).eps / 2  # float64's unit roundoff


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a p-bit significand: a correctly rounded operation errs by at most u of its result."""
    return torch.finfo(dtype).eps / 2


def gamma(n: float, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): a sum of n rounded products errs by at most gamma_n times the sum of their
    absolute values, in any order of summation; infinite once n u reaches 1/2 (no bound)."""
    nu = n * u
    return nu / (1 - nu) if nu < 0.5 else math.inf


def tiny(dtype: torch.dtype) -> float:
    """The smallest positive (subnormal) value: a product that underflows errs by at most this much."""
    return float(torch.finfo(dtype).smallest_normal) * torch.finfo(dtype).eps


@functools.cache
def _precision_switches() -> tuple[tuple[object, str, object], ...]:
    """(object, attribute, full-precision value) of every switch that lets float32 products use TF32 or bfloat16:
    torch's per-backend ``fp32_precision`` where it exists (torch >= 2.9; cuDNN convolutions default to "tf32"),
    else the older ``allow_tf32`` flags and the matmul precision; found once (the objects are torch's own)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        switches = [(conv, "fp32_precision", "ieee"), (torch.backends.cuda.matmul, "fp32_precision", "ieee")]
        mkldnn_matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
        if mkldnn_matmul is not None and hasattr(mkldnn_matmul, "fp32_precision"):
            switches.append((mkldnn_matmul, "fp32_precision", "ieee"))
        return tuple(switches)
    return ((torch.backends.cudnn, "allow_tf32", False), (torch.backends.cuda.matmul, "allow_tf32", False))


@contextmanager
def full_precision() -> Iterator[None]:
    """float32 matrix products and convolutions in float32 (no TF32 or bfloat16 inner products, whatever the user's
    ``torch.set_float32_matmul_precision`` or TF32 settings say), and autocast off (clipping called inside a user's
    ``torch.autocast`` would otherwise run its matrix products in bfloat16 or float16), so that the bounds hold;
    restored afterwards."""
    switches = _precision_switches()
    saved = [getattr(obj, name) for obj, name, _ in switches]
    with ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        if all(value == full for value, (_, _, full) in zip(saved, switches)):
            yield
            return
        try:
            for obj, name, full in switches:
                setattr(obj, name, full)
            yield
        finally:
            for (obj, name, _), value in zip(switches, saved):
                setattr(obj, name, value)


#: the device types whose autocast :func:`full_precision` switches off where it is on
_AUTOCAST_DEVICES = ("cpu", "cuda")


def sum_rounding(rows: int, dtype: torch.dtype) -> float:
    """Relative bound of one example's share of a clipped sum over ``rows`` terms computed in ``dtype``: the sum's
    gamma_rows and the factor's multiplication."""
    u = unit_roundoff(dtype)
    return gamma(rows, u) + 2 * u


#: examples per product of a clipped sum (:func:`weighted_row_sum`, book-keeping's weight-gradient products): it bounds
#: the float64 temporaries of one product; since every such sum runs in float64, it no longer changes any bound
SUM_BLOCK = 256


def sum_by_blocks(tensors: Sequence[Tensor], size: int, part: Callable[..., dict[K, Tensor]]) -> dict[K, Tensor]:
    """``part(*block)`` (a sum over the examples of ``block``, rows of each of ``tensors`` along dimension 0, per key,
    computed in float64) summed over blocks of ``size`` examples, in float64: the sum over examples is never rounded
    to float32 (one call on the tensors themselves, without slicing, when they fit in one block). Float64 because a
    float32 sum over examples is not a sum of what each example adds: removing an example x changes how every other
    example's terms round (docs/privacy.md, "What clipping guarantees": 1.0009 C for 256 examples of an
    nn.Linear(1, 1) summed in float32), which no per-example bound covers; in float64 that change is below
    gamma64_R times the terms' mass (1.1e-10 of it at a million terms)."""
    examples = tensors[0].shape[0]
    if examples <= size:
        return {key: value.double() for key, value in part(*tensors).items()}
    total: dict[K, Tensor] = {}
    for start in range(0, examples, size):
        for key, value in part(*(t[start : start + size] for t in tensors)).items():
            total[key] = value.double() if key not in total else total[key].add_(value)
    return total


#: entries of float64 rows that :func:`weighted_row_sum` converts at a time
ROW_SUM_ENTRIES = 1 << 22


def weighted_row_sum(weights: Tensor, rows: Tensor) -> Tensor:
    """``sum_i weights_i rows_i`` over dimension 0, in float64 (:func:`sum_by_blocks`'s reason), shaped as one row:
    each row is exact in float64 and its product with its weight errs by u64, so removing a row changes the sum by that
    row's weighted value up to float64's gamma_n of the rows' mass. The rows are converted to float64 a slice of
    columns at a time (at most :data:`ROW_SUM_ENTRIES` entries), each slice one matrix-vector product."""
    weights = weights.to(device=rows.device, dtype=torch.float64)
    count = rows.shape[0]
    flat = rows.reshape(count, math.prod(rows.shape[1:]))
    out = torch.zeros(flat.shape[1], dtype=torch.float64, device=rows.device)
    if count == 0:
        return out.view(rows.shape[1:])
    columns = max(1, ROW_SUM_ENTRIES // count)
    for start in range(0, flat.shape[1], columns):
        piece = flat[:, start : start + columns].to(torch.float64)
        torch.mv(piece.t(), weights, out=out[start : start + columns])
    return out.view(rows.shape[1:])


#: vector norms are summed in float32 over blocks of this many entries, the blocks' squares in float64
NORM_BLOCK = 1024


def norm_upper_bound(x: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """``||x||`` along ``dim`` (all of x when None), in float64, never below the true norm: float32 (or wider) norms (or
    sums of squares) of blocks of at most :data:`NORM_BLOCK` entries, rounded up by (1 + gamma_{k+3}) for their k
    squares, sums and roots, their squares summed in float64 (gamma_{n/k}), plus n times the smallest value for squares
    that underflow. As fast as a float32 norm (a float64 reduction of float32 data is about ten times slower on a
    CPU), and as tight as 3e-5 of the norm whatever n (a float32 sum of n squares is bounded only by gamma_n, 0.14 for a
    3x3x512x512 kernel)."""
    work = torch.promote_types(x.dtype, torch.float32)
    dims = tuple(range(x.dim())) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
    dims = tuple(d % x.dim() for d in dims)
    n = math.prod(x.shape[d] for d in dims)
    cast = None if x.dtype == work else work
    if n == 1 and dims:  # one entry: its magnitude is its norm, exactly (a depthwise convolution's per-group outputs)
        return x.abs().amax(dim=dims).double()
    if n <= NORM_BLOCK and x.dim() - 1 in dims:  # one block: reduced where it lies (no copy of a strided x)
        squares = torch.linalg.vector_norm(x, dim=dims, dtype=cast).double().square()
        block = n
    elif n <= NORM_BLOCK:  # one block across outer dimensions: a sum of squares (a strided norm is ~10x slower)
        x = x if cast is None else x.to(cast)
        squares = (x * x).sum(dim=dims).double()
        block = n
    else:
        kept = [x.shape[d] for d in range(x.dim()) if d not in dims]
        rows = x.movedim(dims, tuple(range(x.dim() - len(dims), x.dim()))).reshape(*kept, n)
        whole = n - n % NORM_BLOCK
        blocks = rows[..., :whole].reshape(*rows.shape[:-1], whole // NORM_BLOCK, NORM_BLOCK)
        squares = torch.linalg.vector_norm(blocks, dim=-1, dtype=cast).double().square().sum(dim=-1)
        if whole < n:
            squares += torch.linalg.vector_norm(rows[..., whole:], dim=-1, dtype=cast).double().square()
        block = NORM_BLOCK
    grow = (1 + gamma(block + 3, unit_roundoff(work))) * (1 + gamma(n // block + 2, U64))
    return squares.mul_(grow).add_(n * tiny(work)).sqrt_()
