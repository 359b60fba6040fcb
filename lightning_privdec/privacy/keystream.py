"""The ChaCha20 keystream of one draw, read chunk by chunk and turned into uniforms and standard normals.

The formats (53-bit uniforms, the wide and the narrow Box-Muller draws) are :mod:`lightning_privdec.privacy.noise`'s,
documented there and in :class:`KeyStream`; :class:`~lightning_privdec.privacy.noise.NoiseGenerator` keys and numbers
the draws. A chunk of a narrow draw reads its own keystream offsets, so the chunks of one draw can be drawn on several
threads (:meth:`KeyStream.narrow_host_draw`) with the values of one sequential read.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_privdec import native
from lightning_privdec.privacy.device_keystream import (
    DEVICE_CHUNK_WORDS, DeviceChaCha20, buffer_words, device_keystream_available, encryptor_at_block,
)
from lightning_privdec.privacy.native_noise import native_transform

#: 64-bit keystream words per chunk (a wide draw's entries, a narrow draw's pairs): a draw is read and transformed
#: chunk by chunk in reused buffers (~3 MB for a narrow chunk: NumPy's calls cost a microsecond or more each, so
#: chunks somewhat larger than the core's L2 are fastest); its values never depend on it
CHUNK_WORDS = 1 << 17
_MASK_53 = (1 << 53) - 1
_ANGLE_SCALE32 = 2.0 * math.pi * 2.0**-32  # a narrow draw's angle per unit of its signed 32-bit integer
#: a narrow draw whose fl32(1 - u1) is at least this (every u1 <= 2^-12) has its logarithm taken in float64
#: (:func:`_narrow_box_muller`)
_NEAR_ONE32 = np.float32(1.0 - 2.0**-12)


def _chunk_pairs(numel: int, first: int, chunk: int | None = None) -> tuple[int, int]:
    """(p, q) of the narrow chunk of a draw of ``numel`` whose pairs start at ``first``: its pairs (at most
    ``chunk``, default :data:`CHUNK_WORDS`), and how many of them give a sine (the draw's cosines fill [0, half), its
    sines [half, numel), half = its number of pairs)."""
    half = (numel + 1) // 2
    p = min(chunk or CHUNK_WORDS, half - first)
    return p, max(0, min(p, numel - half - first))


def _angle_nonce(nonce: bytes) -> bytes:
    """The nonce of a narrow draw's angle keystream: the draw's own nonce with its last 32-bit word XOR 1 (0 in
    every nonce NoiseGenerator draws with), i.e. a second keystream under the same key that no draw reads otherwise."""
    return nonce[:12] + (int.from_bytes(nonce[12:], "little") ^ 1).to_bytes(4, "little")


def _top53_np(words: np.ndarray, complement: bool = False) -> np.ndarray:
    """:func:`_top53_` of an int64 NumPy array, in place: k = w >> 11 (u = k 2^-53), or m = 2^53 - k (1 - u =
    m 2^-53, an integer in [1, 2^53])."""
    np.right_shift(words.view(np.uint64), 11, out=words.view(np.uint64))
    if complement:
        np.subtract(1 << 53, words, out=words)
    return words


def _top53_(words: Tensor, complement: bool = False) -> Tensor:
    """In place, int64 keystream words -> their 53-bit uniforms' integers k = w >> 11 (u = k 2^-53), or with
    ``complement`` m = 2^53 - k (1 - u = m 2^-53). Host words (an accelerator's keystream read on the host) go
    through NumPy, which never spreads them over torch's intra-op threads: several processes sharing a machine's
    cores would each wait for its threads on every chunk."""
    if words.device.type == "cpu":
        _top53_np(words.numpy(), complement)
        return words
    words.bitwise_right_shift_(11).bitwise_and_(_MASK_53)  # arithmetic shift: mask off the sign's copies
    return words.neg_().add_(1 << 53) if complement else words


class KeystreamBuffers:
    """Host and device buffers for reading keystreams and transforming them chunk by chunk, kept across draws (fresh
    large allocations are slow). They grow to the largest chunk asked for, at most :attr:`chunk_words` 64-bit words
    (a wide chunk's entries, a narrow chunk's pairs).

    ``keystream_on_device``: whether narrow draws compute their keystream on the device (:mod:`.device_keystream`,
    by default on a CUDA device where its kernel works) instead of reading OpenSSL's on the host and copying it.
    """

    def __init__(
        self, device: torch.device | str = "cpu", *, narrow_only: bool = False, keystream_on_device: bool | None = None
    ) -> None:
        self.device = torch.device(device)
        self.widths = (torch.float32,) if narrow_only else (torch.float64, torch.float32)  # the draws' transforms
        self.keystream_on_device = (device_keystream_available(self.device) if keystream_on_device is None
                                    else keystream_on_device)  # fmt: skip
        self.host_transform = self.device.type == "cpu" and not self.keystream_on_device  # NumPy's, else torch's
        self.size = 0

    @property
    def chunk_words(self) -> int:
        """A chunk's 64-bit words: larger where the keystream is computed on the device (each chunk costs ~16 kernel
        launches there) than on the host (where a chunk fits the core's cache)."""
        return DEVICE_CHUNK_WORDS if self.keystream_on_device else CHUNK_WORDS

    def reserve(self, words: int) -> None:
        words = min(max(words, 1), self.chunk_words)
        if words > self.size:
            host = min(words, CHUNK_WORDS)  # the host keystream is read in chunks of at most CHUNK_WORDS
            self.zeros = bytes(8 * host)
            self.raw = bytearray(8 * host)  # the draw's keystream, 64-bit words
            self.words = torch.frombuffer(self.raw, dtype=torch.int64)
            self.angle_raw = bytearray(4 * host)  # a narrow draw's angle keystream, 32-bit words
            self.angle_words = torch.frombuffer(self.angle_raw, dtype=torch.int32)
            if self.keystream_on_device:  # whole ChaCha20 blocks of a narrow chunk's two keystreams
                self.device_words = torch.empty(buffer_words(8 * words), dtype=torch.int32, device=self.device)
                self.device_angle_words = torch.empty(buffer_words(4 * words), dtype=torch.int32, device=self.device)
            if torch.float64 in self.widths:
                self.uniform = torch.empty(words, dtype=torch.float64, device=self.device)
            # the transform's per-pair work (squared radius or r, angle, cosine; a narrow chunk has one pair per
            # word, a wide one per two) and a chunk of output (two entries per narrow pair), per width
            self.work = {dt: torch.empty(3, words, dtype=dt, device=self.device) for dt in self.widths}
            self.out = {dt: torch.empty(2 * words, dtype=dt, device=self.device) for dt in self.widths}
            if self.device.type == "cpu":  # the same memory as NumPy arrays, for the host transform
                self.np_work = {dt: w.numpy() for dt, w in self.work.items()}
                self.np_words, self.np_angles = self.words.numpy(), self.angle_words.numpy()
                self.np_mask = np.empty(words, dtype=bool)
                self.np_out32 = self.out[torch.float32].numpy()
            self.size = words


def _narrow_box_muller(
    words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray, buffers: KeystreamBuffers,
    scale: float,
) -> None:
    """The narrow format on the host (:class:`KeyStream`): ``cosines = scale r cos t``, ``sines = scale r sin t``
    (the first ``len(sines)`` pairs) in float32 from the pairs' int64 radius words and int32 angle words: in one
    compiled loop (:mod:`.native_noise`, the same float32 arithmetic with glibc's vector logarithm, cosine and sine)
    where it builds, else in NumPy (:func:`_narrow_box_muller_numpy`)."""
    native = native_transform()
    if native is None:
        _narrow_box_muller_numpy(words, angles, cosines, sines, buffers, scale)
    else:
        native(words, angles, cosines, sines, *_narrow_constants(scale))


def _narrow_constants(scale: float) -> tuple[float, float, float]:
    """The narrow transform's float32 constants: fl32(-2 scale^2), the angle's scale and the float64 logarithm's
    boundary (as Python floats of those float32 values)."""
    return float(np.float32(-2.0 * scale * scale)), float(np.float32(_ANGLE_SCALE32)), float(_NEAR_ONE32)


def _narrow_box_muller_numpy(
    words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray, buffers: KeystreamBuffers,
    scale: float,
) -> None:
    """:func:`_narrow_box_muller` in NumPy, in place in the words and the buffers' work arrays, one pass each.

    The squared radius ``-2 log(1 - u1)`` is float32's logarithm of ``v = fl32(m) 2^-53`` with ``m = 2^53 (1 - u1)``
    the exact integer in [1, 2^53]: v keeps m's exponent (down to 2^-53: the largest draw is sqrt(2 ln 2^53) ~ 8.57
    as in float64) and a relative error of at most 2^-24, i.e. ``|log fl32(v) - log v| <= 2^-24`` plus the float32
    logarithm's own rounding. That is float32 precision wherever |log v| is not small. Where it is (r near 0:
    ``fl32(v) >= 1 - 2^-12``, which holds for every u1 <= 2^-12, about one pair in 4,096) the logarithm is taken in
    float64 from the exact m, so the density near 0 stays resolved down to r = 2^-26 (u1 = 2^-53) as with a float64
    radius. Elsewhere r is within a relative ``2^-25 / |log v| + 2^-22`` of the float64 radius: at most ~2^-13 (at
    r ~ 2^-5.5), an absolute error below ``2^-24 / r`` per unit of scale, under the float32 output's own rounding
    for r >= 1. In distribution: the radius's CDF moves by at most the probability of its rounding intervals,
    ~2^-24, and the tails (r > 5.5, u1 > 1 - 2^-21.8) keep a relative precision of 2^-22."""
    p, q = len(cosines), len(sines)
    radius, theta, cosine = buffers.np_work[torch.float32][:, :p]
    _top53_np(words, complement=True)  # m = 2^53 (1 - u1)
    np.copyto(radius, words, casting="unsafe")  # fl32(m): relative error <= 2^-24
    np.multiply(radius, np.float32(2.0**-53), out=radius)  # v, exact (a power of two; float32 reaches 2^-126)
    near = np.flatnonzero(np.greater_equal(radius, _NEAR_ONE32, out=buffers.np_mask[:p]))
    np.log(radius, out=radius)
    if near.size:
        radius[near] = np.log(words[near] * 2.0**-53)  # float64 from the exact m, rounded once
    radius_factor, angle_scale, _ = _narrow_constants(scale)
    np.multiply(radius, np.float32(radius_factor), out=radius)  # r^2 scale^2
    np.sqrt(radius, out=radius)
    np.copyto(theta, angles, casting="unsafe")  # fl32(a): a relative 2^-24
    np.multiply(theta, np.float32(angle_scale), out=theta)  # t = 2 pi a 2^-32, rounded twice in all
    np.cos(theta, out=cosine)
    np.sin(theta, out=theta)
    np.multiply(radius, cosine, out=cosines)
    np.multiply(radius[:q], theta[:q], out=sines)


class KeyStream:
    """The ChaCha20 keystream under (key, nonce), read as 53-bit uniforms and as standard normals.

    Box-Muller turns a pair (u1, u2) into ``r cos t, r sin t`` with ``r^2 = -2 log(1 - u1)``, u1 a 53-bit uniform
    (``1 - u1 >= 2^-53`` sets the tails, up to ~8.6 sigma; ``1 - u1`` is exact, its logarithm and r^2 are float64),
    in one of two formats:

    * **wide** (float64 draws, and :func:`keyed_standard_normal`'s documented format): u1 and u2 are consecutive
      64-bit words of this keystream, both 53-bit uniforms, ``t = 2 pi u2``; the draws are interleaved
      ``r1 cos t1, r1 sin t1, r2 cos t2, ...``; all in float64.
    * **narrow** (float32 and narrower draws): u1 is the next 64-bit word of this keystream, u2 the next 32-bit
      word of the angle keystream (:func:`_angle_nonce`), a signed integer a, ``t = 2 pi a 2^-32`` in [-pi, pi),
      computed as ``fl32(fl32(a) fl32(2 pi 2^-32))``: within ``pi 2^-25 + 1.5 2^-24 + 2^-23 < 2^-21`` of 2 pi a
      2^-32 (the roundings of a, of the constant and of the product); 12 keystream bytes per pair instead of 16.
      Of n draws (h = ceil(n / 2) pairs) entries [0, h) are the cosines and [h, n) the sines of the first n - h
      pairs (contiguous writes); r's square root, t and its cosine and sine are float32; on the host the logarithm
      too, except near r = 0 (:func:`_narrow_box_muller`), on other devices it is float64.

    A draw depends on the key, the nonce and its length only, never on the chunk size or the threads (a narrow draw
    on the host also on the last bits of its transform's logarithm, cosine and sine). On the host a narrow draw's
    transform runs in one compiled loop (:mod:`.native_noise`, where a C compiler and glibc's libmvec are found),
    else in NumPy (its SIMD logarithm, sine and cosine are 2-3x torch's on one core), neither spreading a chunk over
    threads that may be busy; the two differ in the last bits of those three functions only. A wide draw's transform
    runs in NumPy. On other devices the transform runs in torch, from a keystream computed on the device where
    :mod:`.device_keystream` works there (the same words), else read on the host and copied.
    """

    def __init__(self, key: bytes, nonce: bytes, buffers: KeystreamBuffers) -> None:
        self._key, self._nonce = key, nonce
        # the sequential reads' encryptors, made at their first read (a float32 draw on the host reads by offsets)
        self._encryptor: Any = None
        self._angles: Any = None
        self._device_streams: tuple[DeviceChaCha20, DeviceChaCha20] | None = None  # on the device, at first read
        # bytes of each keystream read so far by _read and _read_angles on the device (a KeyStream serves one draw:
        # its sequential reads, or a narrow draw's reads at offsets, never both)
        self._device_read = [0, 0]
        self._buffers = buffers
        self._box_muller = self._box_muller_host if buffers.host_transform else self._box_muller_torch

    def _read_pairs(self, first: int, p: int, buffers: KeystreamBuffers) -> None:
        """Pairs [first, first + p) of a narrow draw, read at their own offsets (ChaCha20's block counter is the
        nonce's first word) into ``buffers``' ``raw`` and ``angle_raw``: a chunk needs no earlier chunk's reads, so
        chunks can be drawn on any thread in any order, with the values of one sequential read."""
        buffers.reserve(p)
        for nonce, width, raw in ((self._nonce, 8, buffers.raw), (_angle_nonce(self._nonce), 4, buffers.angle_raw)):
            block, skip = divmod(width * first, 64)
            encryptor = encryptor_at_block(self._key, nonce, block)
            if skip:
                encryptor.update(bytes(skip))
            encryptor.update_into(memoryview(buffers.zeros)[: width * p], raw)

    def narrow_host_chunk(
        self, first: int, p: int, q: int, scale: float, buffers: KeystreamBuffers, target: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pairs [first, first + p) of a narrow draw on the host, q of their sines: into ``target`` (the draw's
        float32 vector, cosines at [first, first + p), sines at [half + first, half + first + q)) when given, else
        into ``buffers``' output; returns (cosines, sines), float32 NumPy arrays."""
        self._read_pairs(first, p, buffers)
        if target is not None:
            half = (len(target) + 1) // 2
            cosines, sines = target[first : first + p], target[half + first : half + first + q]
        else:
            out = buffers.np_out32
            cosines, sines = out[:p], out[p : p + q]
        _narrow_box_muller(buffers.np_words[:p], buffers.np_angles[:p], cosines, sines, buffers, scale)
        return cosines, sines

    def narrow_host_draw(
        self, numel: int, scale: float, buffers: Sequence[KeystreamBuffers], target: np.ndarray | None,
        consume: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
        transform: Callable[[int, np.ndarray, np.ndarray, int], None] | None = None,
    ) -> None:
        """One narrow draw of ``numel`` on the host, its chunks shared by ``len(buffers)`` threads (this one and
        ``len(buffers) - 1`` more, one buffer set each): into ``target`` (a float32 NumPy vector) or, chunk by chunk
        on the thread that drew it, ``consume(first, cosines, sines)`` (entries [first, ..) and [half + first, ..)),
        or ``transform(first, words, angles, q)``: the chunk's keystream pairs (int64 radius words, int32 angle words,
        in the thread's buffers), q of them with a sine, for the caller's own transform (the noise added as it is
        made: :meth:`~.noise.NoiseGenerator.add_normal_`).
        The values are those of one sequential read whatever the threads: each chunk reads its own keystream offsets,
        and ChaCha20 and NumPy's loops run without the GIL. A thread takes the next chunk when it is done with its
        last; the first failure stops every thread before its next chunk and is raised here, after all have ended.
        The threads are :func:`~lightning_privdec.native.run_parts`'s (the further ones kept off this one's CPU)."""
        chunks = iter(range(0, (numel + 1) // 2, CHUNK_WORDS))
        lock, stopped = threading.Lock(), []

        def work(own: KeystreamBuffers) -> None:
            while True:
                with lock:
                    first = None if stopped else next(chunks, None)
                if first is None:
                    return
                p, q = _chunk_pairs(numel, first)
                if transform is not None:
                    self._read_pairs(first, p, own)
                    transform(first, own.np_words[:p], own.np_angles[:p], q)
                    continue
                cosines, sines = self.narrow_host_chunk(first, p, q, scale, own, target)
                if consume is not None:
                    consume(first, cosines, sines)

        # a failure, or an interrupt while waiting, stops every thread before its next chunk
        native.run_parts([functools.partial(work, own) for own in buffers], stop=lambda: stopped.append(True))

    def _read(self, n: int) -> Tensor:
        """The next ``n`` (at most the buffers' chunk) 64-bit words of the keystream: int64, a reused buffer, on the
        device where the keystream is computed there, else on the host."""
        b = self._buffers
        if b.keystream_on_device:
            b.reserve(n)
            words = self._device_stream(0).words(self._device_read[0], 8 * n, b.device_words)
            self._device_read[0] += 8 * n
            return words.view(torch.int64)
        if self._encryptor is None:
            self._encryptor = encryptor_at_block(self._key, self._nonce, 0)
        b.reserve(n)
        self._encryptor.update_into(memoryview(b.zeros)[: 8 * n], b.raw)
        return b.words[:n]

    def _device_stream(self, which: int) -> DeviceChaCha20:
        """The keystream (0) or the angle keystream (1) computed on the buffers' device, made at its first read."""
        if self._device_streams is None:
            device = self._buffers.device
            self._device_streams = (DeviceChaCha20(self._key, self._nonce, device),
                                    DeviceChaCha20(self._key, _angle_nonce(self._nonce), device))
        return self._device_streams[which]

    def _device_pairs(self, first: int, p: int) -> tuple[Tensor, Tensor]:
        """A narrow draw's pairs [first, first + p) computed on the device at their own offsets: (int64 radius words,
        int32 angle words), views of the buffers (valid until the next chunk)."""
        b = self._buffers
        b.reserve(p)
        return (self._device_stream(0).words(8 * first, 8 * p, b.device_words).view(torch.int64),
                self._device_stream(1).words(4 * first, 4 * p, b.device_angle_words))

    def _read_angles(self, n: int) -> Tensor:
        """The next ``n`` (at most the buffers' chunk) 32-bit words of the angle keystream (int32, a reused buffer,
        where :meth:`_read`'s words are)."""
        b = self._buffers
        if b.keystream_on_device:
            b.reserve(n)
            words = self._device_stream(1).words(self._device_read[1], 4 * n, b.device_angle_words)
            self._device_read[1] += 4 * n
            return words
        if self._angles is None:
            self._angles = encryptor_at_block(self._key, _angle_nonce(self._nonce), 0)
        b.reserve(n)
        self._angles.update_into(memoryview(b.zeros)[: 4 * n], b.angle_raw)
        return b.angle_words[:n]

    def uniform(self, n: int) -> Tensor:
        """The next ``n`` (at most the buffers' chunk) uniforms in [0, 1): float64 on the buffers' device, a view of
        a reused buffer (valid until the next read)."""
        words = _top53_(self._read(n))
        out = self._buffers.uniform[:n]
        out.copy_(words)  # exact: 53-bit integers fit float64
        return out.mul_(2.0**-53)

    def standard_normal_into(self, out: Tensor, scale: float = 1.0) -> Tensor:
        """Fill the flat floating tensor ``out`` with one draw of ``out.numel()`` entries ``scale`` N(0, 1)."""
        for _ in self.normal_segments(out.numel(), scale, out.dtype, out):
            pass
        return out

    def normal_segments(
        self, numel: int, scale: float, dtype: torch.dtype, out: Tensor | None = None
    ) -> Iterator[tuple[int, Tensor]]:
        """One draw of ``numel`` entries ``scale`` N(0, 1) of ``dtype`` (the wide format for float64, else the
        narrow one), chunk by chunk, as ``(start, values)``: entries ``start ..`` of the draw. With ``out`` (the whole
        flat vector, on the buffers' device) the values are written there; else they are views of a reused chunk
        buffer (valid until the next segment but one)."""
        b = self._buffers
        if dtype == torch.float64:
            chunk = b.chunk_words  # even
            for start in range(0, numel, chunk):
                m = min(chunk, numel - start)
                pairs = (m + 1) // 2
                words = self._read(2 * pairs).view(pairs, 2)
                direct = out is not None and m % 2 == 0
                dest = (out[start : start + m] if direct else b.out[dtype][: 2 * pairs]).view(pairs, 2)
                self._box_muller(words[:, 0], words[:, 1], dest[:, 0], dest[:, 1], scale)
                values = dest.view(-1)[:m]  # an odd m drops the last pair's sine
                if out is not None and not direct:
                    values = out[start : start + m].copy_(values)
                yield start, values
            return
        half = (numel + 1) // 2  # pairs: their cosines fill [0, half), the sines [half, numel)
        direct = out is not None and out.dtype == torch.float32
        host = b.host_transform
        target = out.numpy() if direct and host else None  # the host loop writes through NumPy views
        chunk = b.chunk_words
        for first in range(0, half, chunk):
            p, q = _chunk_pairs(numel, first, chunk)
            if host:
                cosines, sines = map(torch.from_numpy, self.narrow_host_chunk(first, p, q, scale, b, target))
            else:
                b.reserve(p)
                if direct:
                    cosines, sines = out[first : first + p], out[half + first : half + first + q]
                else:
                    cosines, sines = b.out[torch.float32][:p], b.out[torch.float32][p : p + q]
                words = self._device_pairs(first, p) if b.keystream_on_device else (self._read(p), self._read_angles(p))
                self._box_muller(*words, cosines, sines, scale)
            if out is not None and not direct:  # bfloat16, float16: rounded from float32
                cosines = out[first : first + p].copy_(cosines)
                sines = out[half + first : half + first + q].copy_(sines)
            elif dtype != torch.float32:
                cosines, sines = cosines.to(dtype), sines.to(dtype)
            yield first, cosines
            if q:
                yield half + first, sines

    def _box_muller_host(
        self, radius_words: Tensor, angle_words: Tensor, cosines: Tensor, sines: Tensor, scale: float
    ) -> None:
        """``cosines = scale r cos t`` and ``sines = scale r sin t`` (the first ``sines.numel()`` pairs) from the
        pairs' keystream words, in NumPy, in place in the words and the buffers (the class docstring's formats: int32
        angle words are narrow, int64 ones wide)."""
        if angle_words.dtype == torch.int32:
            _narrow_box_muller(radius_words.numpy(), angle_words.numpy(), cosines.numpy(), sines.numpy(),
                               self._buffers, scale)
            return
        p, q = cosines.numel(), sines.numel()
        radius, theta, cosine = self._buffers.np_work[torch.float64][:, :p]
        words = _top53_np(radius_words.numpy(), complement=True)  # m = 2^53 (1 - u1)
        np.copyto(radius, words, casting="unsafe")  # exact: at most 2^53
        np.multiply(radius, 2.0**-53, out=radius)  # 1 - u1, exact
        np.log(radius, out=radius)
        np.multiply(radius, -2.0 * scale * scale, out=radius)  # r^2 scale^2
        np.sqrt(radius, out=radius)
        np.copyto(theta, _top53_np(angle_words.numpy()), casting="unsafe")  # u2 2^53
        np.multiply(theta, 2.0 * math.pi * 2.0**-53, out=theta)  # t = 2 pi u2, rounded once
        np.cos(theta, out=cosine)
        np.sin(theta, out=theta)
        np.multiply(radius, cosine, out=cosines.numpy())
        np.multiply(radius[:q], theta[:q], out=sines.numpy())

    def _box_muller_torch(
        self, radius_words: Tensor, angle_words: Tensor, cosines: Tensor, sines: Tensor, scale: float
    ) -> None:
        """:meth:`_box_muller_host` in torch on the buffers' device (the keystream words are on the host)."""
        p, q = cosines.numel(), sines.numel()
        narrow = angle_words.dtype == torch.int32
        work64, work = self._buffers.work[torch.float64], self._buffers.work[cosines.dtype]
        _top53_(radius_words, complement=True)  # m = 2^53 (1 - u1)
        square = work64[0, :p].copy_(radius_words)  # exact
        square.mul_(2.0**-53).log_().mul_(-2.0 * scale * scale)
        radius, theta, cosine = work[0, :p], work[1, :p], work[2, :p]
        radius.copy_(square).sqrt_()
        if narrow:
            theta.copy_(angle_words).mul_(_ANGLE_SCALE32)
        else:
            theta.copy_(_top53_(angle_words)).mul_(2.0 * math.pi * 2.0**-53)
        torch.cos(theta, out=cosine)
        theta.sin_()
        torch.mul(radius, cosine, out=cosines)
        torch.mul(radius[:q], theta[:q], out=sines)
