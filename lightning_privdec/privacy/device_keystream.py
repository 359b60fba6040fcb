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
import logging
import os

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

try:  # Triton comes with torch's CUDA wheels; without it the keystream stays on the host
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

log = logging.getLogger(__name__)

#: pairs per chunk of a narrow draw whose keystream is computed on the device (the host's chunks are far smaller:
#: there the chunk must fit the core's cache, here each chunk costs ~16 kernel launches); ~100 MB of buffers
DEVICE_CHUNK_WORDS = 1 << 21
_LANES = 256  # blocks per Triton program
_SIGMA = b"expand 32-byte k"  # RFC 8439's constants, the state's first four words

if triton is not None:

    @triton.jit
    def _rotl(x, n: tl.constexpr):  # noqa: ANN001, ANN202
        return (x << n) | (x >> (32 - n))

    @triton.jit
    def _quarter_round(a, b, c, d):  # noqa: ANN001, ANN202 - RFC 8439, section 2.1
        a = a + b
        d = _rotl(d ^ a, 16)
        c = c + d
        b = _rotl(b ^ c, 12)
        a = a + b
        d = _rotl(d ^ a, 8)
        c = c + d
        b = _rotl(b ^ c, 7)
        return a, b, c, d

    @triton.jit
    def _chacha20_blocks(state_ptr, out_ptr, first_block, n_blocks, LANES: tl.constexpr):  # noqa: ANN001, ANN202
        """Keystream blocks ``first_block + i`` (i < n_blocks) of the 16-word state at ``state_ptr`` (int32, the
        counter in word 12) into ``out_ptr`` (int32, 16 words per block, in the keystream's order)."""
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        live = lane < n_blocks
        zero = tl.zeros([LANES], dtype=tl.uint32)
        s0 = tl.load(state_ptr + 0).to(tl.uint32, bitcast=True)
        s1 = tl.load(state_ptr + 1).to(tl.uint32, bitcast=True)
        s2 = tl.load(state_ptr + 2).to(tl.uint32, bitcast=True)
        s3 = tl.load(state_ptr + 3).to(tl.uint32, bitcast=True)
        s4 = tl.load(state_ptr + 4).to(tl.uint32, bitcast=True)
        s5 = tl.load(state_ptr + 5).to(tl.uint32, bitcast=True)
        s6 = tl.load(state_ptr + 6).to(tl.uint32, bitcast=True)
        s7 = tl.load(state_ptr + 7).to(tl.uint32, bitcast=True)
        s8 = tl.load(state_ptr + 8).to(tl.uint32, bitcast=True)
        s9 = tl.load(state_ptr + 9).to(tl.uint32, bitcast=True)
        s10 = tl.load(state_ptr + 10).to(tl.uint32, bitcast=True)
        s11 = tl.load(state_ptr + 11).to(tl.uint32, bitcast=True)
        s13 = tl.load(state_ptr + 13).to(tl.uint32, bitcast=True)
        s14 = tl.load(state_ptr + 14).to(tl.uint32, bitcast=True)
        s15 = tl.load(state_ptr + 15).to(tl.uint32, bitcast=True)
        # the block counter: the state's plus the block's index (the caller keeps it below 2^32)
        s12 = tl.load(state_ptr + 12).to(tl.uint32, bitcast=True) + (lane.to(tl.int64) + first_block).to(tl.uint32)
        x0, x1, x2, x3, x4, x5, x6, x7 = zero + s0, zero + s1, zero + s2, zero + s3, zero + s4, zero + s5, zero + s6, \
            zero + s7
        x8, x9, x10, x11, x12, x13, x14, x15 = zero + s8, zero + s9, zero + s10, zero + s11, s12, zero + s13, \
            zero + s14, zero + s15
        for _ in range(10):  # ten double rounds: a column round, then a diagonal round
            x0, x4, x8, x12 = _quarter_round(x0, x4, x8, x12)
            x1, x5, x9, x13 = _quarter_round(x1, x5, x9, x13)
            x2, x6, x10, x14 = _quarter_round(x2, x6, x10, x14)
            x3, x7, x11, x15 = _quarter_round(x3, x7, x11, x15)
            x0, x5, x10, x15 = _quarter_round(x0, x5, x10, x15)
            x1, x6, x11, x12 = _quarter_round(x1, x6, x11, x12)
            x2, x7, x8, x13 = _quarter_round(x2, x7, x8, x13)
            x3, x4, x9, x14 = _quarter_round(x3, x4, x9, x14)
        base = out_ptr + lane.to(tl.int64) * 16
        tl.store(base + 0, (x0 + s0).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 1, (x1 + s1).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 2, (x2 + s2).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 3, (x3 + s3).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 4, (x4 + s4).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 5, (x5 + s5).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 6, (x6 + s6).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 7, (x7 + s7).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 8, (x8 + s8).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 9, (x9 + s9).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 10, (x10 + s10).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 11, (x11 + s11).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 12, (x12 + s12).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 13, (x13 + s13).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 14, (x14 + s14).to(tl.int32, bitcast=True), mask=live)
        tl.store(base + 15, (x15 + s15).to(tl.int32, bitcast=True), mask=live)


