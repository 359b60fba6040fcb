"""The ChaCha20 keystream computed on a CUDA device (privacy/device_keystream.py) is OpenSSL's, bit for bit.

On the host the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton builds the
kernel, so in a child process): the words against ``cryptography``, and a narrow draw whose keystream comes from the
kernel against the same draw from the host's keystream through the same torch transform. On a GPU the same comparison
runs on the device (skipped without CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_privdec.privacy.device_keystream import device_keystream_available
from lightning_privdec.privacy.keystream import KeyStream, KeystreamBuffers
from lightning_privdec.privacy.noise import node_noise_generator

ROOT = Path(__file__).resolve().parents[1]

INTERPRETED = textwrap.dedent(
    """
    import torch
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    from lightning_privdec.privacy import device_keystream, keystream
    from lightning_privdec.privacy.device_keystream import DeviceChaCha20
    from lightning_privdec.privacy.keystream import KeyStream, KeystreamBuffers

    key = bytes(range(7, 39))
    # the words: counters 0, 5 and next to 2^32 (blocks up to 2^32 - 1), offsets inside blocks, whole and partial
    for counter in (0, 5, 2**32 - 30):
        nonce = counter.to_bytes(4, "little") + bytes(range(40, 52))
        expected = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(64 * 30))
        stream = DeviceChaCha20(key, nonce, torch.device("cpu"))
        for first, n in ((0, 64 * 30), (64 * 3 + 12, 64 * 7 + 4), (64 * 29 + 60, 4)):
            assert stream.words(first, n).numpy().tobytes() == expected[first : first + n], (counter, first, n)
    nonce = (5).to_bytes(4, "little") + bytes(range(40, 52))
    expected = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(64 * 310))
    stream = DeviceChaCha20(key, nonce, torch.device("cpu"))
    first, n = 64 * 3 + 12, 64 * 300  # 301 blocks: two programs of 256 lanes
    assert stream.words(first, n).numpy().tobytes() == expected[first : first + n]
    try:  # a buffer too small for the blocks is refused before the kernel writes
        stream.words(0, 64 * 3, torch.empty(40, dtype=torch.int32))
    except ValueError as error:
        assert "at least 48 words" in str(error)
    else:
        raise AssertionError("a buffer too small was not refused")
    from lightning_privdec.privacy import _chacha20_triton

    kernel = _chacha20_triton.chacha20_blocks
    _chacha20_triton.chacha20_blocks = None  # a launch that fails: the same words, read on the host
    try:
        assert stream.words(first, n).numpy().tobytes() == expected[first : first + n]
        assert device_keystream._launch_failed is not None
    finally:
        _chacha20_triton.chacha20_blocks, device_keystream._launch_failed = kernel, None
    try:
        DeviceChaCha20(key, (2**32 - 2).to_bytes(4, "little") + bytes(12), torch.device("cpu")).words(0, 64 * 3)
    except ValueError as error:
        assert "block counter" in str(error)
    else:
        raise AssertionError("a read past the 32-bit block counter was not refused")

    # narrow draws: chunks of 40 pairs, so the angle stream's chunks start inside a block (and wide ones of 40
    # entries below)
    keystream.DEVICE_CHUNK_WORDS = 40
    keystream.CHUNK_WORDS = 24  # the host keystream's chunks, and the Laplace draws' (their values depend on it)
    nonce = bytes(4) + (3).to_bytes(8, "little") + bytes(4)
    for numel in (1, 2, 243):  # 243: four chunks, the last one partial, an odd number of entries
        host_buffers = KeystreamBuffers("cpu", keystream_on_device=False)
        host_buffers.host_transform = False  # the torch transform that devices run, from the host's keystream
        expected = KeyStream(key, nonce, host_buffers).standard_normal_into(torch.empty(numel), 0.7)
        device_buffers = KeystreamBuffers("cpu", keystream_on_device=True)
        assert not device_buffers.host_transform and device_buffers.chunk_words == 40
        assert host_buffers.chunk_words == 24
        got = KeyStream(key, nonce, device_buffers).standard_normal_into(torch.empty(numel), 0.7)
        assert torch.equal(got, expected), numel
        pieces = torch.empty(numel, dtype=torch.bfloat16)
        for start, values in KeyStream(key, nonce, device_buffers).normal_segments(numel, 0.7, torch.bfloat16):
            pieces[start : start + values.numel()] = values
        assert torch.equal(pieces, expected.bfloat16()), numel
    # wide (float64) draws, uniforms and Laplace draws read the keystream in order: the same words from the kernel
    for numel in (1, 83):  # 83: three chunks of 40 entries (20 pairs), the last one odd
        host_buffers = KeystreamBuffers("cpu", keystream_on_device=False)
        host_buffers.host_transform = False
        expected = KeyStream(key, nonce, host_buffers).standard_normal_into(torch.empty(numel, dtype=torch.float64))
        got = KeyStream(key, nonce, device_buffers).standard_normal_into(torch.empty(numel, dtype=torch.float64))
        assert torch.equal(got, expected), numel
    host, device = KeyStream(key, nonce, host_buffers), KeyStream(key, nonce, device_buffers)
    for n in (3, 5, 20, 1):  # sequential reads that start inside a block (at most a chunk each)
        assert torch.equal(device.uniform(n), host.uniform(n)), n
    from lightning_privdec.privacy.noise import NoiseGenerator

    expected = NoiseGenerator(key, seeded=True).laplace(97, 0.5)  # its chunks pair uniforms: the host's chunk size
    generator = NoiseGenerator(key, seeded=True)
    generator._buffers = KeystreamBuffers("cpu", keystream_on_device=True)
    assert torch.equal(generator.laplace(97, 0.5), expected)
    print("interpreted keystream ok")
    """
)


def test_the_kernel_gives_openssls_words_and_the_host_keystreams_draws_in_tritons_interpreter() -> None:
    pytest.importorskip("triton")
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interpreted keystream ok" in done.stdout


def test_a_host_only_run_does_not_import_triton() -> None:
    """The kernel's module is imported only where a draw's keystream is computed on a device (a host-only run never
    builds the Triton functions, nor needs Triton)."""
    code = ("import sys, torch; from lightning_privdec.privacy.noise import node_noise_generator; "
            "node_noise_generator('cpu', 0, 0).normal(1000, 1.0); "
            "print('triton' in sys.modules, 'lightning_privdec.privacy._chacha20_triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_the_host_keeps_its_keystream_and_the_switch_turns_the_device_kernel_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_privdec.privacy import device_keystream

    pytest.importorskip("triton")
    assert not device_keystream_available(torch.device("cpu"))
    assert KeystreamBuffers("cpu").host_transform

    def known_answer(device: str) -> bool:
        raise AssertionError("the kernel was tried")

    monkeypatch.setattr(device_keystream, "_known_answer", known_answer)
    with pytest.raises(AssertionError, match="tried"):  # without the switch, a CUDA device tries the kernel
        device_keystream_available(torch.device("cuda", 0))
    monkeypatch.setenv("PRIVDEC_DEVICE_KEYSTREAM", "0")
    assert not device_keystream_available(torch.device("cuda", 0))  # decided before the kernel or any CUDA call


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_from_the_device_keystream_equal_those_from_the_host_keystream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    assert device_keystream_available(device)
    key, nonce = bytes(range(32)), bytes(4) + (5).to_bytes(8, "little") + bytes(4)
    for numel in (1, 1001, 3 * (1 << 21) + 7):  # several device chunks
        on_device = KeyStream(key, nonce, KeystreamBuffers(device))
        assert on_device._buffers.keystream_on_device
        from_host = KeyStream(key, nonce, KeystreamBuffers(device, keystream_on_device=False))
        expected = from_host.standard_normal_into(torch.empty(numel, device=device), 1.3)
        assert torch.equal(on_device.standard_normal_into(torch.empty(numel, device=device), 1.3), expected), numel
    generator = node_noise_generator(device, 4, 0)
    monkeypatch.setenv("PRIVDEC_DEVICE_KEYSTREAM", "0")
    host_keyed = node_noise_generator(device, 4, 0)
    assert torch.equal(generator.normal(100_000, 2.0), host_keyed.normal(100_000, 2.0))
