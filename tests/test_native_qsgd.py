"""QSGD(8)'s compiled host loops (compression/native_qsgd.py): the NumPy/torch path's bits, used where they build,
and the NumPy/torch path whenever they cannot be built or trusted."""

from __future__ import annotations

import logging
import os
import shutil
import sys

import pytest
import torch

from lightning_privdec import native
from lightning_privdec.compression import QSGD, native_qsgd
from lightning_privdec.compression.base import Workspace
#: the QSGD kernels need a C compiler on Linux (no libmvec)
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc").split()[0]) is None or not sys.platform.startswith("linux"),
    reason="needs a C compiler (Linux)",
)


def _encode_decode(x: torch.Tensor, copy: torch.Tensor, key: int, use) -> list[torch.Tensor]:  # noqa: ANN001
    quantizer, sender, receiver = QSGD(8), copy.clone(), copy.clone()
    payload = quantizer._quantize(torch.sub(x, sender), key, Workspace(), feedback=sender, native=use)
    plain = quantizer._quantize(x, key, None, native=use)  # encode without feedback
    quantizer._decode_add(payload, receiver, native=use)
    return [*payload, *plain, sender, receiver]


@needs_compiler
@pytest.mark.parametrize("d", [1, 8, 13, (1 << 18) + 5, 3 * (1 << 18)])
def test_the_compiled_loops_give_the_numpy_paths_bits(d: int) -> None:
    """Levels, sign bits, norm, the sender's fed-back copy and a receiver's decoded copy: bit for bit, for sizes
    within one byte of sign bits, over chunk boundaries and on whole chunks."""
    kernels = native_qsgd.qsgd8_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(d)
    x, copy = torch.randn(d, generator=generator) * 3, torch.randn(d, generator=generator)
    for expected, got in zip(_encode_decode(x, copy, 7, False), _encode_decode(x, copy, 7, kernels)):
        assert native_qsgd._same_bits(expected, got)


@needs_compiler
def test_encoding_and_decoding_on_the_host_go_through_the_compiled_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_feedback_ and decode_add_ of a float32 vector on the host call the kernels, chunk by chunk (the encode
    on x and the copy); with PRIVDEC_NATIVE_QSGD=0 they do not."""
    kernels = native_qsgd.qsgd8_kernels()
    assert kernels is not None
    calls = []
    counted = native_qsgd.Kernels(lambda *a: calls.append(f"encode {a[-1]}") or kernels.encode(*a),
                                  lambda *a: calls.append("decode") or kernels.decode_add(*a), kernels.difference_norm)
    monkeypatch.setattr(native_qsgd, "qsgd8_kernels", lambda: counted)
    from lightning_privdec.compression import quantizers

    monkeypatch.setattr(quantizers, "qsgd8_kernels", lambda: counted)
    x, copy, out = torch.randn((1 << 18) + 3), torch.zeros((1 << 18) + 3), torch.zeros((1 << 18) + 3)
    payload = QSGD(8).encode_feedback_(x, copy, 3, Workspace())
    QSGD(8).decode_add_(payload, out, 3, Workspace())
    assert calls == ["encode True", "encode True", "decode", "decode"]
    assert native_qsgd._same_bits(out, copy)  # the receiver's copy is the sender's, bit for bit
    monkeypatch.undo()
    monkeypatch.setenv("PRIVDEC_NATIVE_QSGD", "0")
    assert native_qsgd.qsgd8_kernels() is None


@needs_compiler
def test_a_failed_check_leaves_the_numpy_path(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A kernel that gives other bits is never used: the NumPy/torch path runs, said once, decided once."""
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native_qsgd, "_same_bits", lambda expected, got: False)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native_qsgd.qsgd8_kernels() is None
        assert native_qsgd.qsgd8_kernels() is None
    assert caplog.text.count("gave other levels bits") == 1 and "PRIVDEC_NATIVE_QSGD=0" in caplog.text
    x, copy = torch.randn(100), torch.zeros(100)
    assert QSGD(8).encode_feedback_(x, copy, 1)[0].shape == (100,)  # encodes, through the NumPy/torch path


@needs_compiler
def test_the_clamp_and_strided_tensors() -> None:
    """A lone coordinate whose dithered level is s + 1 before the clamp (key 103638) gets s on both paths; strided
    copies, outputs and inputs take the NumPy/torch path and give its values."""
    kernels = native_qsgd.qsgd8_kernels()
    assert kernels is not None
    clamped = _encode_decode(torch.tensor([-1.0]), torch.zeros(1), 103638, kernels)
    assert int(clamped[0][0]) == 128
    for expected, got in zip(_encode_decode(torch.tensor([-1.0]), torch.zeros(1), 103638, False), clamped):
        assert native_qsgd._same_bits(expected, got)
    x = torch.randn(1000)
    strided_copy, copy = torch.zeros(2000)[::2], torch.zeros(1000)
    payload = QSGD(8).encode_feedback_(x, strided_copy, 5)
    assert native_qsgd._same_bits(payload[0], QSGD(8).encode_feedback_(x, copy, 5)[0])
    assert native_qsgd._same_bits(strided_copy.contiguous(), copy)
    strided_out = torch.zeros(2000)[::2]
    QSGD(8).decode_add_(payload, strided_out, 5)
    assert native_qsgd._same_bits(strided_out.contiguous(), copy)


