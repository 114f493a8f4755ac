"""``vcap-sidecar --record FILE``: the telemetry ``vcapctl tune`` and the controller read, compressed,
in files rotated by size.

File layout (little-endian)::

    0   8s   magic b"VCAPREC\\0"
    8   u32  format version (2; version 1 files, raw ring records, are still read)
    12  u32  n = length of the JSON header
    16  n    JSON: {"segment": SegmentConfig fields, "record_size": bytes, "abi": segment ABI,
              "created_unix_ns": ..., "codec": "zlib"}
    16+n     zero padding to a multiple of 64
    ...      chunks, each: 4s b"VCH2", u32 steps, u32 raw bytes, u32 compressed bytes, then that
             many bytes of zlib-compressed columns (below)

A chunk's columns, in order: per step ``step`` and ``time_ns`` as u64 deltas from the step before
(the first from 0), ``step_ns`` u64, ``bs``, ``generation``, ``flags``, ``mode``, ``num_queued`` u32;
per real request row (``bs`` rows of each step, at most ``max_bs``) the ``confidence`` f32 of every
draft, byte-planar (all first bytes, then all second bytes...: zlib finds the repeats), ``live``
u8 and ``accepted`` u8; per step with sampled expert counts (``FLAG_EXPERTS_SAMPLED``)
``experts_all`` and ``experts_live`` i32 per layer, byte-planar. Left out: the ring's ``seq``, rows
past ``bs`` and expert counts of unsampled steps, which no reader uses.

:class:`Recorder` buffers steps and writes one chunk per ``_CHUNK_STEPS`` steps, or once the oldest
buffered step is ``flush_s`` (10 s) old, or on close: a crash loses at most that buffer, a reader
(`vcapctl tune`) sees the steps of a slow engine within seconds, and a partial chunk at the end is
ignored (and cut off before the next append, so that the file stays readable past it). When the next chunk
would take a file past ``max_bytes`` (only a file of one chunk exceeds it), it becomes ``FILE.1``
(``FILE.1`` becomes ``FILE.2``..., at most ``keep`` old files) and a new ``FILE`` starts.
:func:`recording_files` lists them oldest first.
"""

import dataclasses
import json
import logging
import os
import struct
import threading
import time
import zlib

import numpy as np

from vcap.segment import ABI_VERSION, FLAG_EXPERTS_SAMPLED, Layout, SegmentConfig, record_dtype

from .files import check_writable, open_regular

__all__ = ["RECORDING_MAGIC", "DEFAULT_MAX_BYTES", "MIN_MAX_BYTES", "DEFAULT_KEEP", "Recorder", "Recording", "read_recording",
           "read_newest", "check_recording", "iter_recording", "recording_files", "is_recording", "encode_chunk", "decode_chunk"]

log = logging.getLogger("vcap.sidecar")

RECORDING_MAGIC = b"VCAPREC\x00"
DEFAULT_MAX_BYTES = 256 << 20   # per file
MIN_MAX_BYTES = 4096            # the smallest rotation point taken (also checked at the sidecar's start)
DEFAULT_KEEP = 3                # rotated files kept besides the current one: at most 1 GiB in all
_FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sII")
_CHUNK = struct.Struct("<4sIII")
_CHUNK_MAGIC = b"VCH2"
_CHUNK_STEPS = 1024
_MAX_CHUNK_STEPS = 1 << 21   # a buffer of _CHUNK_STEPS - 1 steps and one whole ring batch (2^20 slots)
FLUSH_S = 10.0   # a chunk at least this often while steps arrive
_STEP_COLUMNS = (("step", "<u8"), ("time_ns", "<u8"), ("step_ns", "<u8"), ("bs", "<u4"), ("generation", "<u4"),
                 ("flags", "<u4"), ("mode", "<u4"), ("num_queued", "<u4"))
_DELTA_COLUMNS = ("step", "time_ns")


