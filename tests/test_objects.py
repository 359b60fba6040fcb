"""The typed encoding that replaces pickle between nodes: plain values round-trip, everything else is refused on both
sides, and a pickle payload is refused unread (its code never runs)."""

from __future__ import annotations

import os
import pathlib
import pickle

import pytest
import torch

from lightning_privdec.comm.objects import MAGIC, UnsafeObjectError, decode, encode


class Payload:
    """Unpickling this runs ``os.system``: it writes ``marker`` (what a malicious node would send)."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def pickle_payload(marker: pathlib.Path) -> bytes:
    return pickle.dumps(Payload(marker))


def test_the_payload_really_executes_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle_payload(marker))  # what all_gather_object would do on the receiving node
    assert marker.exists()


def test_plain_values_round_trip_with_their_types():
    value = {
        "none": None, "flags": [True, False], "ints": [0, -1, 2**70, -(2**70)], "float": -1.5e-300, "inf": float("inf"),
        "text": "héllo", "raw": b"\x00\xff", "tuple": (1, (2, "x")), 3: "int key", (1, 2): "tuple key",
        "path": pathlib.Path("/tmp/ckpt/epoch=1.ckpt"),
        "tensors": [torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.tensor([True]), torch.zeros(0, 4),
                    torch.tensor(7, dtype=torch.int16), torch.tensor([1.5], dtype=torch.bfloat16)],
    }
    back = decode(encode(value))
    assert set(back) == set(value)
    for key in value:
        if key != "tensors":
            assert back[key] == value[key] and type(back[key]) is type(value[key])
    assert isinstance(back["path"], pathlib.Path)
    for got, sent in zip(back["tensors"], value["tensors"]):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
    assert isinstance(back["tuple"][1], tuple)


@pytest.mark.parametrize(
    "value, where",
    [
        (object(), "value is a builtins.object"),
        ({"a": [1, Payload(pathlib.Path("x"))]}, "value['a'][1] is a tests.test_objects.Payload"),
        ({1, 2}, "value is a builtins.set"),
        (lambda: 0, "value is a builtins.function"),
        (torch.zeros(2).to_sparse(), "dense"),
    ],
)
def test_anything_but_plain_values_is_refused_before_it_is_sent(value, where):
    with pytest.raises(UnsafeObjectError, match="checkpoint path") as error:
        encode(value, "checkpoint path")
    assert where in str(error.value)


def test_a_pickle_payload_is_refused_unread_and_never_executes(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(UnsafeObjectError, match=r"from node 2 is not a typed .* looks like a pickle"):
        decode(pickle_payload(marker), "the configuration check from node 2")
    with pytest.raises(UnsafeObjectError, match="unknown type tag"):  # behind a forged header: still not unpickled
        decode(MAGIC + pickle_payload(marker))
    assert not marker.exists()


@pytest.mark.parametrize(
    "message, problem",
    [
        (MAGIC + b"l" + (10**6).to_bytes(8, "big"), "exceeds the bytes left"),
        (MAGIC + b"s" + (1 << 62).to_bytes(8, "big") + b"ab", "runs past the end"),
        (MAGIC + b"x" + (13).to_bytes(8, "big") + b"torch.float32" + bytes([1]) + (1 << 40).to_bytes(8, "big"), "runs past"),
        (MAGIC + b"x" + (11).to_bytes(8, "big") + b"torch.uint7" + bytes([0]), "dtype"),
        (MAGIC + b"N" + b"N", "trailing bytes"),
        (MAGIC + (b"l" + (1).to_bytes(8, "big")) * 100 + b"N", "nesting"),
        (MAGIC + b"d" + (1).to_bytes(8, "big") + b"l" + (0).to_bytes(8, "big") + b"N", "unhashable"),
    ],
)
def test_malformed_messages_are_refused_without_allocating(message, problem):
    with pytest.raises(UnsafeObjectError, match=problem):
        decode(message)
