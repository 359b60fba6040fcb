"""The ChaCha20 keystream computed on a CUDA device, for the noise of a model that lives there.

On the host path (:mod:`.keystream`) OpenSSL produces the keystream and it is copied to the device: ~3.5 ns per
coordinate on an H100, 1,000x ``torch.randn``. Here a Triton kernel computes the same RFC 8439 blocks on the device,
one 64-byte block per lane: the state (constants, the 256-bit key, the block counter, the 96-bit nonce), ten double
rounds of 32-bit additions, XORs and rotations, and the state added back. The words are OpenSSL's, bit for bit
(tested against ``cryptography`` in Triton's interpreter on the host, and on a GPU against the host draws); the
key never leaves the process, as on the host.

Used when the generator's device is CUDA, Triton is installed (it comes with torch's CUDA wheels) and the kernel
reproduces a known answer there; ``PRIVDEC_DEVICE_KEYSTREAM=0`` keeps the keystream on the host.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

from lightning_privdec import native

log = logging.getLogger(__name__)

#: pairs per chunk of a draw whose keystream is computed on the device (the host's chunks are far smaller: there the
#: chunk must fit the core's cache, here each chunk costs ~16 kernel launches); ~160 MiB of buffers in all
#: (:class:`~.keystream.KeystreamBuffers`: float64 and float32 work and output, the two keystreams)
DEVICE_CHUNK_WORDS = 1 << 21
_LANES = 256  # blocks per Triton program
_SIGMA = b"expand 32-byte k"  # RFC 8439's constants, the state's first four words

def device_keystream_available(device: torch.device) -> bool:
    """Whether a draw on ``device`` computes its keystream there: a CUDA device with Triton, unless
    ``PRIVDEC_DEVICE_KEYSTREAM=0``, and once per process and device only after the kernel reproduced known answers
    there (RFC 8439's blocks, from ``cryptography``); a kernel that cannot build or gives other words leaves the
    keystream on the host (the same values), said once in the log."""
    if device.type != "cuda" or native.switched_off("PRIVDEC_DEVICE_KEYSTREAM") or not _have_triton():
        return False
    return _known_answer(str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device())))


@functools.cache
def _have_triton() -> bool:
    """Triton comes with torch's CUDA wheels; without it the keystream stays on the host."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _known_answer(device: str) -> bool:
    """The kernel's words against OpenSSL's: a read inside a block, over several programs (600 blocks), from a
    counter of 7 and from a block past 2^31 (the arguments' widest values)."""
    key = bytes(range(1, 33))
    try:
        for counter, first_byte, n_bytes in ((7, 64 * 5 + 4, 64 * 600), ((1 << 31) + 5, 8, 64 * 3)):
            nonce = counter.to_bytes(4, "little") + bytes(range(12))
            expected = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(
                bytes(first_byte + n_bytes))[first_byte:]  # fmt: skip
            stream = DeviceChaCha20(key, nonce, torch.device(device), host_fallback=False)
            if stream.words(first_byte, n_bytes).cpu().numpy().tobytes() != expected:
                log.warning("the ChaCha20 keystream is computed on the host: the device kernel gave other words than "
                            "OpenSSL on %s", device)
                return False
    except Exception as error:  # noqa: BLE001 - no compiler, an unsupported device: the host keystream
        log.warning("the ChaCha20 keystream is computed on the host (~3.5 ns per coordinate on a GPU instead of "
                    "~0.05): the device kernel failed on %s (%s: %s)", device, type(error).__name__, error)
        return False
    return True


def _signed_words(data: bytes) -> list[int]:
    """Little-endian 32-bit words as signed integers (the kernel's scalar arguments hold their bits)."""
    return [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]


class DeviceChaCha20:
    """The ChaCha20 keystream of one (key, nonce) on a device, read at any 4-byte aligned offset.

    ``nonce`` is ``cryptography``'s 16 bytes: the 32-bit little-endian block counter, then RFC 8439's 96-bit nonce.
    The key and nonce travel as the kernel's scalar arguments (no copy to the device, which would wait for the
    device's queue). Should a launch fail after the known-answer check (``host_fallback``), the same blocks come from
    OpenSSL and are copied, from then on in this process, said once in the log.
    """

    def __init__(self, key: bytes, nonce: bytes, device: torch.device, *, host_fallback: bool = True) -> None:
        self._key, self._nonce, self._device = key, nonce, device
        self._words = (*_signed_words(_SIGMA + key + nonce),)  # c0..c3, k0..k7, counter, n0..n2
        self._counter = int.from_bytes(nonce[:4], "little")
        self._host_fallback = host_fallback

    def words(self, first_byte: int, n_bytes: int, out: Tensor | None = None) -> Tensor:
        """Keystream bytes [first_byte, first_byte + n_bytes) as int32 words (both multiples of 4), a view of
        ``out`` (int32 on the device, at least :func:`buffer_words` long) or of a new buffer."""
        if first_byte % 4 or n_bytes % 4 or first_byte < 0 or n_bytes < 0:
            raise ValueError(f"keystream reads are whole 32-bit words: got bytes {first_byte} + {n_bytes}")
        first_block, skip = divmod(first_byte, 64)
        n_blocks = -(-(skip + n_bytes) // 64)
        if self._counter + first_block + n_blocks > 1 << 32:
            raise ValueError(_PAST_THE_COUNTER)
        if out is None:
            out = torch.empty(16 * n_blocks, dtype=torch.int32, device=self._device)
        if out.dtype != torch.int32 or not out.is_contiguous() or out.numel() < 16 * n_blocks:
            raise ValueError(f"a buffer for {n_blocks} ChaCha20 blocks must be a contiguous int32 tensor of at least "
                             f"{16 * n_blocks} words: got {out.dtype}, {out.numel()} words")
        global _launch_failed
        if _launch_failed is None:
            try:
                from lightning_privdec.privacy._chacha20_triton import chacha20_blocks

                chacha20_blocks[(-(-n_blocks // _LANES),)](out, *self._words, first_block, n_blocks, LANES=_LANES)
            except Exception as error:  # noqa: BLE001 - the same words from the host below
                if not self._host_fallback:
                    raise
                _launch_failed = f"{type(error).__name__}: {error}"
                log.warning("the ChaCha20 keystream is read on the host from now on: the device kernel failed (%s)",
                            _launch_failed)
        if _launch_failed is not None:
            host = encryptor_at_block(self._key, self._nonce, first_block).update(bytes(64 * n_blocks))
            out[: 16 * n_blocks].copy_(torch.frombuffer(bytearray(host), dtype=torch.int32))
        return out[skip // 4 : (skip + n_bytes) // 4]


_launch_failed: str | None = None  # why the kernel failed at a launch after its known answers, if it did


_PAST_THE_COUNTER = "a draw of more than 2^38 keystream bytes exceeds ChaCha20's 32-bit block counter"


def encryptor_at_block(key: bytes, nonce: bytes, block: int) -> Any:
    """OpenSSL's ChaCha20 encryptor of (key, nonce) at keystream block ``block`` (``nonce`` is ``cryptography``'s 16
    bytes, the block counter first): any part of a keystream, read without the blocks before it."""
    counter = int.from_bytes(nonce[:4], "little") + block
    if counter >= 1 << 32:
        raise ValueError(_PAST_THE_COUNTER)
    return Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce[4:]), mode=None).encryptor()


def buffer_words(n_bytes: int) -> int:
    """int32 words of a buffer that holds any ``n_bytes`` read by :meth:`DeviceChaCha20.words` (whole blocks)."""
    return 16 * (-(-n_bytes // 64) + 1)