def _planar(values: np.ndarray) -> bytes:
    """Bytes of ``values`` grouped by byte position (a byte-shuffle)."""
    raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1, values.dtype.itemsize)
    return raw.T.tobytes()


def _unplanar(data: memoryview, dtype: str, count: int) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    planes = np.frombuffer(data, dtype=np.uint8, count=count * itemsize).reshape(itemsize, count)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(count)


def encode_chunk(records: np.ndarray) -> bytes:
    """One chunk (header and compressed columns) of ``records`` (``record_dtype``)."""
    max_bs = records["confidence"].shape[1]
    bs = np.minimum(records["bs"].astype(np.int64), max_bs)
    real = np.arange(max_bs)[None, :] < bs[:, None]
    sampled = (records["flags"] & FLAG_EXPERTS_SAMPLED) != 0
    parts = []
    for name, dtype in _STEP_COLUMNS:
        column = records[name].astype(dtype)
        if name in _DELTA_COLUMNS:
            column = np.diff(column, prepend=np.zeros(1, dtype=dtype))
        parts.append(_planar(column))
    parts += [_planar(records["confidence"][real].astype("<f4")), records["live"][real].astype("u1").tobytes(),
              records["accepted"][real].astype("u1").tobytes(),
              _planar(records["experts_all"][sampled].astype("<i4")),
              _planar(records["experts_live"][sampled].astype("<i4"))]
    raw = b"".join(parts)
    body = zlib.compress(raw, 1)  # level 1: half the CPU of 6 for 3% more bytes
    return _CHUNK.pack(_CHUNK_MAGIC, len(records), len(raw), len(body)) + body


def decode_chunk(raw: bytes, steps: int, layout: Layout) -> np.ndarray:
    """Records (``record_dtype``; ``seq`` 0, rows past ``bs`` and unsampled expert counts 0)."""
    config = layout.config
    records = np.zeros(steps, dtype=record_dtype(layout))
    view, offset = memoryview(raw), 0
    for name, dtype in _STEP_COLUMNS:
        column = _unplanar(view[offset:], dtype, steps)
        offset += column.nbytes
        records[name] = np.cumsum(column, dtype=dtype) if name in _DELTA_COLUMNS else column
    bs = np.minimum(records["bs"].astype(np.int64), config.max_bs)
    real = np.arange(config.max_bs)[None, :] < bs[:, None]
    rows = int(real.sum())
    confidence = _unplanar(view[offset:], "<f4", rows * config.num_drafts)
    offset += confidence.nbytes
    records["confidence"][real] = confidence.reshape(rows, config.num_drafts)
    for name in ("live", "accepted"):
        records[name][real] = np.frombuffer(view, dtype="u1", count=rows, offset=offset)
        offset += rows
    sampled = (records["flags"] & FLAG_EXPERTS_SAMPLED) != 0
    count = int(sampled.sum()) * config.num_moe_layers
    for name in ("experts_all", "experts_live"):
        records[name][sampled] = _unplanar(view[offset:], "<i4", count).reshape(-1, config.num_moe_layers)
        offset += 4 * count
    if offset != len(raw):
        raise ValueError(f"chunk of {len(raw)} bytes, its columns take {offset}")
    return records


