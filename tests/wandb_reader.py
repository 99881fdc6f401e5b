"""Read a W&B offline run's ``.wandb`` transaction log back (history rows and config).

The file is ``:W&B`` + magic ``0xBEE1`` + version byte, then LevelDB-log-style records in
32 KiB blocks: crc32 (4 bytes), length (2 bytes, little-endian), type (1: full, 2: first,
3: middle, 4: last), payload; each payload is a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32 * 1024
HEADER = 7


def _payloads(path: str):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, parts = 7, []
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield payload
        elif kind == 2:
            parts = [payload]
        elif kind == 3:
            parts.append(payload)
        elif kind == 4:
            parts.append(payload)
            yield b"".join(parts)


def read_offline_run(save_dir: str) -> dict:
    """{"history": [row, ...], "config": {...}, "run_name": str, "exit_code": int or None (no exit record)}
    of the one offline run in save_dir."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {save_dir}, found {files}"
    out = {"history": [], "config": {}, "run_name": None, "exit_code": None}
    for payload in _payloads(files[0]):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
        elif kind == "config":
            for item in record.config.update:
                key = item.key or "/".join(item.nested_key)
                out["config"][key] = json.loads(item.value_json)
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
        elif kind == "run":
            out["run_name"] = record.run.display_name
            for item in record.run.config.update:
                key = item.key or "/".join(item.nested_key)
                out["config"][key] = json.loads(item.value_json)
    return out
