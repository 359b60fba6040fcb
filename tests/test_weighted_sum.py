"""The gossip's weighted sums (algorithms/weighted_sum.py): the compiled one-pass loop gives torch's bits, runs where
the gossip mixes on the host, and torch's adds run wherever it cannot."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys

import pytest
import torch

from lightning_privdec import native
from lightning_privdec.algorithms import weighted_sum
from lightning_privdec.algorithms import PushSumGossip
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.compression import RandK
from lightning_privdec.topology import build_topology

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc").split()[0]) is None or not sys.platform.startswith("linux"),
    reason="needs a C compiler (Linux)",
)


def _terms(n: int, count: int, w0: float, seed: int) -> list[tuple[torch.Tensor, float]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=generator) * 10.0 ** (k % 3), w0 if k == 0 else (-0.6) ** k / 7)
            for k in range(count)]


@needs_compiler
@pytest.mark.parametrize("n", [1, 17, 2048 * 3 + 5, (1 << 19) + 3])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_sum_gives_torchs_bits(n: int, count: int, threads: int) -> None:
    """Into another vector and in place over t_0, w_0 = 1 and not, over block and thread boundaries."""
    assert weighted_sum.weighted_sum_kernel() is not None
    runs, run = [], weighted_sum._run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weighted_sum, "_run", lambda *args: runs.append(1) or run(*args))
        torch.set_num_threads(threads)  # (tests/conftest.py restores the count)
        for w0 in (1.0, 0.25):
            terms = _terms(n, count, w0, seed=n + count)
            expected = weighted_sum._torch_weighted_sum(torch.empty(n), terms)
            got = weighted_sum.weighted_sum_into(torch.full((n,), float("nan")), terms)
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
            first = terms[0][0].clone()
            version = first._version
            weighted_sum.weighted_sum_into(first, [(first, w0), *terms[1:]])
            assert torch.equal(first.view(torch.int32), expected.view(torch.int32))
            assert first._version > version  # the write is seen by what reads versions
    assert len(runs) == 4  # the compiled loop ran each time


@needs_compiler
def test_a_part_whose_thread_cannot_start_is_summed_by_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread to be had: every part is still written (by the calling thread), the same bits."""
    import threading

    def refuse(self) -> None:  # noqa: ANN001
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(weighted_sum, "THREAD_ENTRIES", 1 << 10)
    torch.set_num_threads(3)  # (tests/conftest.py restores the count)
    terms = _terms(10_000, 3, 1.0, seed=1)
    expected = weighted_sum._torch_weighted_sum(torch.empty(10_000), terms)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    got = weighted_sum.weighted_sum_into(torch.full((10_000,), float("nan")), terms)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_torchs_adds_run_where_the_kernel_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """float64, strided and shared (out as a later term) vectors and a switched-off kernel: torch's path,
    with the sum's value."""
    calls = []
    monkeypatch.setattr(weighted_sum, "_run", lambda *a: calls.append(a))
    n = 64
    a, b = torch.randn(2 * n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    out = torch.empty(n, dtype=torch.float64)
    weighted_sum.weighted_sum_into(out, [(a[:n], 0.5), (b, 2.0)])
    assert torch.allclose(out, 0.5 * a[:n] + 2.0 * b)
    f = torch.randn(2 * n)
    strided = torch.empty(2 * n)[::2]
    weighted_sum.weighted_sum_into(strided, [(f[:n], 1.0), (f[n:], -1.0)])
    assert torch.allclose(strided, f[:n] - f[n:])
    out, first = torch.randn(n), torch.randn(n)
    expected = first + 0.5 * out
    weighted_sum.weighted_sum_into(out, [(first, 1.0), (out, 0.5)])  # out is a later term
    assert torch.allclose(out, expected)
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setenv("PRIVDEC_NATIVE_MIXING", "0")
    monkeypatch.setattr(native, "_built", {})
    assert weighted_sum.weighted_sum_kernel() is None


def test_at_least_one_term() -> None:
    with pytest.raises(ValueError, match="at least one term"):
        weighted_sum.weighted_sum_into(torch.zeros(3), [])


@needs_compiler
@pytest.mark.parametrize("compressor", [None, RandK(0.1)])
def test_the_gossip_mixes_through_the_compiled_sum(monkeypatch: pytest.MonkeyPatch, compressor) -> None:  # noqa: ANN001
    """Push-sum's mixing and DP-CSGP's line 5 on float32 host vectors: one compiled call per round, and the same x as
    torch's adds, bit for bit, over a time-varying graph."""
    kernel = weighted_sum.weighted_sum_kernel()
    assert kernel is not None
    calls = []
    monkeypatch.setattr(weighted_sum, "weighted_sum_kernel", lambda: calls.append(1) or kernel)
    results = {}
    for use in (True, False):
        if not use:
            monkeypatch.setattr(weighted_sum, "weighted_sum_kernel", lambda: None)
        topology = build_topology("exponential-one-peer", 4)
        start = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))

        def node(rank, exchange):  # noqa: ANN001, ANN202
            gossip = PushSumGossip(start[rank].clone(), rank=rank, topology=topology, exchange=exchange,
                                   compressor=compressor, seed=5)
            for k in range(3):
                gossip.step(gossip.x - 0.1 * (k + 1))
            return gossip.x

        results[use] = torch.stack(LoopbackNetwork(4).run(node))
    assert len(calls) == 4 * 3
    assert torch.equal(results[True].view(torch.int32), results[False].view(torch.int32))


@needs_compiler
def test_the_check_takes_another_rounding_and_refuses_a_wrong_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose adds round the product and the sum apart (its default, non-vectorised kernels) gives other bits:
    the kernel is still taken, its sums being within float32 rounding; a kernel that writes zeros is refused."""
    kernel = weighted_sum.weighted_sum_kernel()
    assert kernel is not None

    def unfused(out: torch.Tensor, terms: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
        (first, w0), rest = terms[0], terms[1:]
        out.copy_(first if w0 == 1.0 else first * w0)
        for tensor, weight in rest:
            out.copy_(out + tensor * weight)  # two roundings per term
        return out

    terms = _terms(5000, 3, 1.0, seed=2)
    expected = weighted_sum._torch_weighted_sum(torch.empty(5000), terms)
    assert not torch.equal(unfused(torch.empty(5000), terms), expected)
    monkeypatch.setattr(weighted_sum, "_torch_weighted_sum", unfused)
    assert weighted_sum._check(kernel) is None
    failure = weighted_sum._check(lambda out, pointers, weights, count, n: ctypes.memset(out, 0, 4 * n))
    assert failure is not None and "outside float32 rounding" in failure