class Recorder:
    """Appends the records of one segment geometry to ``path``, compressed, rotating it at
    ``max_bytes`` (thread safe).

    >>> recorder = Recorder("trace.vcaprec", segment.layout)
    >>> recorder.write(records)          # e.g. RecordBatch.records from EngineLink's on_records
    >>> recorder.close()                 # writes what is buffered
    """

    def __init__(self, path: str, layout: Layout, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP,
                 flush_s: float = FLUSH_S):
        if max_bytes < MIN_MAX_BYTES or keep < 0 or flush_s < 0:
            raise ValueError(f"max_bytes must be >= {MIN_MAX_BYTES}, keep and flush_s >= 0, got {max_bytes}, "
                             f"{keep} and {flush_s}")
        self.path, self.layout, self.max_bytes, self.keep, self.flush_s = path, layout, max_bytes, keep, flush_s
        self._oldest = 0.0   # monotonic time the oldest buffered step arrived
        self.dtype = record_dtype(layout)
        self.records_written = 0
        self.bytes_written = 0
        self.rotations = 0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._lock = threading.Lock()
        if os.path.exists(path) and os.path.getsize(path) > 0:
            config, record_size, _, version = _read_header(path)
            if config != layout.config or record_size != layout.record_size or version != _FORMAT_VERSION:
                raise ValueError(f"{path} holds records of another engine geometry or format ({config}, "
                                 f"format {version}); record into a new file")
        self._open()

    def _open(self) -> None:
        # 0600 and never through a symlink: the file holds the engine's draft statistics
        self._file = os.fdopen(open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                            follow_symlinks=False), "ab")
        if self._file.tell() == 0:
            self._file.write(_header(self.layout))
            self._file.flush()
            self._data_offset = self._file.tell()
            return
        self._data_offset = _read_header(self.path)[2]
        with open(self.path, "rb") as file:
            _, end, stop = _scan(file, self._data_offset)
        if stop.startswith("no chunk"):
            self._file.close()
            raise ValueError(f"{self.path}: {stop}: the file is corrupt there; record into a new file")
        if stop:   # a chunk a crash cut short: appending after it would hide every later chunk
            log.warning("%s: %s cut off before appending", self.path, stop)
            os.truncate(self._file.fileno(), end)
            self._file.seek(0, os.SEEK_END)

    def write(self, records: np.ndarray) -> None:
        """Buffer records (``record_dtype`` of this layout); a chunk is written per ``_CHUNK_STEPS``."""
        if len(records) == 0:
            return
        if records.dtype.names != self.dtype.names or records.dtype["confidence"] != self.dtype["confidence"]:
            raise ValueError("records are not of this recorder's layout")
        with self._lock:
            now = time.monotonic()
            if not self._buffered:
                self._oldest = now
            self._buffer.append(records.copy())
            self._buffered += len(records)
            if self._buffered >= _CHUNK_STEPS or now - self._oldest >= self.flush_s:
                self._flush()

    def _flush(self) -> None:
        if not self._buffered:
            return
        records = np.concatenate(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        self._buffer, self._buffered = [], 0
        chunk = encode_chunk(records)
        if self._file.tell() + len(chunk) > self.max_bytes and self._file.tell() > self._data_offset:
            self._rotate()
        self._file.write(chunk)
        self._file.flush()
        self.records_written += len(records)
        self.bytes_written += len(chunk)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.keep, 0, -1):
            older = f"{self.path}.{i}"
            if os.path.exists(older):
                if i == self.keep:
                    os.unlink(older)
                else:
                    os.replace(older, f"{self.path}.{i + 1}")
        if self.keep:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)
        self.rotations += 1
        self._open()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Writes what is buffered, and closes the file even when that write fails."""
        with self._lock:
            if not self._file.closed:
                try:
                    self._flush()
                finally:
                    self._file.close()


class Recording:
    """``--record FILE``: every batch the link reads, for as long as the engine's geometry fits
    the file. An engine of another geometry stops the recording (logged), never the sidecar."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP):
        """Raises OSError or ValueError when ``path`` cannot be written or is not a recording:
        at the sidecar's start, not at the engine's first step."""
        check_writable(path)
        if os.path.getsize(path) if os.path.exists(path) else 0:
            _read_header(path)
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self.recorder: Recorder | None = None
        self.stopped = False

    def write(self, layout: Layout, records: np.ndarray) -> None:
        """Never raises: a recording that fails (a full disk, a file removed under it) stops,
        and the link that called goes on serving the engine."""
        if self.stopped:
            return
        try:
            if self.recorder is None or self.recorder.layout.config != layout.config:
                self.close()
                self.recorder = Recorder(self.path, layout, self.max_bytes, self.keep)
            self.recorder.write(records)
        except (OSError, ValueError) as error:
            log.error("recording to %s stopped: %s", self.path, error)
            self.stopped = True
            self.close()

    def close(self) -> None:
        if self.recorder is not None:
            try:
                self.recorder.close()
            except OSError as error:
                log.error("recording to %s: the last chunk was not written: %s", self.path, error)
            self.recorder = None


