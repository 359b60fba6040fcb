"""Every random draw that privacy rests on: Gaussian and Laplace noise, Poisson sampling, Decor's streams.

The accountants assume that nobody but the node knows its noise and which examples it sampled. torch's generators
cannot promise that: the CPU generator (mt19937) keeps only the low 32 bits of its seed, so a stream seeded with 63
bits of OS entropy is one of 2^32 and can be found by trying seeds against one released update; CUDA's Philox takes a
64-bit seed. Here every stream is the **ChaCha20 keystream** (RFC 8439, through the ``cryptography`` package, i.e.
OpenSSL) under a **256-bit key**:

* ``seed=None`` (training): the key is ``os.urandom(32)``, drawn per node and per run, never written anywhere.
* ``seed=int``: the key is SHA-256(tag, seed, rank, stream). Reproducible for tests and debugging, and therefore
  NOT private: whoever knows the seed knows the noise.

Draw k of a generator uses nonce k, so each draw is a function of (key, k) alone; a fixed-seed generator's state is
the number of draws (``get_state``). The keystream's 64-bit words become 53-bit uniforms ``u = (w >> 11) 2^-53`` in
[0, 1), then

* standard normals by Box-Muller: ``sqrt(-2 log(1 - u1)) (cos 2 pi u2, sin 2 pi u2)``. The radius, which sets the
  tails (up to sqrt(2 ln 2^53) ~ 8.6 sigma) and the density near 0, is always computed in float64 up to its
  square ``-2 log(1 - u1)``. float64 draws are computed in float64 and rounded once; for float32 and narrower ones
  the square root, the angle and its cosine and sine are computed in float32 (a third of the time for that part):
  each entry is then within ``r 2^-21`` (the angle's rounding) plus two float32 ulps of the float64 draw;
* Laplace(b) as ``b (E1 - E2)`` with ``E = -log(1 - u) ~ Exp(1)``;
* Bernoulli(q) as ``u < q`` (Poisson sampling).

``secure_mode=True`` adds Opacus's mitigation of floating-point attacks on the Gaussian sampler (Holohan and Braghin
2021, "Secure Random Sampling in Differential Privacy", Sec. 5.1, as in Opacus's ``_generate_noise``): each noise
coordinate is the sum of four draws divided by 2, at four times the sampling cost. The keystream is produced on the
host in chunks of 1 MiB (its buffers stay in the core's cache) and transformed there by NumPy (SIMD logarithm, sine
and cosine, one thread: more intra-op threads never slow it down) or, for another device, by torch on that device;
buffers are reused across chunks and draws, and a caller that draws the same size every step can reuse the output
too (``normal(..., reuse_output=True)``; a fresh 45 MB vector costs ~15 ms of page faults per step), or add the noise
straight into its gradients (:meth:`NoiseGenerator.add_normal_`). ``benchmarks/private_step.py`` times it in ns per
coordinate against ``torch.randn`` with 1 and 2 threads.
"""

from __future__ import annotations

import hashlib
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
_CHUNK_WORDS = 1 << 17  # 64-bit words per keystream chunk (1 MiB): the chunk's buffers stay in the core's cache
_MASK_53 = (1 << 53) - 1
#: torch runs an elementwise op of fewer elements than its grain size (32768) on the calling thread: pieces this
#: small never wait for intra-op threads that another process keeps busy
_SERIAL = 1 << 15
_SCRATCH = ("_buffers", "_work", "_out")  # a generator's reused buffers: never pickled nor copied


