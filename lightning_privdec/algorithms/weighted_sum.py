"""The gossip's weighted sums of model-sized vectors, ``out = w_0 t_0 + w_1 t_1 + ...``, in one pass over memory.

Push-sum's mixing (x_i = a_ii x_i + sum_j a_ij x_j) and DP-CSGP's line 5 (x_i + gamma (sum_j a_ij x_hat_j - sum_k a_ki
x_hat_ik)) are such sums. In torch each term is one pass that reads the running sum and writes it back; on a float32
host vector the compiled loop (``_weighted_sum.c``) reads every term once and writes once: 9.5 ms instead of 12.2 for
line 5 of the 9.7M-parameter ``wide`` model of ``benchmarks/private_step.py`` on one core. Each term is one fused
multiply-add, as torch's vectorised ``add(..., alpha=w)`` rounds it on AVX2 and AVX-512 hosts, so both paths give the
same bits there (checked before use; where torch rounds its adds otherwise, the check takes the float32 rounding of
each term); nothing else depends on them: the sums stay on their node.

Built and cached by :mod:`lightning_privdec.native` (``PRIVDEC_NATIVE_MIXING=0`` turns it off). Other devices and
dtypes, strided vectors, vectors sharing memory other than ``out`` being ``t_0`` itself, and a kernel that cannot be
built or trusted take torch's path. With several intra-op threads the vector is split among as many threads (torch's
add uses them too).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from lightning_privdec import native

SOURCE = Path(__file__).with_name("_weighted_sum.c")
#: entries per thread below which one thread sums the whole vector (a thread's start costs more than it saves)
THREAD_ENTRIES = 1 << 18


def weighted_sum_into(out: Tensor, terms: Sequence[tuple[Tensor, float]]) -> Tensor:
    """``out = sum_k w_k t_k`` over ``terms`` = ``[(t_0, w_0), (t_1, w_1), ...]`` (at least one; every ``t_k`` of
    ``out``'s shape), added in that order, each term rounded once in ``out``'s dtype. ``out`` may be ``t_0`` itself.
    Returns ``out``."""
    if not terms:
        raise ValueError("weighted_sum_into needs at least one term")
    kernel = _kernel_for(out, terms)
    if kernel is None:
        return _torch_weighted_sum(out, terms)
    _run(kernel, out, terms)
    return out


def _torch_weighted_sum(out: Tensor, terms: Sequence[tuple[Tensor, float]]) -> Tensor:
    """One torch operation per term (the first two in one where w_0 = 1)."""
    (first, w0), rest = terms[0], list(terms[1:])
    if w0 == 1.0 and rest:
        second, w1 = rest.pop(0)
        torch.add(first, second, alpha=w1, out=out)
    elif w0 == 1.0:
        if out.data_ptr() != first.data_ptr():
            out.copy_(first)
    else:
        torch.mul(first, w0, out=out)
    for tensor, weight in rest:
        out.add_(tensor, alpha=weight)
    return out


def _kernel_for(out: Tensor, terms: Sequence[tuple[Tensor, float]]) -> Any:
    """The compiled kernel when it may take these vectors (float32, contiguous, on the host, of one size, no shared
    memory but ``out`` being ``t_0``), else None."""
    tensors = [out, *(t for t, _ in terms)]
    if not all(native.host_float32(t) and t.numel() == out.numel() for t in tensors):
        return None
    if native.tensors_overlap([t for t, _ in terms[1:]], in_place=[(out, terms[0][0])]):
        return None
    return weighted_sum_kernel()


def _run(kernel: Any, out: Tensor, terms: Sequence[tuple[Tensor, float]]) -> None:
    """The kernel over ``out``'s entries, split among the intra-op threads where the vector is large enough. Every
    part is written before this returns, by its thread or (one that cannot start) by this one; a failure in any part
    is raised here after all have ended."""
    n, count = out.numel(), len(terms)
    weights = (ctypes.c_float * count)(*(float(w) for _, w in terms))
    parts = max(1, min(torch.get_num_threads(), n // THREAD_ENTRIES))
    bounds = [n * k // parts // 16 * 16 for k in range(parts)] + [n]  # part starts on 64-byte multiples

    def part(k: int) -> None:
        start = bounds[k]
        pointers = (ctypes.c_void_p * count)(*(t.data_ptr() + 4 * start for t, _ in terms))
        kernel(out.data_ptr() + 4 * start, pointers, weights, count, bounds[k + 1] - start)  # releases the GIL

    native.run_parts([functools.partial(part, k) for k in range(parts)])
    increment_version(out)  # written through addresses: what reads out's version sees the write


def weighted_sum_kernel() -> Any:
    """The compiled ``weighted_sum_f32``, or None (torch's path): built, loaded and checked once per process."""
    return native.kernel("PRIVDEC_NATIVE_MIXING", SOURCE, _function_of, _check, libraries=("-lm",),
                         what="the gossip's weighted sums on the host", fallback="torch's adds")


def _function_of(library: Any) -> Any:
    function = library.weighted_sum_f32
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    return function


def _check(function: Any) -> str | None:
    """The kernel against torch's path on 1 to 5 terms (weights 1 and others, vectors over block boundaries, ``out``
    as ``t_0``): torch's bits where torch's adds fuse their multiply-add (its AVX2 and AVX-512 kernels), else each
    entry within the float32 rounding of its k terms, gamma_k sum_j |w_j t_j|, of the exact sum; None, or what
    differs."""
    generator = torch.Generator().manual_seed(20261127)
    for n in (1, 15, 2049, 5000):
        vectors = [torch.randn(n, generator=generator) * 10.0 ** k for k in range(5)]
        for count in range(1, 6):
            for w0 in (1.0, 0.3):
                terms = [(vectors[0], w0)] + [(vectors[k], (-0.7) ** k / 3) for k in range(1, count)]
                expected = _torch_weighted_sum(torch.empty(n), terms)
                for in_place in (False, True):
                    out = vectors[0].clone() if in_place else torch.full((n,), float("nan"))
                    weights = (ctypes.c_float * count)(*(w for _, w in terms))
                    pointers = (ctypes.c_void_p * count)(*((out if in_place and k == 0 else t).data_ptr()
                                                          for k, (t, _) in enumerate(terms)))
                    function(out.data_ptr(), pointers, weights, count, n)
                    if torch.equal(out.view(torch.int32), expected.view(torch.int32)):
                        continue
                    products = [float(w) * t.double() for (t, _), w in zip(terms, weights)]  # exact in float64
                    exact, size = sum(products), sum(p.abs() for p in products)
                    gamma = count * 2.0**-24 / (1 - count * 2.0**-24)
                    if not bool(((out.double() - exact).abs() <= (gamma + 2.0**-50) * size).all()):
                        return (f"gave a sum outside float32 rounding ({count} terms of {n} entries, w_0 = {w0}, "
                                f"{'in place' if in_place else 'into another vector'})")
    return None