def _header(layout: Layout) -> bytes:
    meta = json.dumps({"segment": dataclasses.asdict(layout.config), "record_size": layout.record_size,
                       "abi": ABI_VERSION, "created_unix_ns": time.time_ns(), "codec": "zlib"}).encode()
    body = _PREFIX.pack(RECORDING_MAGIC, _FORMAT_VERSION, len(meta)) + meta
    return body + b"\x00" * (-len(body) % 64)


def _read_header(path: str) -> tuple[SegmentConfig, int, int, int]:
    with os.fdopen(open_regular(path), "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise ValueError(f"{path}: not a vcap recording ({len(prefix)} bytes, shorter than the header)")
        magic, version, length = _PREFIX.unpack(prefix)
        if magic != RECORDING_MAGIC:
            raise ValueError(f"{path}: not a vcap recording (magic {magic!r})")
        if version not in (1, _FORMAT_VERSION):
            raise ValueError(f"{path}: recording format {version}, this code reads 1 and {_FORMAT_VERSION}")
        try:
            meta = json.loads(f.read(min(length, 1 << 20)))
            config = SegmentConfig(**meta["segment"])
            record_size = int(meta["record_size"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}: the recording's header is not valid ({type(error).__name__}: {error})") from None
    data_offset = _PREFIX.size + length
    data_offset += -data_offset % 64
    return config, record_size, data_offset, version


def is_recording(path: str) -> bool:
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(len(RECORDING_MAGIC)) == RECORDING_MAGIC


def recording_files(path: str) -> list[str]:
    """``path`` and the files rotated out of it (``path.N``... ``path.1``), oldest first."""
    rotated, i = [], 1
    while os.path.exists(f"{path}.{i}"):
        rotated.append(f"{path}.{i}")
        i += 1
    return rotated[::-1] + ([path] if os.path.exists(path) else [])


def iter_recording(path: str, newest_first: bool = False):
    """``(segment config, iterator over record arrays)`` of one file, chunk by chunk (the
    newest chunk first with ``newest_first``: only the chunks read are decoded).

    Raises:
        ValueError: not a recording, or of another format version or layout, or corrupt.
    """
    config, record_size, offset, version = _read_header(path)
    layout = Layout(config)
    if layout.record_size != record_size:
        raise ValueError(f"{path}: record size {record_size}, the layout gives {layout.record_size}")
    if version == 1:
        count = (os.path.getsize(path) - offset) // record_size
        return config, iter([np.fromfile(path, dtype=record_dtype(layout), count=count, offset=offset)])
    return config, _chunks(path, offset, layout, newest_first)


def _scan(file, offset: int) -> tuple[list[tuple[int, int, int, int]], int, str]:
    """The chunks from ``offset`` on, reading headers only: ``(chunks as (body offset, steps,
    raw bytes, compressed bytes), the end of the last whole one, what stopped the scan: "" at
    the file's end)``."""
    size = os.fstat(file.fileno()).st_size
    chunks = []
    while offset < size:
        file.seek(offset)
        head = file.read(_CHUNK.size)
        if len(head) < _CHUNK.size:
            return chunks, offset, f"a partial chunk ({size - offset} bytes) at the end"
        magic, steps, raw_size, body = _CHUNK.unpack(head)
        if magic != _CHUNK_MAGIC:
            return chunks, offset, f"no chunk at byte {offset} of {size} ({size - offset} bytes unread)"
        if offset + _CHUNK.size + body > size:
            return chunks, offset, f"a partial chunk ({size - offset} bytes) at the end"
        chunks.append((offset + _CHUNK.size, steps, raw_size, body))
        offset += _CHUNK.size + body
    return chunks, offset, ""


def _decode_at(file, chunk: tuple[int, int, int, int], layout: Layout, path: str) -> np.ndarray:
    body_offset, steps, raw_size, size = chunk
    if steps > _MAX_CHUNK_STEPS or raw_size > steps * layout.record_size:
        raise ValueError(f"{path}: chunk at byte {body_offset - _CHUNK.size} claims {steps} steps of {raw_size} "
                         "bytes, more than a recorder writes")
    file.seek(body_offset)
    inflate = zlib.decompressobj()
    try:   # never more than the header's size: a crafted chunk cannot inflate without bound
        raw = inflate.decompress(file.read(size), raw_size + 1)
    except zlib.error as error:
        raise ValueError(f"{path}: chunk at byte {body_offset - _CHUNK.size}: {error}") from None
    if len(raw) != raw_size or not inflate.eof:
        raise ValueError(f"{path}: chunk at byte {body_offset - _CHUNK.size} does not inflate to the {raw_size} "
                         "bytes its header says")
    return decode_chunk(raw, steps, layout)


def _chunks(path: str, offset: int, layout: Layout, newest_first: bool = False):
    with os.fdopen(open_regular(path), "rb") as f:
        chunks, _, stop = _scan(f, offset)
        if stop.startswith("no chunk"):
            raise ValueError(f"{path}: {stop}: the file is corrupt there")
        if stop:
            log.warning("%s: %s ignored (a write cut short)", path, stop)
        for chunk in (reversed(chunks) if newest_first else chunks):
            yield _decode_at(f, chunk, layout, path)


def read_recording(path: str) -> tuple[SegmentConfig, np.ndarray]:
    """``(segment config, records)`` of a file written by :class:`Recorder` (only this file: see
    :func:`recording_files` for the rotated ones).

    Raises:
        ValueError: not a recording, or of another format version or layout.
    """
    config, chunks = iter_recording(path)
    parts = list(chunks)
    records = np.concatenate(parts) if parts else np.zeros(0, dtype=record_dtype(Layout(config)))
    return config, records


def check_recording(path: str) -> None:
    """Check ``path`` and the files rotated out of it without decoding them: headers and chunk
    framing (a partial chunk at the end is a crash's, and allowed).

    Raises:
        ValueError, OSError: naming the file and what is wrong.
    """
    for name in recording_files(path):
        _, _, offset, version = _read_header(name)
        if version == 1:
            continue
        with os.fdopen(open_regular(name), "rb") as file:
            stop = _scan(file, offset)[2]
        if stop.startswith("no chunk"):
            raise ValueError(f"{name}: {stop}: the file is corrupt there")


def read_newest(path: str, max_steps: int) -> tuple[SegmentConfig | None, np.ndarray]:
    """``(segment config, records)``: the newest ``max_steps`` steps of ``path`` and the files
    rotated out of it, of the newest file's geometry; only the chunks that hold them are read
    (a prior of 20k steps from 1 GiB of recordings decodes a few MB). ``(None, empty)``
    without a file.

    Raises:
        ValueError: a file that is not a recording, or corrupt.
    """
    newest, parts, steps = None, [], 0
    for name in reversed(recording_files(path)):
        config, chunks = iter_recording(name, newest_first=True)
        if newest is not None and config != newest:
            break
        newest = config
        for records in chunks:
            parts.append(records)
            steps += len(records)
            if steps >= max_steps:
                break
        if steps >= max_steps:
            break
    if newest is None:
        return None, np.zeros(0)
    if not parts:
        return newest, np.zeros(0, dtype=record_dtype(Layout(newest)))
    return newest, np.concatenate(parts[::-1])[-max_steps:]