class KeystreamBuffers:
    """Host and device buffers for reading a keystream in chunks, kept across draws (fresh large allocations are
    slow). They grow to the largest chunk asked for, at most ``_CHUNK_WORDS`` 64-bit words."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.size = 0

    def reserve(self, words: int) -> None:
        words = min(max(words, 1), _CHUNK_WORDS)
        if words > self.size:
            self.zeros = bytes(8 * words)
            self.raw = bytearray(8 * words)
            self.words = torch.frombuffer(self.raw, dtype=torch.int64)
            self.uniform = torch.empty(words, dtype=torch.float64, device=self.device)
            self.pair_work = torch.empty(3, (words + 1) // 2, dtype=torch.float64, device=self.device)
            self.pair_work32 = torch.empty(3, (words + 1) // 2, dtype=torch.float32, device=self.device)
            if self.device.type == "cpu":  # half-precision draws are made in float32, then rounded
                self.out32 = torch.empty(words, dtype=torch.float32)
            self.size = words


class _KeyStream:
    """The ChaCha20 keystream under (key, nonce), read as 53-bit uniforms and normals in float64."""

    def __init__(self, key: bytes, nonce: bytes, buffers: KeystreamBuffers) -> None:
        self._encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
        self._buffers = buffers

    def uniform(self, n: int) -> Tensor:
        """The next ``n <= _CHUNK_WORDS`` uniforms in [0, 1): float64 on the buffers' device, a view of a reused
        buffer (valid until the next read)."""
        b = self._buffers
        b.reserve(n)
        self._encryptor.update_into(memoryview(b.zeros)[: 8 * n], b.raw)
        words = b.words[:n]
        words.bitwise_right_shift_(11).bitwise_and_(_MASK_53)  # arithmetic shift: mask off the sign's copies
        out = b.uniform[:n]
        out.copy_(words)  # exact: 53-bit integers fit float64
        return out.mul_(2.0**-53)

    def standard_normal_into(self, out: Tensor, scale: float = 1.0) -> Tensor:
        """Fill the flat floating tensor ``out`` with ``scale`` times standard normals, chunk by chunk: Box-Muller,
        pairs of uniforms give ``r cos t, r sin t``, interleaved. ``r`` in float64; ``cos t, sin t`` and the
        products in float64 for a float64 ``out`` (rounded once), else ``t`` and its cosine and sine in float32 (the
        module docstring). On the host the transform runs in NumPy (its SIMD logarithm, sine and cosine are 2-3x
        torch's on one core, and it never spreads a chunk over threads that may be busy); on other devices in torch.
        """
        numel = out.numel()
        for start in range(0, numel, _CHUNK_WORDS):
            m = min(_CHUNK_WORDS, numel - start)
            if self._buffers.device.type == "cpu":
                self._normal_chunk_host(out[start : start + m], scale)
            else:
                self._normal_chunk_device(out[start : start + m], scale)
        return out

    def _words(self, n: int) -> np.ndarray:
        """The next ``n`` keystream words as 53-bit integers (int64, a view of the reused host buffer)."""
        b = self._buffers
        b.reserve(n)
        self._encryptor.update_into(memoryview(b.zeros)[: 8 * n], b.raw)
        words = b.words.numpy()[:n]
        np.right_shift(words.view(np.uint64), 11, out=words.view(np.uint64))  # the top 53 bits, as uniform()
        return words

    def _normal_chunk_host(self, out: Tensor, scale: float) -> None:
        m = out.numel()
        pairs = (m + 1) // 2
        words = self._words(2 * pairs)
        b = self._buffers
        radius = b.pair_work[0, :pairs].numpy()
        np.multiply(words[0::2], -(2.0**-53), out=radius)  # -u1, exact
        np.log1p(radius, out=radius)  # log(1 - u1), 1 - u1 in (0, 1]: finite, tail up to ~8.6 sigma
        np.multiply(radius, -2.0 * scale * scale, out=radius)  # the squared radius, in float64
        wide = out.dtype == torch.float64
        if wide:
            np.sqrt(radius, out=radius)
        else:  # its square root in float32 (NumPy's float64 one costs 3x): one more float32 rounding
            radius32 = b.pair_work32[0, :pairs].numpy()
            radius32[...] = radius
            radius = np.sqrt(radius32, out=radius32)
        work = b.pair_work if wide else b.pair_work32
        theta, cosine = work[1, :pairs].numpy(), work[2, :pairs].numpy()
        np.multiply(words[1::2], 2.0 * math.pi * 2.0**-53, out=theta, casting="same_kind")  # u2 2 pi, rounded once
        np.cos(theta, out=cosine)
        np.sin(theta, out=theta)
        native = out.dtype in (torch.float32, torch.float64)
        target = out.numpy() if native else b.out32[:m].numpy()
        np.multiply(radius, cosine, out=target[0::2])
        np.multiply(radius[: m // 2], theta[: m // 2], out=target[1::2])  # an odd m drops the last pair's sine
        if not native:
            out.copy_(b.out32[:m])

    def _normal_chunk_device(self, out: Tensor, scale: float) -> None:
        m, wide = out.numel(), out.dtype == torch.float64
        pairs = (m + 1) // 2
        u = self.uniform(2 * pairs).view(pairs, 2)
        radius, theta, cosine = self._buffers.pair_work[:, :pairs]  # reused: no allocation per chunk
        torch.neg(u[:, 0], out=radius)
        radius.log1p_().mul_(-2.0).sqrt_()
        if scale != 1.0:
            radius.mul_(scale)
        if not wide:  # the angle in float32: its cosine and sine cost half as much
            radius32, theta, cosine = self._buffers.pair_work32[:, :pairs]
            radius = radius32.copy_(radius)
        torch.mul(u[:, 1], 2.0 * math.pi, out=theta)
        torch.cos(theta, out=cosine)
        theta.sin_()
        if m % 2 == 0:
            block = out.view(pairs, 2)
            torch.mul(radius, cosine, out=block[:, 0])
            torch.mul(radius, theta, out=block[:, 1])
        else:  # the last odd entry: the pair's sine is dropped
            out.copy_(torch.stack((radius * cosine, radius * theta), dim=1).view(-1)[:m])


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
        """A reused float64 buffer of at least ``min(words, chunk)`` entries (secure mode: two of them)."""
        words = min(max(words, 1), _CHUNK_WORDS) * (2 if self.secure_mode else 1)
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
        for _ in self._normal_chunks(numel, std, out):
            pass
        return out if device is None else out.to(device)

    def add_normal_(self, outs: Sequence[Tensor], std: float, sums: Sequence[Tensor], sums_scale: float) -> None:
        """``out = N(0, std^2 I) + sums_scale * sum`` for each ``(out, sum)`` pair, the noise being ONE draw of
        ``sum(out.numel())`` entries split over the ``outs`` in order: bit for bit what :meth:`normal` (same std and
        dtype) followed by ``torch.add(noise, sum, alpha=sums_scale, out=out)`` per piece gives, without the
        model-sized noise vector (each chunk is added while it is in the cache, in pieces that torch runs on this
        thread). ``outs`` are contiguous tensors of one dtype; an ``out`` may be its ``sum``."""
        total = sum(o.numel() for o in outs)
        flat_outs = [o.view(-1) for o in outs]
        flat_sums = [t.reshape(-1) for t in sums]
        piece, offset = 0, 0  # the piece holding chunk position `start`, and where that piece starts
        for start, chunk in self._normal_chunks(total, std, self._chunk(outs[0].dtype)):
            end, position = start + chunk.numel(), start
            while position < end:
                while offset + flat_outs[piece].numel() <= position:
                    offset += flat_outs[piece].numel()
                    piece += 1
                stop = min(end, offset + flat_outs[piece].numel(), position + _SERIAL)
                target = flat_outs[piece][position - offset : stop - offset]
                noise = chunk[position - start : stop - start].to(target.device)
                torch.add(noise, flat_sums[piece][position - offset : stop - offset], alpha=sums_scale, out=target)
                position = stop

    def _chunk(self, dtype: torch.dtype) -> Tensor:
        """A reused buffer of one chunk of ``dtype`` (for :meth:`add_normal_`)."""
        if self._out is None or self._out.dtype != dtype or self._out.numel() < _CHUNK_WORDS:
            self._out = torch.empty(_CHUNK_WORDS, dtype=dtype, device=self.device)
        return self._out

    def _normal_chunks(self, numel: int, std: float, out: Tensor) -> Iterator[tuple[int, Tensor]]:
        """One Gaussian draw of ``numel`` entries, chunk by chunk: yields ``(start, entries start..)`` written into
        ``out`` (the whole vector, or one chunk's buffer that every chunk reuses)."""
        stream = self._stream()
        whole = out.numel() >= numel
        if self.secure_mode:
            work = self._workspace(numel)
            chunk = min(numel, _CHUNK_WORDS)
            total, extra = work[:chunk], work[chunk : 2 * chunk]
        for start in range(0, numel, _CHUNK_WORDS):
            m = min(_CHUNK_WORDS, numel - start)
            target = out[start : start + m] if whole else out[:m]
            if not self.secure_mode:
                stream.standard_normal_into(target, std)
            else:
                z = stream.standard_normal_into(total[:m])
                for _ in range(3):
                    z.add_(stream.standard_normal_into(extra[:m]))
                target.copy_(z.mul_(0.5 * std))
            yield start, target

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
