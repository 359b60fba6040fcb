"""Communication compressors: what actually goes on the wire between gossip neighbours.

Every compressor turns a flat vector into compact payload tensors
(:meth:`Compressor.encode`), rebuilds the dense ``Q(x)`` from them
(:meth:`Compressor.decode`) and reports its exact wire size
(:meth:`Compressor.encoded_nbytes`) and contraction constant
(:meth:`Compressor.omega2`, CHOCO-SGD / DP-CSGP Assumption 4).

Use :func:`build_compressor` to create one from a CLI-style string such as
``"topk:0.01"``.
"""

from __future__ import annotations

from .base import DRAW_FORMAT, Compressor, Identity, PayloadSpec, Workspace, make_generator
from .bits import pack_bits, packed_nbytes, unpack_bits
from .quantizers import QSGD, Sign
from .sparsifiers import RandK, TopK

__all__ = [
    "DRAW_FORMAT",
    "Compressor",
    "Identity",
    "TopK",
    "RandK",
    "QSGD",
    "Sign",
    "PayloadSpec",
    "Workspace",
    "build_compressor",
    "make_generator",
    "pack_bits",
    "unpack_bits",
    "packed_nbytes",
]

_VALID_FORMS = (
    '"none" (no compressor), "identity", "topk:<ratio in (0, 1]>", '
    '"randk:<ratio in (0, 1]>", "qsgd:<bits in 1..16>", "sign"'
)


def build_compressor(spec: str | Compressor | None) -> Compressor | None:
    """Build a compressor from ``None``, a :class:`Compressor`, or a string spec.

    Strings (case-insensitive): ``"none"`` -> ``None``, ``"identity"``, ``"topk:0.01"``,
    ``"randk:0.1"``, ``"qsgd:8"``, ``"sign"``. Raises ValueError listing the valid forms otherwise.
    """
    if spec is None or isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"compressor spec must be None, a Compressor or a string; valid strings: {_VALID_FORMS}")

    text = spec.strip().lower()
    name, sep, arg = text.partition(":")
    name, arg = name.strip(), arg.strip()
    try:
        if not sep:
            if name == "none":
                return None
            if name == "identity":
                return Identity()
            if name == "sign":
                return Sign()
        elif arg:
            if name == "topk":
                return TopK(float(arg))
            if name == "randk":
                return RandK(float(arg))
            if name == "qsgd":
                return QSGD(int(arg))
    except ValueError as err:
        raise ValueError(f"invalid compressor spec {spec!r}: {err}. Valid forms: {_VALID_FORMS}") from err
    raise ValueError(f"unknown compressor spec {spec!r}. Valid forms: {_VALID_FORMS}")
