"""Compressor interface and the identity compressor.

A compressor ``Q`` maps a flat vector ``x`` in R^d to the tensors that actually
travel on the wire (its *payload*) and back to a dense reconstruction ``Q(x)``.
Decentralized error-feedback schemes (CHOCO-SGD, Koloskova et al. 2019, Eq. (4)
/ Assumption 1; DP-CSGP Assumption 4) only require the compressor to be
*contractive*:

    E_Q ||Q(x) - x||^2 <= omega^2 ||x||^2,   omega^2 < 1,

where CHOCO writes the same condition as ``(1 - delta) ||x||^2`` with
``delta = 1 - omega^2``. :meth:`Compressor.omega2` returns that constant.

Randomness (RandK's shift, QSGD's dithering) comes from the AES-128-CTR
keystream under a ``key`` that sender and receiver agree on for a given
(sender, channel, round) (:func:`public_stream`), so indices never travel. It is
made on the host, so every device type and library version draws the same
values for the same key. It is public: message keys are not secret.

A node that gossips keeps one :class:`Workspace` and passes it to
:meth:`Compressor.encode_feedback_` and :meth:`Compressor.decode_add_`: error
feedback then runs in place, without a vector of the model's size per round.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["Compressor", "Identity", "PayloadSpec", "Workspace", "make_generator", "public_stream", "public_words",
           "seed_of"]

#: Shapes and dtypes of payload tensors, in wire order.
PayloadSpec = list[tuple[tuple[int, ...], torch.dtype]]

_KEY_MASK = (1 << 63) - 1


def seed_of(key: int) -> int:
    """``key`` reduced to the 63-bit seed every generator of a message is seeded with."""
    if isinstance(key, bool) or not isinstance(key, int):
        raise ValueError(f"key must be an int (a 63-bit seed), got {type(key).__name__}")
    return key & _KEY_MASK


def make_generator(key: int, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``key`` (reduced to 63 bits)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_of(key))
    return gen


class Workspace:
    """Named scratch tensors that one caller (one gossiping node) reuses from step to step.

    Compressors shared by several simulated nodes must not keep per-call scratch themselves (the nodes run in
    threads), so the caller owns one workspace and passes it to :meth:`Compressor.encode_difference` and
    :meth:`Compressor.decode_add_`. A fresh model-sized tensor per step costs its page faults every time.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A 1-D tensor of ``numel`` entries, kept under ``name`` (contents undefined; re-allocated when it differs)."""
        t, device = self._tensors.get(name), torch.device(device)
        elsewhere = t is not None and (t.device.type != device.type or device.index not in (None, t.device.index))
        if t is None or t.numel() != numel or t.dtype != dtype or elsewhere:
            t = self._tensors[name] = torch.empty(numel, dtype=dtype, device=device)
        return t

    def at_least(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The first ``numel`` entries of a 1-D buffer kept under ``name`` that only ever grows (a chunk's scratch:
        a shorter last chunk re-allocates nothing)."""
        t, device = self._tensors.get(name), torch.device(device)
        elsewhere = t is not None and (t.device.type != device.type or device.index not in (None, t.device.index))
        if t is None or t.numel() < numel or t.dtype != dtype or elsewhere:
            t = self._tensors[name] = torch.empty(numel, dtype=dtype, device=device)
        return t[:numel]

    def lend(self, name: str, tensor: torch.Tensor | None) -> None:
        """Use the caller's ``tensor`` (free for now) as the buffer ``name``; ``None`` takes the loan back."""
        if tensor is None:
            self._tensors.pop(name, None)
        else:
            self._tensors[name] = tensor

    def zeros(self, nbytes: int) -> bytes:
        """``nbytes`` zero bytes to encrypt into a keystream (calloc'd: costs no memory until written)."""
        z = getattr(self, "_zeros", b"")
        if len(z) < nbytes:
            z = self._zeros = bytes(nbytes)
        return memoryview(z)[:nbytes]

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


_STREAM_DOMAIN = b"lpd/cmp3"  # the AES key's last 8 bytes: this format's tag (a new draw format gets a new tag)
#: the compressors' draw format, compared between nodes at setup: nodes that draw differently (another version of
#: this library) would disagree on every message's positions and dithering
DRAW_FORMAT = _STREAM_DOMAIN.decode()


def public_stream(key: int):  # noqa: ANN201
    """The AES-128-CTR keystream (an encryptor of zeros) under the 128-bit key (63-bit seed, domain tag), counter
    block 0: public randomness that only depends on ``key``, which sender and receiver of a message share (message
    keys are not secret, so no secret key length is needed). OpenSSL's AES-CTR (AES-NI) makes ~0.11 ns per byte,
    ChaCha20 ~0.19, NumPy's SFC64 0.22 (docs/compression.md), and it draws the same on every device type and library
    version."""
    cipher_key = seed_of(key).to_bytes(8, "little") + _STREAM_DOMAIN
    return Cipher(algorithms.AES(cipher_key), modes.CTR(bytes(16))).encryptor()


