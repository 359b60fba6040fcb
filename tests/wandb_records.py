"""Reads the history rows of an offline W&B run from its ``run-*.wandb`` file (tests only).

The file is a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of records with a 7-byte header:
crc32c, length, type FULL/FIRST/MIDDLE/LAST); every record is a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def _records(raw: bytes) -> list[bytes]:
    records: list[bytes] = []
    partial = b""
    pos = HEADER
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + HEADER])
        data = raw[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            records.append(data)
        elif kind == 2:
            partial = data
        elif kind == 3:
            partial += data
        elif kind == 4:
            records.append(partial + data)
    return records


def history_rows(run_file: Path) -> list[dict[str, Any]]:
    """Every ``wandb.log`` row of the run, as ``{key: value}``."""
    from wandb.proto import wandb_internal_pb2

    raw = Path(run_file).read_bytes()
    assert raw[:4] == b":W&B", f"{run_file} is not a W&B run file"
    rows = []
    for data in _records(raw):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows
