"""Every random draw that privacy rests on: Gaussian and Laplace noise, Poisson sampling, Decor's streams.

The accountants assume that nobody but the node knows its noise and which examples it sampled, which torch's
generators cannot promise (mt19937 keeps 32 bits of its seed, Philox 64). Every stream here is the **ChaCha20
keystream** (RFC 8439, through ``cryptography``, i.e. OpenSSL) under a **256-bit key**:

``seed=None`` (training): the key is ``os.urandom(32)``, per node and per run, never written anywhere;
``seed=int``: SHA-256(tag, seed, rank, stream), reproducible, for tests only, NOT private. Draw k uses nonce k, a
function of (key, k) alone (a fixed-seed generator's state is the number of draws); its 64-bit keystream words
become 53-bit uniforms ``u = (w >> 11) 2^-53`` in [0, 1), then

* standard normals by Box-Muller: ``sqrt(-2 log(1 - u1)) (cos t, sin t)``, ``t = 2 pi u2``. The radius, which sets
  the tails (up to sqrt(2 ln 2^53) ~ 8.6 sigma) and the density near 0, always comes from a 53-bit u1
  (``1 - u1 = m 2^-53`` with m an exact integer). float64 draws are computed in float64 and rounded once. float32
  and narrower ones take their angle from a separate keystream under the same key (nonce k, last word 1), 32 bits
  per pair: 12 keystream bytes per pair instead of 16; the square root, the angle and its cosine and sine are
  float32, and on the host so is the logarithm of ``fl32(m) 2^-53`` (float32 holds 2^-53, so the tail keeps its
  reach; the logarithm is float64 where r is near 0, u1 <= 2^-12). Each entry is within ``r 2^-21`` (the angle's
  rounding) plus two float32 ulps plus ``std^2 2^-24 / r`` of the float64 Box-Muller value of its uniforms
  (:func:`_narrow_box_muller` derives it; :class:`_KeyStream` documents both formats);
* Laplace(b) as ``b (E1 - E2)`` with ``E = -log(1 - u) ~ Exp(1)``; Bernoulli(q) as ``u < q`` (Poisson sampling).

``secure_mode=True`` adds Opacus's mitigation of floating-point attacks on the Gaussian sampler (Holohan and Braghin
2021, Sec. 5.1): each coordinate is the sum of four float64 draws divided by 2, at four times the cost. The keystream
is produced on the host in chunks of ``_CHUNK_WORDS`` words and transformed by NumPy on one thread (more intra-op
threads never slow it down) or by torch on another device, into reused buffers; ``normal(..., reuse_output=True)``
and :meth:`NoiseGenerator.add_normal_` avoid a fresh output (``benchmarks/private_step.py`` times it).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from torch import Tensor

from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = [
    "FIXED_SEED_CAVEAT", "KEY_BYTES", "KeystreamBuffers", "NoiseGenerator", "keyed_standard_normal",
    "node_noise_generator", "seed_caveat",
]

#: ends every line that states the privacy (an epsilon, a budget) of a run whose noise comes from a fixed seed
FIXED_SEED_CAVEAT = " [NOT private: fixed noise_seed, whoever knows the seed knows the noise; noise_seed=None to train]"


def seed_caveat(seed: int | None) -> str:
    """:data:`FIXED_SEED_CAVEAT` for noise from a fixed ``seed``, ``""`` for noise keyed from OS entropy."""
    return "" if seed is None else FIXED_SEED_CAVEAT

KEY_BYTES = 32  #: 256-bit keys
_SEED_DOMAIN = b"lightning_privdec.privacy.noise"
#: 64-bit keystream words per chunk (a wide draw's entries, a narrow draw's pairs): a draw is read and transformed
#: chunk by chunk in reused buffers (~3 MB for a narrow chunk: NumPy's calls cost a microsecond or more each, so
#: chunks somewhat larger than the core's L2 are fastest); its values never depend on it
_CHUNK_WORDS = 1 << 17
_MASK_53 = (1 << 53) - 1
_ANGLE_SCALE32 = 2.0 * math.pi * 2.0**-32  # a narrow draw's angle per unit of its signed 32-bit integer
#: a narrow draw whose fl32(1 - u1) is at least this (every u1 <= 2^-12) has its logarithm taken in float64
#: (:func:`_narrow_box_muller`)
_NEAR_ONE32 = np.float32(1.0 - 2.0**-12)
#: torch runs an elementwise op of fewer elements than its grain size (32768) on the calling thread: pieces this
#: small never wait for intra-op threads that another process keeps busy
_SERIAL = 1 << 15
_SCRATCH = ("_buffers", "_work", "_out")  # a generator's reused buffers: never pickled nor copied


def _angle_nonce(nonce: bytes) -> bytes:
    """The nonce of a narrow draw's angle keystream: the draw's own nonce with its last 32-bit word XOR 1 (0 in
    every nonce this module draws with), i.e. a second keystream under the same key that no draw reads otherwise."""
    return nonce[:12] + (int.from_bytes(nonce[12:], "little") ^ 1).to_bytes(4, "little")


class KeystreamBuffers:
    """Host and device buffers for reading keystreams and transforming them chunk by chunk, kept across draws (fresh
    large allocations are slow). They grow to the largest chunk asked for, at most ``_CHUNK_WORDS`` 64-bit words
    (a wide chunk's entries, a narrow chunk's pairs)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.size = 0

    def reserve(self, words: int) -> None:
        words = min(max(words, 1), _CHUNK_WORDS)
        if words > self.size:
            self.zeros = bytes(8 * words)
            self.raw = bytearray(8 * words)  # the draw's keystream, 64-bit words
            self.words = torch.frombuffer(self.raw, dtype=torch.int64)
            self.angle_raw = bytearray(4 * words)  # a narrow draw's angle keystream, 32-bit words
            self.angle_words = torch.frombuffer(self.angle_raw, dtype=torch.int32)
            self.uniform = torch.empty(words, dtype=torch.float64, device=self.device)
            # the transform's per-pair work (squared radius or r, angle, cosine; a narrow chunk has one pair per
            # word, a wide one per two) and a chunk of output (two entries per narrow pair), per width
            widths = (torch.float64, torch.float32)
            self.work = {dt: torch.empty(3, words, dtype=dt, device=self.device) for dt in widths}
            self.out = {dt: torch.empty(2 * words, dtype=dt, device=self.device) for dt in widths}
            if self.device.type == "cpu":  # the same memory as NumPy arrays, for the host transform
                self.np_work = {dt: w.numpy() for dt, w in self.work.items()}
                self.np_words, self.np_angles = self.words.numpy(), self.angle_words.numpy()
                self.np_mask = np.empty(words, dtype=bool)
            self.size = words