def public_words(
    key: int, n: int, workspace: Workspace | None = None, stream: object | None = None, name: str = "public_words"
) -> torch.Tensor:
    """The next ``n`` 64-bit words (int64, on the host) of ``stream`` (default: a new :func:`public_stream` of
    ``key``). With ``workspace`` they are written into its buffer ``name`` (valid until that buffer's next use)."""
    encryptor = stream if stream is not None else public_stream(key)
    if workspace is None:
        raw = bytearray(8 * n)
        encryptor.update_into(bytes(8 * n), raw)  # type: ignore[attr-defined]
        return torch.frombuffer(raw, dtype=torch.int64)
    words = workspace.at_least(name, n, torch.int64, "cpu")
    encryptor.update_into(workspace.zeros(8 * n), memoryview(words.numpy()).cast("B"))  # type: ignore[attr-defined]
    return words


def _check_dim(d: int) -> None:
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"vector length d must be a positive int, got {d!r}")


class Compressor(abc.ABC):
    """Base class: a contractive compressor with an explicit wire format.

    Subclasses implement :meth:`omega2`, :meth:`payload_spec`, :meth:`encode` and
    :meth:`decode`; sizes and the convenience :meth:`compress` follow from them.
    """

    #: Short identifier, also the prefix accepted by ``build_compressor``.
    name: str = "compressor"

    @abc.abstractmethod
    def omega2(self, d: int) -> float:
        """Contraction constant omega^2 for a d-vector: E||Q(x)-x||^2 <= omega^2 ||x||^2."""

    @abc.abstractmethod
    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        """Shapes and dtypes of the payload tensors for a d-vector of ``dtype``, in order.

        Receivers allocate their receive buffers from this.
        """

    @abc.abstractmethod
    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        """Compress a 1-D float tensor into payload tensors on ``x.device``.

        ``key`` seeds any randomness; the result matches :meth:`payload_spec` exactly.
        """

    @abc.abstractmethod
    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Dense reconstruction ``Q(x)`` of length ``d`` and ``dtype`` on the payload's device."""

    def encoded_nbytes(self, d: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact number of bytes on the wire for a d-vector of ``dtype``."""
        return sum(
            math.prod(shape) * torch.empty((), dtype=dt).element_size()
            for shape, dt in self.payload_spec(d, dtype)
        )

    def encode_difference(
        self, x: torch.Tensor, reference: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        """``encode(x - reference, key)`` (error feedback's line 1), the difference in ``workspace`` when given.
        Sparsifiers that choose coordinates without looking at the values read only the kept ones."""
        if workspace is None:
            return self.encode(x - reference, key)
        difference = workspace.get("difference", x.numel(), x.dtype, x.device)
        return self.encode(torch.sub(x, reference, out=difference), key)

    def decode_add_(
        self,
        payload: Sequence[torch.Tensor],
        out: torch.Tensor,
        key: int,
        workspace: Workspace | None = None,
    ) -> torch.Tensor:
        """``out += decode(payload, len(out), key, out.dtype)`` in place (error feedback's line 4), with the same
        rounding as that addition; sparsifiers touch only the kept coordinates. Returns ``out``."""
        return out.add_(self.decode(payload, out.numel(), key, dtype=out.dtype))

    def encode_feedback_(
        self, x: torch.Tensor, copy: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        """Error feedback's lines 1 and 4 at the sender: ``q = Q(x - copy)``, then ``copy += q`` in place; returns
        the payload of ``q``. The same values and rounding as :meth:`encode_difference` then :meth:`decode_add_`."""
        payload = self.encode_difference(x, copy, key, workspace)
        self.decode_add_(payload, copy, key, workspace)
        return payload

    def compress(self, x: torch.Tensor, key: int) -> torch.Tensor:
        """``Q(x)``, i.e. ``decode(encode(x, key), len(x), key, x.dtype)``."""
        return self.decode(self.encode(x, key), x.numel(), key, x.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _check_input(x: torch.Tensor) -> torch.Tensor:
        """Validate that ``x`` is a non-empty 1-D float tensor; return it detached and contiguous."""
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_floating_point():
            got = f"dtype={x.dtype}, shape={tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"encode expects a 1-D floating-point tensor, got {got}")
        if x.numel() == 0:
            raise ValueError("encode expects a non-empty tensor (d >= 1)")
        return x.detach().contiguous()

    def _check_payload(
        self, payload: Sequence[torch.Tensor], d: int, dtype: torch.dtype
    ) -> None:
        """Raise ValueError if ``payload`` does not match :meth:`payload_spec` (wire mismatch)."""
        spec = self.payload_spec(d, dtype)
        got = [(tuple(t.shape), t.dtype) for t in payload]
        if got != spec:
            raise ValueError(
                f"{self!r}: payload does not match payload_spec(d={d}, dtype={dtype}); "
                f"expected {spec}, got {got}"
            )


class Identity(Compressor):
    """No compression: the payload is the dense vector itself (omega^2 = 0).

    Both :meth:`encode` and :meth:`decode` copy, so payloads never alias the
    caller's (or the receive buffer's) memory.
    """

    name = "identity"

    def omega2(self, d: int) -> float:
        _check_dim(d)
        return 0.0

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        _check_dim(d)
        return [((d,), dtype)]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        return [x.clone()]

    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self._check_payload(payload, d, dtype)
        return payload[0].clone()
