"""Reading an offline wandb run back, for tests.

wandb 0.31 has no command that prints an offline run (``wandb sync --view`` is gone), so this
reads the run's ``.wandb`` file the way wandb-core writes it: a 7-byte header, then LevelDB-log
records (32 KiB blocks; checksum, length, type) holding wandb's own ``Record`` protobufs
(``wandb.proto.wandb_internal_pb2``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(run_root: Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} over every offline run file under ``run_root`` (a resumed run
    offline writes a second run directory with the same id)."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted(Path(run_root).glob("offline-run-*/run-*.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                out.setdefault(int(record.history.step.num), {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")}
                )
    return out


def run_records(run_root: Path) -> list[object]:
    """The ``run`` records (id, project, name, tags, config) of the offline runs under ``run_root``."""
    return [
        r.run for path in sorted(Path(run_root).glob("offline-run-*/run-*.wandb"))
        for r in records(path) if r.WhichOneof("record_type") == "run"
    ]