def _narrow_box_muller(
    words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray, buffers: KeystreamBuffers,
    scale: float,
) -> None:
    """The narrow format on the host (:class:`_KeyStream`): ``cosines = scale r cos t``, ``sines = scale r sin t``
    (the first ``len(sines)`` pairs) in float32 from the pairs' int64 radius words and int32 angle words, in place in
    the words and the buffers' work arrays, one NumPy pass each.

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
    np.right_shift(words.view(np.uint64), 11, out=words.view(np.uint64))  # k: u1 = k 2^-53
    np.subtract(1 << 53, words, out=words)  # m = 2^53 (1 - u1), an integer in [1, 2^53]
    np.copyto(radius, words, casting="unsafe")  # fl32(m): relative error <= 2^-24
    np.multiply(radius, np.float32(2.0**-53), out=radius)  # v, exact (a power of two; float32 reaches 2^-126)
    near = np.flatnonzero(np.greater_equal(radius, _NEAR_ONE32, out=buffers.np_mask[:p]))
    np.log(radius, out=radius)
    if near.size:
        radius[near] = np.log(words[near] * 2.0**-53)  # float64 from the exact m, rounded once
    np.multiply(radius, np.float32(-2.0 * scale * scale), out=radius)  # r^2 scale^2
    np.sqrt(radius, out=radius)
    np.copyto(theta, angles, casting="unsafe")  # fl32(a): a relative 2^-24
    np.multiply(theta, np.float32(_ANGLE_SCALE32), out=theta)  # t = 2 pi a 2^-32, rounded twice in all
    np.cos(theta, out=cosine)
    np.sin(theta, out=theta)
    np.multiply(radius, cosine, out=cosines)
    np.multiply(radius[:q], theta[:q], out=sines)


class _KeyStream:
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

    A draw depends on the key, the nonce and its length only, never on the chunk size. On the host the transform
    runs in NumPy (its SIMD logarithm, sine and cosine are 2-3x torch's on one core, and it never spreads a chunk
    over threads that may be busy); on other devices in torch.
    """

    def __init__(self, key: bytes, nonce: bytes, buffers: KeystreamBuffers) -> None:
        self._encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
        self._key, self._nonce = key, nonce
        self._angles: Any = None  # the angle keystream's encryptor, made at the first narrow chunk
        self._buffers = buffers
        self._box_muller = self._box_muller_host if buffers.device.type == "cpu" else self._box_muller_torch

    def _fill_words(self, n: int) -> None:
        """The next ``n <= _CHUNK_WORDS`` 64-bit words of the keystream and 32-bit words of the angle keystream into
        the buffers' ``raw`` and ``angle_raw`` (a narrow chunk's pairs)."""
        self._read(n)
        self._read_angles(n)

    def _read(self, n: int) -> Tensor:
        """The next ``n <= _CHUNK_WORDS`` 64-bit words of the keystream (int64 on the host, a reused buffer)."""
        b = self._buffers
        b.reserve(n)
        self._encryptor.update_into(memoryview(b.zeros)[: 8 * n], b.raw)
        return b.words[:n]

    def _read_angles(self, n: int) -> Tensor:
        """The next ``n <= _CHUNK_WORDS`` 32-bit words of the angle keystream (int32 on the host, a reused buffer)."""
        if self._angles is None:
            self._angles = Cipher(algorithms.ChaCha20(self._key, _angle_nonce(self._nonce)), mode=None).encryptor()
        b = self._buffers
        b.reserve(n)
        self._angles.update_into(memoryview(b.zeros)[: 4 * n], b.angle_raw)
        return b.angle_words[:n]

    def uniform(self, n: int) -> Tensor:
        """The next ``n <= _CHUNK_WORDS`` uniforms in [0, 1): float64 on the buffers' device, a view of a reused
        buffer (valid until the next read)."""
        words = self._read(n)
        words.bitwise_right_shift_(11).bitwise_and_(_MASK_53)  # arithmetic shift: mask off the sign's copies
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
            for start in range(0, numel, _CHUNK_WORDS):
                m = min(_CHUNK_WORDS, numel - start)
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
        host = self._buffers.device.type == "cpu"
        target = out.numpy() if direct and host else None  # the host loop writes through NumPy views
        for first in range(0, half, _CHUNK_WORDS):
            p = min(_CHUNK_WORDS, half - first)  # pairs in this chunk
            q = max(0, min(p, numel - half - first))  # this chunk's sines
            if direct:
                cosines, sines = out[first : first + p], out[half + first : half + first + q]
            else:
                b.reserve(p)
                cosines, sines = b.out[torch.float32][:p], b.out[torch.float32][p : p + q]
            if host:
                self._fill_words(p)
                destinations = (
                    (target[first : first + p], target[half + first : half + first + q]) if target is not None
                    else (cosines.numpy(), sines.numpy())
                )
                _narrow_box_muller(b.np_words[:p], b.np_angles[:p], *destinations, b, scale)
            else:
                self._box_muller(self._read(p), self._read_angles(p), cosines, sines, scale)
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
        words = radius_words.numpy()
        np.right_shift(words.view(np.uint64), 11, out=words.view(np.uint64))  # k: u1 = k 2^-53
        np.subtract(1 << 53, words, out=words)  # m = 2^53 (1 - u1), an integer in [1, 2^53]
        np.copyto(radius, words, casting="unsafe")  # exact: at most 2^53
        np.multiply(radius, 2.0**-53, out=radius)  # 1 - u1, exact
        np.log(radius, out=radius)
        np.multiply(radius, -2.0 * scale * scale, out=radius)  # r^2 scale^2
        np.sqrt(radius, out=radius)
        angles = angle_words.numpy().view(np.uint64)
        np.right_shift(angles, 11, out=angles)
        np.copyto(theta, angles, casting="unsafe")
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
        radius_words.bitwise_right_shift_(11).bitwise_and_(_MASK_53).neg_().add_(1 << 53)  # 2^53 (1 - u1)
        square = work64[0, :p].copy_(radius_words)  # exact
        square.mul_(2.0**-53).log_().mul_(-2.0 * scale * scale)
        radius, theta, cosine = work[0, :p], work[1, :p], work[2, :p]
        radius.copy_(square).sqrt_()
        if narrow:
            theta.copy_(angle_words).mul_(_ANGLE_SCALE32)
        else:
            theta.copy_(angle_words.bitwise_right_shift_(11).bitwise_and_(_MASK_53)).mul_(2.0 * math.pi * 2.0**-53)
        torch.cos(theta, out=cosine)
        theta.sin_()
        torch.mul(radius, cosine, out=cosines)
        torch.mul(radius[:q], theta[:q], out=sines)


