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
  (:func:`~.keystream._narrow_box_muller` derives it; :class:`~.keystream.KeyStream` documents both formats);
* Laplace(b) as ``b (E1 - E2)`` with ``E = -log(1 - u) ~ Exp(1)``; Bernoulli(q) as ``u < q`` (Poisson sampling).

``secure_mode=True`` adds Opacus's mitigation of floating-point attacks on the Gaussian sampler (Holohan and Braghin
2021, Sec. 5.1): each coordinate is the sum of four float64 draws divided by 2, at four times the cost. The keystream
is produced on the host in chunks (:mod:`.keystream`), or on a CUDA device by a Triton kernel
(:mod:`.device_keystream`, the same words), and transformed by NumPy on the host or by torch on another device, into
reused buffers. A float32 draw on the host shares its chunks among torch's intra-op threads (up to 16): each chunk
reads its own keystream offsets, so the values do not depend on the threads, and each thread takes the next chunk when
it is done with its last (no barrier: a thread that another process keeps busy holds up only the chunk it took, and the
draw's end). ``normal(..., reuse_output=True)`` and
:meth:`NoiseGenerator.add_normal_` avoid a fresh output (``benchmarks/private_step.py`` times it).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from lightning_privdec import native
from lightning_privdec.privacy import keystream
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.keystream import KeyStream, KeystreamBuffers
from lightning_privdec.privacy.native_noise import _INT32, _INT64

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
#: torch runs an elementwise op of fewer elements than its grain size (32768) on the calling thread: pieces this
#: small never wait for intra-op threads that another process keeps busy
_SERIAL = 1 << 15
#: the most threads a float32 draw on the host uses (torch's intra-op count, up to this)
_THREADS = 16
#: a float32 draw on the host into pieces of at most this many entries on average is gathered into one vector
#: (:meth:`NoiseGenerator._gathers`): measured on one core, 200 pieces of 64 entries took 0.57 ms gathered and 1.0 ms
#: each drawn into, 40 of 2,000 entries longer gathered (the copies cost more than the pieces' calls)
_GATHER_PIECE = 1 << 10
#: a generator's reused buffers: never pickled nor copied
_SCRATCH = ("_buffers", "_helper_buffers", "_work", "_out", "_gathered")


def keyed_standard_normal(
    key: bytes, numel: int, device: torch.device | str = "cpu", buffers: KeystreamBuffers | None = None
) -> Tensor:
    """N(0, I_numel) in float64: the keystream under ``key`` (nonce 0) through Box-Muller. The same ``key`` gives the
    same values on every device type to float64 rounding (Decor's pairwise streams, :mod:`.pairwise`)."""
    device = torch.device(device)
    buffers = buffers if buffers is not None and buffers.device == device else KeystreamBuffers(device)
    out = torch.empty(numel, dtype=torch.float64, device=device)
    return KeyStream(key, bytes(16), buffers).standard_normal_into(out)


def _added_as_made(
    outs: Sequence[Tensor], sums: Sequence[Tensor], offsets: Sequence[int], scale: float, alpha: float
) -> Callable[[int, np.ndarray, np.ndarray, int], None] | None:
    """:meth:`NoiseGenerator.add_normal_`'s float32 draw made straight into its outputs: for each chunk of keystream
    pairs (:meth:`~.keystream.KeyStream.narrow_host_draw`), the compiled transform with the addition fused
    (:meth:`~.native_noise.NativeTransform.add_at`: ``torch.add(noise, sum, alpha=alpha)``'s bits) on each run of
    pairs whose cosines lie in one output and whose sines in one, without writing the noise and reading it back.
    None (the noise is written, then added) where that transform is not loaded or its fused addition did not give
    torch.add's bits here, where a tensor is not a contiguous float32 host vector of its output's size, or where
    outputs and sums share memory other than an output being its own sum."""
    compiled = keystream.native_transform()
    wide = bool(sums) and all(t.dtype == torch.float64 for t in sums)  # the clipped sums, float64 until the noise
    if not getattr(compiled, "adds_wide" if wide else "adds", False) or not all(
        native.host_float32(o) and native.host_vector(t, "torch.float64" if wide else "torch.float32")
        and o.numel() == t.numel()
        for o, t in zip(outs, sums)
    ):
        return None
    # a float32 output may be its own sum; float64 sums share memory with nothing
    if native.tensors_overlap([*outs, *sums]) if wide else native.tensors_overlap([], in_place=list(zip(outs, sums))):
        return None
    add_at = compiled.add_at
    out_at, sum_at = [o.data_ptr() for o in outs], [t.data_ptr() for t in sums]
    constants, half = keystream._narrow_constants(scale), (offsets[-1] + 1) // 2
    sum_size = 8 if wide else 4

    def place(entry: int) -> tuple[int, int]:  # the output and sum addresses of entry ``entry`` of the draw
        piece = bisect.bisect_right(offsets, entry) - 1
        at = entry - offsets[piece]
        return out_at[piece] + 4 * at, sum_at[piece] + sum_size * at

    def transform(first: int, words: np.ndarray, angles: np.ndarray, q: int) -> None:
        p = len(words)  # cosines: entries [first, first + p); sines: [half + first, half + first + q)
        words_at, angles_at = native.pointers(((words, _INT64, p), (angles, _INT32, p)))
        cuts = {0, p, q}  # and where an output ends within the cosines or the sines
        for start, end in ((first, first + p), (half + first, half + first + q)):
            inner = offsets[bisect.bisect_right(offsets, start) : bisect.bisect_left(offsets, end)]
            cuts.update(o - start for o in inner)
        bounds = sorted(cuts)
        for a, b in zip(bounds, bounds[1:]):
            with_sine = max(0, min(b, q) - a)
            sines, sine_sums = place(half + first + a) if with_sine else (0, 0)
            add_at(words_at + 8 * a, angles_at + 4 * a, b - a, *place(first + a), sines, sine_sums, with_sine,
                   constants, alpha, wide)

    return transform


class NoiseGenerator:
    """One node's secret randomness: the ChaCha20 keystream under a 256-bit key, one nonce per draw.

    Build it with :func:`node_noise_generator`. Args:
        key: 32 bytes; from ``os.urandom`` unless ``seeded``.
        device: where the draws are made (the keystream is computed on a CUDA device, :mod:`.device_keystream`, and
            produced on the host for any other device).
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
        self._helper_buffers: list[KeystreamBuffers] = []  # further threads' (float32 draws on the host)
        self._work: Tensor | None = None
        self._out: Tensor | None = None
        self._gathered: Tensor | None = None

    def _stream(self) -> KeyStream:
        nonce = bytes(4) + self.draws.to_bytes(8, "little") + bytes(4)  # block counter 0, then draw index
        self.draws += 1
        return KeyStream(self._key, nonce, self._buffers)

    def _workspace(self, words: int) -> Tensor:
        """A reused float64 buffer of two chunks of at least ``min(words, chunk)`` entries (secure mode)."""
        return self._kept("_work", 2 * min(max(words, 1), keystream.CHUNK_WORDS), torch.float64)

    def _kept(self, slot: str, numel: int, dtype: torch.dtype) -> Tensor:
        """The first ``numel`` entries of the vector the generator keeps in ``slot`` (``"_out"``: :meth:`normal`'s
        ``reuse_output``; ``"_gathered"``: :meth:`_gathers`; ``"_work"``: :meth:`_workspace`), re-allocated only
        when it is too small."""
        kept = getattr(self, slot)
        if kept is None or kept.dtype != dtype or kept.numel() < numel:
            kept = torch.empty(numel, dtype=dtype, device=self.device)
            setattr(self, slot, kept)
        return kept[:numel]

    def uniform(self, numel: int) -> Tensor:
        """``numel`` i.i.d. uniforms in [0, 1), float64 on the generator's device (one draw)."""
        stream = self._stream()
        out = torch.empty(numel, dtype=torch.float64, device=self.device)
        chunk = self._buffers.chunk_words
        for start in range(0, numel, chunk):
            m = min(chunk, numel - start)
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
        out = self._kept("_out", numel, dtype) if reuse_output else torch.empty(numel, dtype=dtype, device=self.device)
        if self._threaded(dtype):
            self._stream().narrow_host_draw(numel, std, self._thread_buffers_for(numel), out.numpy())
        else:
            for _ in self._normal_segments(numel, std, dtype, out):
                pass
        return out if device is None else out.to(device)

    def add_normal_(self, outs: Sequence[Tensor], std: float, sums: Sequence[Tensor], sums_scale: float) -> None:
        """``out = N(0, std^2 I) + sums_scale * sum`` for each ``(out, sum)`` pair, the noise being ONE draw of
        ``sum(out.numel())`` entries split over the ``outs`` in order: bit for bit what :meth:`normal` (same std and
        dtype) followed by ``torch.add(noise, sum, alpha=sums_scale, out=out)`` per piece gives, without the
        model-sized noise vector (each chunk is added while it is in the cache, by the thread that drew it, in pieces
        that torch runs on that thread; float32 host tensors where the compiled transform runs: by that transform, as
        it makes the chunk, :func:`_added_as_made`; many small float32 pieces on the host through one gathered
        vector, :meth:`_gathers`). ``outs`` are contiguous tensors of one dtype; an ``out`` may be its ``sum``."""
        if len(outs) != len(sums):
            raise ValueError(f"add_normal_: {len(outs)} outputs and {len(sums)} sums (one sum per output)")
        flat_outs = [o if o.dim() == 1 else o.view(-1) for o in outs]
        flat_sums = [t if t.dim() == 1 else t.reshape(-1) for t in sums]
        offsets = list(itertools.accumulate((o.numel() for o in flat_outs), initial=0))
        if self._gathers(flat_outs, flat_sums, offsets[-1]):
            # many small pieces: one piece of one kept vector (the sums side by side), then copied out, two
            # operations instead of each piece's own call; every entry gets the noise and sum it gets in its piece
            gathered = self._kept("_gathered", offsets[-1], torch.float32)
            torch.cat(flat_sums, out=gathered)
            self.add_normal_([gathered], std, [gathered], sums_scale)
            torch._foreach_copy_(flat_outs, list(gathered.split([o.numel() for o in flat_outs])))
            return
        # pieces small enough for the calling thread only where intra-op threads run them (the host, several threads):
        # on an accelerator a piece is a kernel launch, and each parameter's part of a chunk is one piece
        on_host_threads = outs[0].device.type == "cpu" and torch.get_num_threads() > 1
        serial = _SERIAL if on_host_threads else offsets[-1]

        def add(start: int, values: Tensor) -> None:  # entries [start, ..) of the draw, into their pieces
            end, position = start + values.numel(), start
            piece = bisect.bisect_right(offsets, start) - 1
            while position < end:
                while offsets[piece + 1] <= position:
                    piece += 1
                stop = min(end, offsets[piece + 1], position + serial)
                lo, hi = position - offsets[piece], stop - offsets[piece]
                out, summed = flat_outs[piece], flat_sums[piece]
                if hi - lo < out.numel():  # a part of the piece (a whole one is taken as it is: no slicing op)
                    out, summed = out[lo:hi], summed[lo:hi]
                noise = values if stop - position == values.numel() else values[position - start : stop - start]
                if noise.device != out.device:
                    noise = noise.to(out.device)
                torch.add(noise, summed, alpha=sums_scale, out=out)
                position = stop

        total, dtype = offsets[-1], outs[0].dtype
        if self._threaded(dtype):
            half = (total + 1) // 2
            made_into_outs = _added_as_made(flat_outs, flat_sums, offsets, std, sums_scale)
            written_then_added = None if made_into_outs is not None else (
                lambda first, cosines, sines: (add(first, torch.from_numpy(cosines)),
                                               add(half + first, torch.from_numpy(sines))))
            self._stream().narrow_host_draw(total, std, self._thread_buffers_for(total), None, written_then_added,
                                            transform=made_into_outs)
            if made_into_outs is not None:  # written through addresses: what reads the versions sees the writes
                increment_version(flat_outs)
        else:
            for start, values in self._normal_segments(total, std, dtype):
                add(start, values)

    def _gathers(self, outs: Sequence[Tensor], sums: Sequence[Tensor], total: int) -> bool:
        """Whether :meth:`add_normal_` draws into ``outs`` through one gathered vector: float32 host draws of four
        pieces or more, averaging at most :data:`_GATHER_PIECE` entries, whose sums are float32 host tensors too (a
        piece's own call costs more than copying it twice there; the gathering's own operations, ~25 us, more than
        three pieces' calls). The vector is kept: a small model's gradients, allocated once."""
        return (len(outs) >= 4 and total <= _GATHER_PIECE * len(outs) and self._threaded(outs[0].dtype)
                and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (*outs, *sums))
                and all(o.numel() == t.numel() for o, t in zip(outs, sums)))

    def _threaded(self, dtype: torch.dtype) -> bool:
        """Whether a draw of ``dtype`` is a float32 draw on the host, whose chunks the intra-op threads share."""
        return self._buffers.host_transform and dtype == torch.float32 and not self.secure_mode

    def _thread_buffers_for(self, numel: int) -> list[KeystreamBuffers]:
        """This generator's buffers, and one more set per further intra-op thread (at most :data:`_THREADS` in
        all) that a float32 draw of ``numel`` gives a chunk to (kept across draws: ~5 MB each)."""
        threads = min(torch.get_num_threads(), _THREADS, -(-((numel + 1) // 2) // keystream.CHUNK_WORDS))
        while len(self._helper_buffers) < threads - 1:
            self._helper_buffers.append(KeystreamBuffers(self.device, narrow_only=True))
        return [self._buffers, *self._helper_buffers[: max(0, threads - 1)]]

    def _normal_segments(
        self, numel: int, std: float, dtype: torch.dtype, out: Tensor | None = None
    ) -> Iterator[tuple[int, Tensor]]:
        """One Gaussian draw of ``numel`` entries as ``(start, values)`` segments (:meth:`KeyStream.
        normal_segments`): written into ``out`` (the whole vector) when given, else views of reused buffers."""
        stream = self._stream()
        if not self.secure_mode:
            yield from stream.normal_segments(numel, std, dtype, out)
            return
        work = self._workspace(numel)
        chunk = min(numel, keystream.CHUNK_WORDS)
        total, extra = work[:chunk], work[chunk : 2 * chunk]
        for start in range(0, numel, keystream.CHUNK_WORDS):
            m = min(keystream.CHUNK_WORDS, numel - start)
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
        for start in range(0, numel, keystream.CHUNK_WORDS // 2):  # fixed: a chunk pairs its first and second halves
            m = min(keystream.CHUNK_WORDS // 2, numel - start)
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
        self._buffers, self._helper_buffers = KeystreamBuffers(self.device), []
        self._work = self._out = self._gathered = None


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
