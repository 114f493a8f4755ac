"""``vcap-sidecar --record FILE``: the raw telemetry records, appended to a self-describing file.

File layout (little-endian)::

    0   8s   magic b"VCAPREC\\0"
    8   u32  format version (1)
    12  u32  n = length of the JSON header
    16  n    JSON: {"segment": SegmentConfig fields, "record_size": bytes, "abi": segment ABI,
              "created_unix_ns": ...}
    16+n     zero padding to a multiple of 64
    ...      records, ``record_size`` bytes each, exactly as in the ring (vcap.segment.record_dtype)

A partial record at the end (a crash mid-write) is ignored by :func:`read_recording`.
"""

import dataclasses
import json
import logging
import os
import struct
import threading
import time

import numpy as np

from vcap.segment import ABI_VERSION, Layout, SegmentConfig, record_dtype

__all__ = ["RECORDING_MAGIC", "Recorder", "Recording", "read_recording", "is_recording"]

log = logging.getLogger("vcap.sidecar")

RECORDING_MAGIC = b"VCAPREC\x00"
_FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")


class Recorder:
    """Appends raw records of one segment geometry to ``path`` (thread safe).

    >>> recorder = Recorder("trace.vcaprec", segment.layout)
    >>> recorder.write(records)          # e.g. RecordBatch.records from EngineLink's on_records
    """

    def __init__(self, path: str, layout: Layout):
        self.path, self.layout = path, layout
        self.dtype = record_dtype(layout)
        self.records_written = 0
        self._lock = threading.Lock()
        exists = os.path.exists(path) and os.path.getsize(path) > 0
        if exists:
            config, record_size, _ = _read_header(path)
            if config != layout.config or record_size != layout.record_size:
                raise ValueError(f"{path} holds records of another engine geometry ({config}); "
                                 "record into a new file")
        self._file = open(path, "ab")
        if not exists:
            self._file.write(_header(layout))
            self._file.flush()

    def write(self, records: np.ndarray) -> None:
        """Append records (``record_dtype`` of this layout); ``ring`` is not stored."""
        if len(records) == 0:
            return
        if records.dtype.names != self.dtype.names or records.dtype["confidence"] != self.dtype["confidence"]:
            raise ValueError("records are not of this recorder's layout")
        if records.dtype != self.dtype:  # e.g. packed by np.concatenate: restore the ring layout
            records = records.astype(self.dtype)
        with self._lock:
            self._file.write(np.ascontiguousarray(records).tobytes())
            self._file.flush()
            self.records_written += len(records)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class Recording:
    """``--record FILE``: every batch the link reads, for as long as the engine's geometry fits
    the file. An engine of another geometry stops the recording (logged), never the sidecar."""

    def __init__(self, path: str):
        self.path = path
        self.recorder: Recorder | None = None
        self.stopped = False

    def write(self, layout: Layout, records: np.ndarray) -> None:
        if self.stopped:
            return
        if self.recorder is None or self.recorder.layout.config != layout.config:
            self.close()
            try:
                self.recorder = Recorder(self.path, layout)
            except ValueError as error:
                log.error("recording stopped: %s", error)
                self.stopped = True
                return
        self.recorder.write(records)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None


def _header(layout: Layout) -> bytes:
    meta = json.dumps({"segment": dataclasses.asdict(layout.config), "record_size": layout.record_size,
                       "abi": ABI_VERSION, "created_unix_ns": time.time_ns()}).encode()
    body = _PREFIX.pack(RECORDING_MAGIC, _FORMAT_VERSION, len(meta)) + meta
    return body + b"\x00" * (-len(body) % 64)


def _read_header(path: str) -> tuple[SegmentConfig, int, int]:
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise ValueError(f"{path}: too short for a vcap recording")
        magic, version, length = _PREFIX.unpack(prefix)
        if magic != RECORDING_MAGIC:
            raise ValueError(f"{path}: not a vcap recording (magic {magic!r})")
        if version != _FORMAT_VERSION:
            raise ValueError(f"{path}: recording format {version}, this code reads {_FORMAT_VERSION}")
        meta = json.loads(f.read(length))
    config = SegmentConfig(**meta["segment"])
    data_offset = _PREFIX.size + length
    data_offset += -data_offset % 64
    return config, int(meta["record_size"]), data_offset


def is_recording(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(RECORDING_MAGIC)) == RECORDING_MAGIC


def read_recording(path: str) -> tuple[SegmentConfig, np.ndarray]:
    """``(segment config, records)`` of a file written by :class:`Recorder`.

    Raises:
        ValueError: not a recording, or of another format version or layout.
    """
    config, record_size, offset = _read_header(path)
    layout = Layout(config)
    if layout.record_size != record_size:
        raise ValueError(f"{path}: record size {record_size}, the layout gives {layout.record_size}")
    count = (os.path.getsize(path) - offset) // record_size
    records = np.fromfile(path, dtype=record_dtype(layout), count=count, offset=offset)
    return config, records