def test_a_build_that_reaches_its_own_kernel_gets_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel's check that reaches a path using that kernel gets None (the fallback) instead of waiting forever on
    its own build; another kernel's build does not wait for it."""
    monkeypatch.setattr(native, "_built", {})
    seen = []

    def build() -> str:
        seen.append(native.once("kernel", build))  # re-entrant: the fallback
        seen.append(native.once("other", lambda: "other kernel"))  # another kernel: built meanwhile
        return "kernel"

    assert native.once("kernel", build) == "kernel" and seen == [None, "other kernel"]
    assert native.once("kernel", lambda: "rebuilt") == "kernel"  # once


@needs_compiler
def test_the_compiled_difference_norm_is_torchs() -> None:
    """||x - copy|| from the compiled pass has torch.linalg.vector_norm(x - copy)'s bits: every length up to 70
    (each remainder of 8), over chunks, and the check's vectors (NaN, zeros, negative zeros, tiny, overflowing)."""
    kernels = native_qsgd.qsgd8_kernels()
    assert kernels is not None and kernels.difference_norm is not None
    generator = torch.Generator().manual_seed(11)
    pairs = [(x, copy) for x, copy, _ in native_qsgd.check_vectors()]
    pairs += [(torch.randn(n, generator=generator) * scale, torch.randn(n, generator=generator))
              for n in [*range(1, 71), (1 << 18) + 7, 3 * (1 << 18) + 2] for scale in (1e-20, 0.1, 1.0, 3e18)]
    for x, copy in pairs:
        got = torch.tensor(kernels.difference_norm(x.numpy(), copy.numpy()), dtype=torch.float32)
        assert native_qsgd._same_bits(torch.linalg.vector_norm(x - copy), got), (x.numel(), float(got))


@needs_compiler
@pytest.mark.parametrize("d", [1, 13, (1 << 18) + 5, 3 * (1 << 18)])
def test_encode_feedback_forms_the_difference_in_the_compiled_pass(d: int) -> None:
    """encode_feedback_ on the host hands x and the copy to the kernels (of_difference): no model-sized difference is
    written into the workspace, and payload and copies are the NumPy/torch path's bits (which writes it)."""
    generator = torch.Generator().manual_seed(d)
    x, copy = torch.randn(d, generator=generator) * 3, torch.randn(d, generator=generator)
    results = []
    for use in (False, native_qsgd.qsgd8_kernels()):
        workspace, sender, receiver = Workspace(), copy.clone(), copy.clone()
        payload = QSGD(8)._quantize(x, 9, workspace, feedback=sender, native=use, difference=True)
        QSGD(8)._decode_add(payload, receiver, native=use)
        results.append([*payload, sender, receiver])
        assert ("difference" in workspace._tensors) == (use is False)
    for expected, got in zip(*results):
        assert native_qsgd._same_bits(expected, got)
    assert native_qsgd._same_bits(results[1][3], results[1][4])  # the receiver's copy is the sender's


@needs_compiler
def test_a_difference_norm_unlike_torchs_keeps_the_compiled_encode(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Where torch's norm is not the one the compiled pass reproduces, torch computes it (said in the log's info, no
    warning) and the compiled encode still runs on a difference in the workspace; x sharing the copy's memory takes
    that way too."""
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native_qsgd, "_check_norm", lambda difference_norm: "gave another norm")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        kernels = native_qsgd.qsgd8_kernels()
    assert kernels is not None and kernels.difference_norm is None
    assert "through torch" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    x, copy, workspace = torch.randn(1000), torch.randn(1000), Workspace()
    expected = QSGD(8)._quantize(x, 4, None, feedback=copy.clone(), native=False, difference=True)
    got = QSGD(8)._quantize(x, 4, workspace, feedback=copy.clone(), native=kernels, difference=True)
    assert "difference" in workspace._tensors and all(map(native_qsgd._same_bits, expected, got))
    monkeypatch.undo()
    both = torch.randn(2000)
    apart = QSGD(8)._quantize(both[:1000].clone(), 4, None, feedback=both[1000:].clone(), native=False,
                              difference=True)
    shared = QSGD(8)._quantize(both[:1000], 4, None, feedback=both[1000:], native=native_qsgd.qsgd8_kernels(),
                               difference=True)  # one storage: not handed to the kernels as two vectors
    assert all(map(native_qsgd._same_bits, apart, shared))


@needs_compiler
def test_x_overlapping_the_copy_in_another_storage_takes_the_written_difference() -> None:
    """Two views of one NumPy array are two torch storages: overlapping memory is found by its addresses, and such a
    pair gets the torch path's payload and feedback instead of a refusal by the compiled kernels."""
    import numpy as np

    array = np.random.default_rng(5).standard_normal(1500).astype(np.float32)
    x, copy = torch.from_numpy(array[:1000]), torch.from_numpy(array[500:])
    expected_copy = copy.clone()
    expected = QSGD(8)._quantize(x.clone(), 4, None, feedback=expected_copy, native=False, difference=True)
    got = QSGD(8)._quantize(x, 4, None, feedback=copy, native=native_qsgd.qsgd8_kernels(), difference=True)
    assert all(map(native_qsgd._same_bits, expected, got)) and native_qsgd._same_bits(expected_copy, copy)
    with pytest.raises(ValueError, match="needs the feedback copy"):
        QSGD(8)._quantize(x, 4, None, feedback=None, difference=True)
