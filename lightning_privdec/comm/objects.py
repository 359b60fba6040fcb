"""Objects between nodes without pickle: a fixed, typed byte encoding and the collectives built on it.

torch.distributed's object collectives (``all_gather_object``, ``gather_object``, ``broadcast_object_list``) pickle
on the sending side and unpickle on the receiving side, so any member of the process group could run code on every
other. Every object a node of this library receives from another node goes through :func:`decode` instead, which
builds only the plain types below and refuses anything else, naming the sender:

==========  ======================================================================================================
tag         value
==========  ======================================================================================================
``N``       None
``T`` ``F`` True, False
``i``       int: u32 length, then the two's-complement big-endian bytes
``f``       float: IEEE 754 binary64, big-endian
``s``       str: u64 length, then UTF-8
``b``       bytes: u64 length, then the bytes
``l`` ``t`` list, tuple: u64 count, then the items
``d``       dict: u64 count, then key, value, key, value... (keys: None, bool, int, float, str, bytes, tuple, path)
``p``       a filesystem path (``pathlib.Path`` on the receiver): as a str
``x``       a CPU tensor: dtype name (str), u8 ndim, u64 per dimension, then its raw bytes (native byte order)
==========  ======================================================================================================

A message is ``MAGIC`` followed by one value that uses the whole buffer. Lengths are checked against what is left
before anything is allocated, and nesting is limited to :data:`MAX_DEPTH`, so a hostile message can only be refused.
"""

from __future__ import annotations

import math
import pathlib
import struct
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MAGIC",
    "UnsafeObjectError",
    "all_gather_bytes",
    "all_gather_objects",
    "broadcast_bytes",
    "broadcast_object",
    "decode",
    "encode",
    "gather_bytes",
    "gather_objects",
]

MAGIC = b"privdec-obj/1\n"
MAX_DEPTH = 64

#: the tensor dtypes a message may hold, by name (no object or quantized dtypes)
_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}

PLAIN_TYPES = "None, bool, int, float, str, bytes, list, tuple, dict, pathlib paths and CPU tensors"


class UnsafeObjectError(TypeError):
    """A value that the typed encoding does not carry (sending side), or a received message that is not a
    well-formed typed message (receiving side, e.g. a pickle): nothing of it is executed or used."""