def keyed_standard_normal(
    key: bytes, numel: int, device: torch.device | str = "cpu", buffers: KeystreamBuffers | None = None
) -> Tensor:
    """N(0, I_numel) in float64: the keystream under ``key`` (nonce 0) through Box-Muller. The same ``key`` gives the
    same values on every device type to float64 rounding (Decor's pairwise streams, :mod:`.pairwise`)."""
    device = torch.device(device)
    buffers = buffers if buffers is not None and buffers.device == device else KeystreamBuffers(device)
    out = torch.empty(numel, dtype=torch.float64, device=device)
    return _KeyStream(key, bytes(16), buffers).standard_normal_into(out)


class NoiseGenerator:
    """One node's secret randomness: the ChaCha20 keystream under a 256-bit key, one nonce per draw.

    Build it with :func:`node_noise_generator`. Args:
        key: 32 bytes; from ``os.urandom`` unless ``seeded``.
        device: where the draws are returned (the keystream is produced on the host).
        seeded: the key derives from a public seed (reproducible, not private); only then may the state be saved.
        secure_mode: Gaussian draws with the floating-point mitigation of Opacus's secure mode (4x the cost).
    """

    def __init__(
        self, key: bytes, *, device: torch.device | str = "cpu", seeded: bool = False, secure_mode: bool = False
    ) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise PrivacyConfigError(f"a noise key must be {KEY_BYTES} bytes")
        self._key = key
        self.device = torch.device(device)
        self.seeded = seeded
        self.secure_mode = bool(secure_mode)
        self.draws = 0
        self._buffers = KeystreamBuffers(self.device)
        self._work: Tensor | None = None
        self._out: Tensor | None = None

    def _stream(self) -> _KeyStream:
        nonce = bytes(4) + self.draws.to_bytes(8, "little") + bytes(4)  # block counter 0, then draw index
        self.draws += 1
        return _KeyStream(self._key, nonce, self._buffers)

    def _workspace(self, words: int) -> Tensor:
        """A reused float64 buffer of two chunks of at least ``min(words, chunk)`` entries (secure mode)."""
        words = 2 * min(max(words, 1), _CHUNK_WORDS)
        if self._work is None or self._work.numel() < words:
            self._work = torch.empty(words, dtype=torch.float64, device=self.device)
        return self._work

    def _output(self, numel: int, dtype: torch.dtype) -> Tensor:
        """The kept output vector of :meth:`normal` (``reuse_output``), re-allocated only when it is too small."""
        if self._out is None or self._out.dtype != dtype or self._out.numel() < numel:
            self._out = torch.empty(numel, dtype=dtype, device=self.device)
        return self._out[:numel]

    def uniform(self, numel: int) -> Tensor:
        """``numel`` i.i.d. uniforms in [0, 1), float64 on the generator's device (one draw)."""
        stream = self._stream()
        out = torch.empty(numel, dtype=torch.float64, device=self.device)
        for start in range(0, numel, _CHUNK_WORDS):
            m = min(_CHUNK_WORDS, numel - start)
            out[start : start + m].copy_(stream.uniform(m))
        return out

    def bernoulli(self, numel: int, p: float) -> Tensor:
        """``numel`` i.i.d. Bernoulli(p) as a bool tensor (Poisson sampling's inclusion mask)."""
        return self.uniform(numel) < p

    def normal(
        self,
        numel: int,
        std: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        reuse_output: bool = False,
    ) -> Tensor:
        """``numel`` i.i.d. N(0, std^2) entries of ``dtype`` (Box-Muller as in the module docstring), on the
        generator's device and then moved to ``device`` if given. With ``secure_mode`` each entry is
        (z1 + z2 + z3 + z4) / 2 of four draws. ``reuse_output=True`` writes into a vector the generator keeps (valid
        until its next ``reuse_output`` draw): a DP step's noise is not re-allocated every step."""
        out = self._output(numel, dtype) if reuse_output else torch.empty(numel, dtype=dtype, device=self.device)
        for _ in self._normal_segments(numel, std, dtype, out):
            pass
        return out if device is None else out.to(device)

    def add_normal_(self, outs: Sequence[Tensor], std: float, sums: Sequence[Tensor], sums_scale: float) -> None:
        """``out = N(0, std^2 I) + sums_scale * sum`` for each ``(out, sum)`` pair, the noise being ONE draw of
        ``sum(out.numel())`` entries split over the ``outs`` in order: bit for bit what :meth:`normal` (same std and
        dtype) followed by ``torch.add(noise, sum, alpha=sums_scale, out=out)`` per piece gives, without the
        model-sized noise vector (each chunk is added while it is in the cache, in pieces that torch runs on this
        thread). ``outs`` are contiguous tensors of one dtype; an ``out`` may be its ``sum``."""
        flat_outs = [o.view(-1) for o in outs]
        flat_sums = [t.reshape(-1) for t in sums]
        offsets = list(itertools.accumulate((o.numel() for o in flat_outs), initial=0))
        serial = _SERIAL if torch.get_num_threads() > 1 else offsets[-1]  # one thread: no piece need be small
        for start, values in self._normal_segments(offsets[-1], std, outs[0].dtype):
            end, position = start + values.numel(), start
            piece = bisect.bisect_right(offsets, start) - 1
            while position < end:
                while offsets[piece + 1] <= position:
                    piece += 1
                stop = min(end, offsets[piece + 1], position + serial)
                lo, hi = position - offsets[piece], stop - offsets[piece]
                noise = values[position - start : stop - start].to(flat_outs[piece].device)
                torch.add(noise, flat_sums[piece][lo:hi], alpha=sums_scale, out=flat_outs[piece][lo:hi])
                position = stop

    def _normal_segments(
        self, numel: int, std: float, dtype: torch.dtype, out: Tensor | None = None
    ) -> Iterator[tuple[int, Tensor]]:
        """One Gaussian draw of ``numel`` entries as ``(start, values)`` segments (:meth:`_KeyStream.
        normal_segments`): written into ``out`` (the whole vector) when given, else views of reused buffers."""
        stream = self._stream()
        if not self.secure_mode:
            yield from stream.normal_segments(numel, std, dtype, out)
            return
        work = self._workspace(numel)
        chunk = min(numel, _CHUNK_WORDS)
        total, extra = work[:chunk], work[chunk : 2 * chunk]
        for start in range(0, numel, _CHUNK_WORDS):
            m = min(_CHUNK_WORDS, numel - start)
            z = stream.standard_normal_into(total[:m])  # four wide draws of m, summed in float64
            for _ in range(3):
                z.add_(stream.standard_normal_into(extra[:m]))
            z.mul_(0.5 * std)
            yield start, (z.to(dtype) if out is None else out[start : start + m].copy_(z))

    def laplace(
        self, numel: int, scale: float, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
    ) -> Tensor:
        """``numel`` i.i.d. Laplace(0, scale) entries: scale (E1 - E2), E = -log(1 - u) ~ Exp(1), in float64."""
        stream = self._stream()
        out = torch.empty(numel, dtype=dtype, device=self.device)
        for start in range(0, numel, _CHUNK_WORDS // 2):
            m = min(_CHUNK_WORDS // 2, numel - start)
            u = stream.uniform(2 * m).view(2, m)
            e = torch.log1p(-u).neg_()
            out[start : start + m].copy_((e[0] - e[1]).mul_(scale))
        return out if device is None else out.to(device)

    # ---- state: fixed-seed generators only ---------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The number of draws so far (with the seed, it fixes every later draw). Refused for OS-entropy keys."""
        if not self.seeded:
            raise PrivacyConfigError("a secure noise generator's state is never saved: its key must stay secret")
        return {"draws": self.draws}

    def set_state(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])

    def __repr__(self) -> str:
        kind = "fixed seed, NOT private" if self.seeded else "256-bit OS entropy"
        return f"NoiseGenerator(ChaCha20, {kind}, device={self.device}, secure_mode={self.secure_mode})"

    def __getstate__(self) -> dict[str, Any]:
        if not self.seeded:
            raise TypeError("a secure NoiseGenerator holds a secret key and cannot be pickled")
        return {k: v for k, v in self.__dict__.items() if k not in _SCRATCH}  # views: rebuilt, not copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._buffers, self._work, self._out = KeystreamBuffers(self.device), None, None


def node_noise_generator(
    device: torch.device | str, seed: int | None, rank: int, stream: str = "noise", *, secure_mode: bool = False
) -> NoiseGenerator:
    """The generator of ONE node (process ``rank``) for one purpose (``stream``: "noise", "sampling", ...).

    * ``seed=None`` (training): a fresh 256-bit key from ``os.urandom``, per node and per run. Lightning's
      ``seed_everything`` gives every rank the same global seed; noise from the global RNG would be the same on
      every node and a neighbour could subtract it. Fresh OS entropy rules that out, and 256 bits rule out a search.
    * ``seed=int``: the key is SHA-256 of (tag, stream, seed, rank): reproducible and NOT private (tests only).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise PrivacyConfigError(f"rank must be a non-negative integer, got {rank!r}")
    if seed is None:
        return NoiseGenerator(os.urandom(KEY_BYTES), device=device, secure_mode=secure_mode)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PrivacyConfigError(f"seed must be an int or None, got {seed!r}")
    key = hashlib.sha256(_SEED_DOMAIN + f"/{stream}/{seed}/{rank}".encode()).digest()
    return NoiseGenerator(key, device=device, seeded=True, secure_mode=secure_mode)