def device_keystream_available(device: torch.device) -> bool:
    """Whether a draw on ``device`` computes its keystream there: a CUDA device with Triton, unless
    ``PRIVDEC_DEVICE_KEYSTREAM=0``, and once per process and device only after the kernel reproduced a known answer
    there (RFC 8439's blocks, from ``cryptography``); a kernel that cannot build or gives other words leaves the
    keystream on the host (the same values), said once in the log."""
    if triton is None or device.type != "cuda" or os.environ.get("PRIVDEC_DEVICE_KEYSTREAM", "1") == "0":
        return False
    return _known_answer(str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device())))


@functools.cache
def _known_answer(device: str) -> bool:
    key, nonce = bytes(range(1, 33)), (7).to_bytes(4, "little") + bytes(range(12))
    expected = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(64 * 3))
    try:
        got = DeviceChaCha20(key, nonce, torch.device(device)).words(4, 64 * 3 - 4).cpu().numpy().tobytes()
    except Exception as error:  # noqa: BLE001 - no compiler, an unsupported device: the host keystream
        log.warning("the ChaCha20 keystream is computed on the host (~3.5 ns per coordinate on a GPU instead of "
                    "~0.01): the device kernel failed on %s (%s: %s)", device, type(error).__name__, error)
        return False
    if got != expected[4:]:
        log.warning("the ChaCha20 keystream is computed on the host: the device kernel gave other words than "
                    "OpenSSL on %s", device)
        return False
    return True


class DeviceChaCha20:
    """The ChaCha20 keystream of one (key, nonce) on a device, read at any 4-byte aligned offset.

    ``nonce`` is ``cryptography``'s 16 bytes: the 32-bit little-endian block counter, then RFC 8439's 96-bit nonce.
    """

    def __init__(self, key: bytes, nonce: bytes, device: torch.device) -> None:
        self._state = torch.frombuffer(bytearray(_SIGMA + key + nonce), dtype=torch.int32).to(device)
        self._counter = int.from_bytes(nonce[:4], "little")

    def words(self, first_byte: int, n_bytes: int, out: Tensor | None = None) -> Tensor:
        """Keystream bytes [first_byte, first_byte + n_bytes) as int32 words (both multiples of 4), a view of
        ``out`` (int32 on the device, at least :func:`buffer_words` long) or of a new buffer."""
        first_block, skip = divmod(first_byte, 64)
        n_blocks = -(-(skip + n_bytes) // 64)
        if self._counter + first_block + n_blocks > 1 << 32:
            raise ValueError("a draw of more than 2^38 keystream bytes exceeds ChaCha20's 32-bit block counter")
        if out is None:
            out = torch.empty(16 * n_blocks, dtype=torch.int32, device=self._state.device)
        _chacha20_blocks[(triton.cdiv(n_blocks, _LANES),)](self._state, out, first_block, n_blocks, LANES=_LANES)
        return out[skip // 4 : (skip + n_bytes) // 4]


def buffer_words(n_bytes: int) -> int:
    """int32 words of a buffer that holds any ``n_bytes`` read by :meth:`DeviceChaCha20.words` (whole blocks)."""
    return 16 * (-(-n_bytes // 64) + 1)