# ---- encoding ----------------------------------------------------------------------------------------------------------
def encode(value: Any, what: str = "this message") -> bytes:
    """``value`` as a typed message; :class:`UnsafeObjectError` naming the offending entry if it holds anything but
    the plain types of the module docstring."""
    out = bytearray(MAGIC)
    _encode(value, out, what, "value", 0)
    return bytes(out)


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _encode(value: Any, out: bytearray, what: str, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise UnsafeObjectError(f"{what}: {where} is nested deeper than {MAX_DEPTH} levels")
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"T" if value else b"F"
    elif isinstance(value, int) and type(value) is not bool:
        raw = int(value).to_bytes(max(1, (int(value).bit_length() + 8) // 8), "big", signed=True)
        out += b"i" + len(raw).to_bytes(4, "big") + raw
    elif isinstance(value, float):
        out += b"f" + struct.pack(">d", float(value))
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"s" + _u64(len(raw)) + raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out += b"b" + _u64(len(raw)) + raw
    elif isinstance(value, pathlib.PurePath):
        raw = str(value).encode("utf-8")
        out += b"p" + _u64(len(raw)) + raw
    elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        out += (b"l" if type(value) is list else b"t") + _u64(len(value))
        for k, item in enumerate(value):
            _encode(item, out, what, f"{where}[{k}]", depth + 1)
    elif type(value) is dict:
        out += b"d" + _u64(len(value))
        for key, item in value.items():
            if isinstance(key, (list, dict, torch.Tensor)):
                raise UnsafeObjectError(f"{what}: {where} has a key of type {type(key).__name__}")
            _encode(key, out, what, f"{where} key {key!r}", depth + 1)
            _encode(item, out, what, f"{where}[{key!r}]", depth + 1)
    elif isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or str(value.dtype) not in _DTYPES:
            raise UnsafeObjectError(
                f"{what}: {where} is a {value.device.type} {value.dtype} tensor (layout {value.layout}); only dense "
                f"CPU tensors of dtype {', '.join(_DTYPES)} travel: move it with .cpu() first"
            )
        data = value.detach().contiguous()
        name = str(data.dtype).encode()
        out += b"x" + _u64(len(name)) + name + bytes([data.dim()]) + b"".join(_u64(s) for s in data.shape)
        out += data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    else:
        raise UnsafeObjectError(
            f"{what}: {where} is a {type(value).__module__}.{type(value).__qualname__}; nodes exchange only "
            f"{PLAIN_TYPES} (never pickled objects, which would let one node run code on another). Convert it "
            "to one of these types (e.g. str(x), x.tolist(), dataclasses.asdict(x)) before sending it."
        )


# ---- decoding ----------------------------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = memoryview(data), 0, what

    def fail(self, problem: str) -> UnsafeObjectError:
        return UnsafeObjectError(f"{self.what} is not a well-formed typed message ({problem} at byte {self.pos})")

    def take(self, n: int) -> memoryview:
        if n < 0 or n > len(self.data) - self.pos:
            raise self.fail(f"a length of {n} bytes runs past the end")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def count(self) -> int:
        n = self.u64()
        if n > len(self.data) - self.pos:  # every item takes at least one byte
            raise self.fail(f"a count of {n} items exceeds the bytes left")
        return n

    def text(self) -> str:
        try:
            return bytes(self.take(self.u64())).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string is not UTF-8") from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(f"nesting deeper than {MAX_DEPTH}")
        tag = bytes(self.take(1))
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"i":
            return int.from_bytes(self.take(int.from_bytes(self.take(4), "big")), "big", signed=True)
        if tag == b"f":
            return struct.unpack(">d", self.take(8))[0]
        if tag == b"s":
            return self.text()
        if tag == b"b":
            return bytes(self.take(self.u64()))
        if tag == b"p":
            return pathlib.Path(self.text())
        if tag in (b"l", b"t"):
            items = [self.value(depth + 1) for _ in range(self.count())]
            return items if tag == b"l" else tuple(items)
        if tag == b"d":
            result = {}
            for _ in range(self.count()):
                key = self.value(depth + 1)
                try:
                    hash(key)
                except TypeError:
                    raise self.fail("an unhashable dict key") from None
                result[key] = self.value(depth + 1)
            return result
        if tag == b"x":
            return self.tensor()
        raise self.fail(f"unknown type tag {tag!r}")

    def tensor(self) -> torch.Tensor:
        dtype = _DTYPES.get(self.text())
        if dtype is None:
            raise self.fail("a tensor dtype outside the allowed ones")
        shape = [self.u64() for _ in range(self.take(1)[0])]
        numel = math.prod(shape)
        raw = self.take(numel * dtype.itemsize)  # checked against the bytes left before any allocation
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if numel else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)


def decode(data: bytes | bytearray | memoryview, what: str = "a message") -> Any:
    """The value of a typed message; :class:`UnsafeObjectError` (nothing executed) for anything else."""
    reader = _Reader(bytes(data), what)
    if bytes(reader.take(min(len(MAGIC), len(reader.data)))) != MAGIC:
        kind = " (it looks like a pickle)" if bytes(data[:1]) == b"\x80" else ""
        raise UnsafeObjectError(
            f"{what} is not a typed lightning_privdec message{kind}: refused unread. A node that sends anything else "
            "runs a different library version or is not a legitimate member; nothing of its message was used."
        )
    value = reader.value(0)
    if reader.pos != len(reader.data):
        raise reader.fail("trailing bytes")
    return value


# ---- collectives -------------------------------------------------------------------------------------------------------
def _device() -> torch.device:
    """Where the process group's collectives need their tensors (NCCL: this process's CUDA device)."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer.to(device)


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every process's byte string by rank: one all-gather of the lengths, one of the (padded) bytes."""
    device, world = _device(), dist.get_world_size()
    sizes = _lengths(len(data), device, world)
    buffers = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(buffers, _as_tensor(data, max(sizes), device))
    return [_bytes(b, n) for b, n in zip(buffers, sizes)]


def gather_bytes(data: bytes, dst: int = 0) -> list[bytes] | None:
    """Every process's byte string by rank on ``dst`` (``None`` elsewhere)."""
    device, world = _device(), dist.get_world_size()
    sizes = _lengths(len(data), device, world)
    buffers = None
    if dist.get_rank() == dst:
        buffers = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.gather(_as_tensor(data, max(sizes), device), buffers, dst=dst)
    return None if buffers is None else [_bytes(b, n) for b, n in zip(buffers, sizes)]


def broadcast_bytes(data: bytes, src: int = 0) -> bytes:
    """``src``'s byte string on every process (``data`` is ignored elsewhere)."""
    device = _device()
    length = torch.tensor([len(data) if dist.get_rank() == src else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    buffer = _as_tensor(data if dist.get_rank() == src else b"", int(length.item()), device)
    dist.broadcast(buffer, src=src)
    return _bytes(buffer, int(length.item()))


def _lengths(n: int, device: torch.device, world: int) -> list[int]:
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([n], dtype=torch.int64, device=device))
    return [int(t.item()) for t in lengths]


def _bytes(buffer: torch.Tensor, length: int) -> bytes:
    return buffer[:length].cpu().numpy().tobytes()


def _alone() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def all_gather_objects(value: Any, what: str = "a gathered object") -> list[Any]:
    """Every node's ``value`` by rank, as :func:`encode` carries it (no pickle); just ``[value]`` alone."""
    if _alone():
        return [value]
    gathered = all_gather_bytes(encode(value, what))
    return [decode(raw, f"{what} from node {r}") for r, raw in enumerate(gathered)]


def gather_objects(value: Any, dst: int = 0, what: str = "a gathered object") -> list[Any] | None:
    """Every node's ``value`` by rank on ``dst`` (``None`` elsewhere), as :func:`encode` carries it (no pickle)."""
    if _alone():
        return [value]
    gathered = gather_bytes(encode(value, what), dst)
    return None if gathered is None else [decode(raw, f"{what} from node {r}") for r, raw in enumerate(gathered)]


def broadcast_object(value: Any, src: int = 0, what: str = "a broadcast object") -> Any:
    """``src``'s ``value`` on every node, as :func:`encode` carries it (no pickle); ``src`` gets ``value`` back."""
    if _alone():
        return value
    raw = broadcast_bytes(encode(value, what) if dist.get_rank() == src else b"", src)
    return value if dist.get_rank() == src else decode(raw, f"{what} from node {src}")
