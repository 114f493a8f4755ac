"""The shared-memory segment between the engine and the sidecar (ABI 1).

One file in ``/dev/shm`` (``/dev/shm/<name>``, mode 0600 unless a group is given). **The
engine creates and owns it**: its captured CUDA graphs hold device pointers into the pages it
registered with ``cudaHostRegister``, so the file must never be recreated or truncated under
it. The sidecar only attaches; an engine restart shows up as a new inode.

Every integer is little-endian; every region starts on a 64-byte boundary. Sizes come from the
engine (``stride = block + 1``, ``max_bs`` = its largest graph batch, its MoE layer count).
With ``D = stride - 1`` (drafts per request), ``B = max_buckets``, ``N = max_bs``,
``Y = num_moe_layers``:

Header, offset 0, 128 bytes::

    0   8s   magic b"VCAPSHM\\0"          48  u32  max_buckets B
    8   u32  abi_version (1)              52  u32  control_size (bytes of one control block)
    12  u32  header_size (128)            56  u32  engine_pid
    16  u64  total_size                   60  u32  lease_ms (lease length, engine's clock)
    24  u32  stride (D + 1)               64  u64  created_unix_ns
    28  u32  max_bs N                     72  u64  expert_bytes (bytes of one routed expert)
    32  u32  num_moe_layers Y             80  u32  num_experts (routed)
    36  u32  num_rings                    84  u32  top_k
    40  u32  ring_slots (records/ring)    88  u32  expert_sample_period (steps; 0 = never)
    44  u32  record_size                  92  u32  dispatch_row_bytes (see below)
                                          96..127  zero

``dispatch_row_bytes``: bytes one verify row sends in the MoE's all-to-all dispatch (a dead row,
expert id -1, is not sent); 0 means no dispatch (a TP MoE) or not stated. It came after ABI 1's
first header, in its zero tail: an older engine's segment has 0 there, so the ABI stayed 1.

Control block, ``control_size = 32 + B * bucket_size`` rounded up to 64 bytes, with
``bucket_size = 16 + 4 * D`` rounded up to 16; u32/i32/f32 words so a GPU kernel can load
them as one int32 array::

    0   u32  seq          seqlock: odd while a write is in flight
    4   u32  generation   bumped by the sidecar on every policy change
    8   i32  mode         0 off, 1 fixed, 2 conf
    12  i32  fixed_k
    16  i32  num_buckets
    20  i32  explore_period (0 = never)
    24  i32  source       who wrote it: 0 engine, 1 manual (gRPC), 2 auto, 3 file
    28  u32  zero
    32  bucket[b] at 32 + b * bucket_size:
            0 i32 min_bs, 4 i32 k_min, 8 i32 k_max, 12 i32 zero, 16 f32 thresholds[D]

Regions, in order:

- ``128``: the **fallback** policy, a control block the engine writes once at creation from
  its own configuration and never changes; it applies while the lease is expired.
- ``128 + C``: the **control** block, written by the sidecar under the seqlock.
- ``128 + 2C``: the **lease**, 64 bytes, outside the seqlock::

      0 u64 heartbeat (the sidecar increments it), 8 u32 sidecar_pid, 12..63 zero

  The engine judges it by its own clock: unchanged for ``lease_ms``, or a control block left
  odd for ``lease_ms``, means expired.
- ``128 + 2C + 64``: **engine status**, 64 bytes, written by the engine::

      0 u64 steps, 8 u32 fallback_active, 12 u32 guard_tripped, 16 u64 guard_violations,
      24 u64 engine_heartbeat (bumped every step), 32..63 zero

- then ``num_rings`` telemetry **rings**, one per writing rank, each a 64-byte ring header
  (``0 u64 next_record``: records published so far, ``8 u32 ring_index``) followed by
  ``ring_slots`` records of ``record_size`` bytes. Record ``n`` lives in slot ``n % slots``.

Record (``record_size`` rounded up to 64)::

    0   u64 seq          2n+1 while record n is written, 2n+2 once published (written last)
    8   u64 step         engine step counter
    16  u64 time_ns      the engine's clock at the end of the step
    24  u64 step_ns      duration of the verify step (0: not measured)
    32  u32 bs           real, unpadded batch size
    36  u32 generation   policy generation the step used (the fallback's is 0)
    40  u32 flags        1 fallback, 2 explore (all live), 4 experts sampled, 8 guard violation,
                         16 confidence missing
    44  u32 mode         mode the step used
    48  u32 num_queued   requests waiting in the engine (0 if unknown)
    52..63 zero
    64                f32 confidence[N * D]   row-major, request-major
    64 + 4ND          u8  live[N]             L = 1 + k
    64 + 4ND + N      u8  accepted[N]         accepted drafts, 0..L-1 (no bonus token)
    align8(64+4ND+2N) i32 experts_all[Y]      distinct experts of all rows (sampled steps)
    ... + 4Y          i32 experts_live[Y]     distinct experts of live rows

Writers publish a record by writing ``seq = 2n+1``, the data, then ``seq = 2n+2`` and the ring
header's ``next_record = n+1``. A reader reads ``next_record``, copies the new records, and reads
``next_record`` again: a record copied is whole unless the writer had reached its slot's next
lap by then (for the one slot the writer may be inside, its seq is read again after the copy),
and its seq must read ``2n+2``; anything else is an overwritten slot and counts as a drop.

Host-side ordering relies on x86-64's store order (TSO): each of those writes is its own
``pwrite``, a system call after the one before; the GPU side uses system-scope fences.

A load or store on a page past a truncated file's end raises SIGBUS, which kills the process
however recently it checked the size. So every host access another process's truncation could
race goes through the file (``pread``/``pwrite``: past the end a read comes back short and a
write grows the file, which the engine then restores): the control block, lease, status and the
simulated engine's rings, on both sides. The mapping serves the GPU (registered pages, which
never fault) and tests.
"""

import errno
import fcntl
import mmap
import os
import pwd
import stat
import struct
import time
import weakref

import numpy as np

from vcap.control import (BUCKET_K_MAX, BUCKET_K_MIN, BUCKET_MIN_BS, BUCKET_THRESHOLDS, CONTROL_EXPLORE_PERIOD,
                          CONTROL_FALLBACK, CONTROL_FIXED_K, CONTROL_GENERATION, CONTROL_HEAD_WORDS, CONTROL_HELD,
                          CONTROL_LIVE, CONTROL_MODE, CONTROL_NUM_BUCKETS, CONTROL_SEQ, CONTROL_SOURCE,
                          CONTROL_STATES, MODE_CODES, MODE_CONF, MODE_FIXED, MODE_NAMES, MODE_OFF, SOURCES,
                          ControlReader, ControlSnapshot, decode_policy, encode_policy)
from vcap.layout import (_HEADER, _HEADER_TAIL, ABI_VERSION, HEADER_SIZE, MAGIC, MAX_BUCKETS, MAX_STRIDE, RECORD_HEADER_SIZE,
                         Layout, SegmentConfig, SegmentError, SegmentTruncated, read_layout)
from vcap.policy import Policy, default_policy
from vcap.ring import (FLAG_CONF_MISSING, FLAG_EXPERTS_SAMPLED, FLAG_EXPLORE, FLAG_FALLBACK, FLAG_GUARD_VIOLATION,
                       RECORD_BS, RECORD_FLAGS, RECORD_GENERATION, RECORD_MODE, RECORD_NUM_QUEUED, RECORD_SEQ,
                       RECORD_STEP, RECORD_STEP_NS, RECORD_TIME_NS, RingReader, RingWriter, record_dtype)

__all__ = [
    "MAGIC", "ABI_VERSION", "HEADER_SIZE", "RECORD_HEADER_SIZE", "MAX_STRIDE", "MAX_BUCKETS", "SegmentConfig", "SegmentError",
    "SegmentTruncated", "Layout", "Segment",
    "ControlSnapshot", "ControlReader", "RingReader", "RingWriter", "record_dtype", "segment_path",
    "encode_policy", "decode_policy", "MAX_STRIDE", "MAX_BUCKETS",
    "FLAG_FALLBACK", "FLAG_EXPLORE", "FLAG_EXPERTS_SAMPLED", "FLAG_GUARD_VIOLATION",
    "FLAG_CONF_MISSING", "SOURCES", "MODE_OFF", "MODE_FIXED", "MODE_CONF", "MODE_CODES", "MODE_NAMES",
    "CONTROL_SEQ", "CONTROL_GENERATION", "CONTROL_MODE", "CONTROL_FIXED_K", "CONTROL_NUM_BUCKETS",
    "CONTROL_EXPLORE_PERIOD", "CONTROL_SOURCE", "CONTROL_HEAD_WORDS", "BUCKET_MIN_BS", "BUCKET_K_MIN",
    "BUCKET_K_MAX", "BUCKET_THRESHOLDS", "CONTROL_LIVE", "CONTROL_HELD", "CONTROL_FALLBACK",
    "CONTROL_STATES", "RECORD_SEQ", "RECORD_STEP", "RECORD_TIME_NS", "RECORD_STEP_NS", "RECORD_BS",
    "RECORD_GENERATION", "RECORD_FLAGS", "RECORD_MODE", "RECORD_NUM_QUEUED", "STATUS_STEPS",
    "STATUS_GUARD_VIOLATIONS", "STATUS_ENGINE_HEARTBEAT", "STATUS_FALLBACK_ACTIVE", "STATUS_GUARD_TRIPPED",
]

# Engine status: u64 words, then u32 words (fallback_active and guard_tripped share u64 word 1).
STATUS_STEPS, STATUS_GUARD_VIOLATIONS, STATUS_ENGINE_HEARTBEAT = 0, 2, 3
STATUS_FALLBACK_ACTIVE, STATUS_GUARD_TRIPPED = 2, 3
STATUS_SIZE = 64

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def segment_path(name: str) -> str:
    """``/dev/shm/<name>``, or ``name`` itself when it is already a path."""
    return name if os.sep in name else os.path.join("/dev/shm", name)


class Segment:
    """An open segment. ``Segment.create`` on the engine side, ``Segment.attach`` elsewhere."""

    def __init__(self, path: str, fd: int, layout: Layout, owner: bool):
        self.path, self.layout, self.owner = path, layout, owner
        self.inode = os.fstat(fd).st_ino
        self._fd = fd
        self._lock_fd = -1
        # reads and writes through the file: open as long as this object (readers on other
        # threads may use it after close(), and a closed number could be reused for another file)
        self._io_fd = os.dup(fd)
        weakref.finalize(self, os.close, self._io_fd)
        self._known = self._header_and_allocation()  # what intact() compares against
        self.buffer = mmap.mmap(fd, layout.total_size, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        # Views over the mapping, for tests and tools that own the file's timing: a truncation
        # under one is SIGBUS, so the engine's and the sidecar's paths use the methods below.
        words = np.frombuffer(self.buffer, dtype=np.uint8)
        self._control_seq = words[layout.control_offset:layout.control_offset + 4].view("<u4")
        self.control_words = words[layout.control_offset:layout.control_offset + layout.control_size].view("<u4")
        self.heartbeat = words[layout.lease_offset:layout.lease_offset + 8].view("<u8")
        self.sidecar_pid = words[layout.lease_offset + 8:layout.lease_offset + 12].view("<u4")
        status = words[layout.status_offset:layout.status_offset + 64]
        self.status_u64 = status.view("<u8")  # STATUS_STEPS, STATUS_GUARD_VIOLATIONS, STATUS_ENGINE_HEARTBEAT
        self.status_u32 = status.view("<u4")  # STATUS_FALLBACK_ACTIVE, STATUS_GUARD_TRIPPED

    @property
    def config(self) -> SegmentConfig:
        return self.layout.config

    # -- creation and attachment ---------------------------------------------------------

    @classmethod
    def create(cls, name: str, config: SegmentConfig, fallback: Policy | None = None,
               group: int | None = None) -> "Segment":
        """Create (or replace our own) segment: engine side only. Mode 0600, or 0660 with ``group``.

        The file's pages are allocated here (``posix_fallocate``), so a full tmpfs fails now,
        not with SIGBUS at the first step.

        Raises:
            SegmentError: the path is a symlink or a file of another user (named, with a way out),
                or the pages cannot be allocated.
        """
        path = segment_path(name)
        layout = Layout(config)
        fallback = fallback or default_policy(config.num_drafts)
        _refuse_foreign(path)
        temporary = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, layout.total_size)
            try:
                os.posix_fallocate(fd, 0, layout.total_size)
            except OSError as error:
                raise SegmentError(f"{path}: cannot allocate {layout.total_size} bytes "
                                   f"({error.strerror}); is {os.path.dirname(path)} full?") from None
            if group is not None:
                os.fchown(fd, -1, group)
                os.fchmod(fd, 0o660)
            segment = cls(path, fd, layout, owner=True)
            segment._initialise(fallback)
            # Publish complete: readers never see a half-initialised file under the real name.
            try:
                os.rename(temporary, path)
            except PermissionError:
                _refuse_foreign(path)
                raise
        except BaseException:
            os.close(fd)
            os.unlink(temporary)
            raise
        return segment

    def _initialise(self, fallback: Policy) -> None:
        layout, config = self.layout, self.config
        fallback_block = encode_policy(fallback, layout, 0, "engine")
        self.write_at(layout.fallback_offset, fallback_block)
        self.write_at(layout.control_offset, fallback_block)
        header = _HEADER.pack(
            MAGIC, ABI_VERSION, HEADER_SIZE, layout.total_size, config.stride, config.max_bs,
            config.num_moe_layers, config.num_rings, config.ring_slots, layout.record_size,
            config.max_buckets, layout.control_size, os.getpid(), config.lease_ms,
            time.time_ns(), config.expert_bytes, config.num_experts, config.top_k,
            config.expert_sample_period)
        self.write_at(0, header + _HEADER_TAIL.pack(config.dispatch_row_bytes))
        self._fallback = fallback
        self._known = self._header_and_allocation()

    # -- access through the file (the module docstring says why) --------------------------------

    def read_at(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset``, read through the file (never SIGBUS).

        Raises:
            SegmentTruncated: the file ends before ``offset + size``.
        """
        data = os.pread(self._io_fd, size, offset)
        if len(data) < size:
            raise SegmentTruncated(f"{self.path}: truncated under us: it ends before byte {offset + size}")
        return data

    def read_into(self, offset: int, buffer: np.ndarray) -> None:
        """Fill ``buffer`` (contiguous) from ``offset`` through the file, as :meth:`read_at`."""
        size = buffer.nbytes
        if os.preadv(self._io_fd, [memoryview(buffer).cast("B")], offset) < size:
            raise SegmentTruncated(f"{self.path}: truncated under us: it ends before byte {offset + size}")

    def write_at(self, offset: int, data) -> None:
        """Write ``data`` at ``offset`` through the file (never SIGBUS; past a truncated end it
        grows the file again, and the engine's next :meth:`intact` check restores it)."""
        os.pwrite(self._io_fd, data, offset)

    def intact(self) -> bool:
        """True while the file is still the one we created or attached: it spans the layout,
        none of its pages was freed (a truncation frees them, and a write through the file past
        the cut grows it back with holes, which only the allocation shows), and its header is
        the same (an engine that restored the file wrote a new creation time there, so the
        sidecar re-attaches and writes its policy again). Both sides check before each pass
        over it: one ``fstat`` and one 128-byte read."""
        try:
            info = os.fstat(self._io_fd)
            if info.st_size < self.layout.total_size or info.st_blocks < self._known[1]:
                return False
            return self.read_at(0, HEADER_SIZE) == self._known[0]
        except (OSError, SegmentError):
            return False

    def _header_and_allocation(self) -> tuple[bytes, int]:
        return self.read_at(0, HEADER_SIZE), os.fstat(self._io_fd).st_blocks

    def size(self) -> int:
        """The file's size now (to say what a truncation left)."""
        return os.fstat(self._io_fd).st_size

    def read_u32(self, offset: int) -> int:
        return _U32.unpack(self.read_at(offset, 4))[0]

    def read_u64(self, offset: int) -> int:
        return _U64.unpack(self.read_at(offset, 8))[0]

    def write_u64(self, offset: int, value: int) -> None:
        self.write_at(offset, _U64.pack(value & 0xFFFFFFFFFFFFFFFF))

    def read_status(self) -> np.ndarray:
        """A copy of the engine status block as bytes; ``.view("<u8")``/``.view("<u4")`` index
        it with ``STATUS_*`` as :attr:`status_u64`/:attr:`status_u32` do."""
        return np.frombuffer(self.read_at(self.layout.status_offset, STATUS_SIZE), dtype=np.uint8)

    def write_status(self, steps: int, engine_heartbeat: int, fallback_active: bool) -> None:
        """Engine side, each step: its step count, heartbeat and whether the fallback is in force."""
        offset = self.layout.status_offset
        self.write_u64(offset + 8 * STATUS_STEPS, steps)
        self.write_at(offset + 4 * STATUS_FALLBACK_ACTIVE, _U32.pack(1 if fallback_active else 0))
        self.write_u64(offset + 8 * STATUS_ENGINE_HEARTBEAT, engine_heartbeat)

    def lease_heartbeat(self) -> int | None:
        """The sidecar's lease counter (None once the file is truncated under us)."""
        try:
            return self.read_u64(self.layout.lease_offset)
        except SegmentTruncated:
            return None

    def renew_lease(self, sidecar_pid: int | None = None) -> None:
        """Sidecar side: bump the lease heartbeat (and state our pid, at attach)."""
        offset = self.layout.lease_offset
        if sidecar_pid is not None:
            self.write_at(offset + 8, _U32.pack(sidecar_pid))
        heartbeat = self.lease_heartbeat()
        if heartbeat is not None:  # else truncated: the engine restores it, the next attach renews it
            self.write_u64(offset, heartbeat + 1)

    def restore(self) -> None:
        """Engine side: give a truncated file back its size, pages, header (with a new creation
        time, which tells the sidecar to attach again) and fallback; the control block restarts
        from the fallback, and whatever the cut removed of status and rings reads as zero."""
        if not self.owner:
            raise SegmentError("only the engine that created the segment may restore it")
        os.ftruncate(self._io_fd, self.layout.total_size)
        os.posix_fallocate(self._io_fd, 0, self.layout.total_size)
        self._initialise(getattr(self, "_fallback", None) or default_policy(self.config.num_drafts))

    def lock_writer(self) -> None:
        """Claim the control block for this process (sidecar side): an advisory lock on the
        file, held until :meth:`close` or the process ends.

        Raises:
            SegmentError: another sidecar holds it; the message names its pid.
        """
        # its own open file: the mapping keeps a duplicate of self._fd, which would keep a
        # lock taken on self._fd past close()
        lock_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            try:
                holder = self.read_u32(self.layout.lease_offset + 8)
            except SegmentTruncated:
                holder = 0
            raise SegmentError(
                f"{self.path}: another sidecar (pid {holder or 'unknown'}) already writes this "
                "segment's policy; stop it first, or give this one another --segment") from None
        self._lock_fd = lock_fd

    def exposure(self) -> str | None:
        """A warning when the file is open to every local user (mode or owner changed since
        creation), else None."""
        info = os.fstat(self._fd)
        if info.st_mode & 0o007:
            return (f"{self.path} is mode {info.st_mode & 0o777:04o}: any local user can change the "
                    "policy or forge telemetry; the engine should create it 0600 (or 0660 with a group)")
        return None

    @classmethod
    def attach(cls, name: str, require_owner: bool = True) -> "Segment":
        """Open an existing segment and check it is one this code understands.

        Raises:
            FileNotFoundError: no such file (yet).
            SegmentError: the file is foreign, truncated, of another ABI, or owned by another user.
        """
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise SegmentError(f"{path}: is a symlink; refusing it (the engine creates a regular file)") from None
            raise
        try:
            info = os.fstat(fd)
            if require_owner and not _may_share(info):
                raise SegmentError(
                    f"{path}: owned by uid {info.st_uid}, not by this user ({os.geteuid()}), and not "
                    f"shared with a group of this user (mode {info.st_mode & 0o777:04o}, gid {info.st_gid}); "
                    "refusing it")
            if not stat.S_ISREG(info.st_mode):
                raise SegmentError(f"{path}: not a regular file")
            layout = read_layout(path, fd, info.st_size)
            return cls(path, fd, layout, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def replaced(self) -> bool:
        """True when the file at our path is gone or is another inode (the engine restarted)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def close(self) -> None:
        """Close the file; the mapping goes when the last view of it does (readers on other
        threads may still hold one, and must never see it unmapped under them)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def unlink(self) -> None:
        """Remove the file: the creator's job alone, and only if it is still ours."""
        if not self.owner:
            raise SegmentError("only the engine that created the segment may unlink it")
        if not self.replaced():
            os.unlink(self.path)

    # -- the control block -----------------------------------------------------------------

    def read_block(self, offset: int) -> bytes:
        return self.read_at(offset, self.layout.control_size)

    def write_policy(self, policy: Policy, generation: int, source: str, pause=None) -> bool:
        """Write ``policy`` under the seqlock (sidecar side); False, and nothing written, when
        the file was truncated under us. ``pause`` is a test hook."""
        body = encode_policy(policy, self.layout, generation, source)
        start = self.layout.control_offset
        try:
            seq = self.read_u32(start)
        except SegmentTruncated:
            return False
        if seq % 2:  # a writer died mid-write: carry on from its odd value
            seq -= 1
        # a u32 that wraps: readers only compare it before and after, and check its parity
        self.write_at(start, _U32.pack((seq + 1) & 0xFFFFFFFF))
        self.write_at(start + 4, body[4:])
        if pause is not None:
            pause()
        self.write_at(start, _U32.pack((seq + 2) & 0xFFFFFFFF))
        return True

    def read_policy(self) -> tuple[Policy, int, str] | None:
        """One consistent read of the control block, or None if a write was in flight."""
        body = self.read_seqlocked()
        return None if body is None else decode_policy(body, self.layout)

    def read_seqlocked(self) -> bytes | None:
        words = self.read_control_words()
        return None if words is None else words.tobytes()

    def read_control_words(self) -> np.ndarray | None:
        """One consistent copy of the control block as int32 words, or None if a write was in
        flight (or the file was truncated under us: the engine holds its last good block)."""
        # Two copies, one after the other: a write that overlapped either leaves them different
        # (its seq word at least), or both odd. Under x86-64's load order this is the seqlock's
        # "seq before, body, seq after", in two reads instead of three.
        start, size = self.layout.control_offset, self.layout.control_size
        try:
            first, second = self.read_at(start, size), self.read_at(start, size)
        except SegmentTruncated:
            return None
        words = np.frombuffer(second, dtype="<i4")
        return words if first == second and not words[0] & 1 else None

    def fallback_policy(self) -> tuple[Policy, int, str]:
        return decode_policy(self.read_block(self.layout.fallback_offset), self.layout)

    # -- header fields -------------------------------------------------------------------------

    @property
    def engine_pid(self) -> int:
        """The engine's pid from the header (0 once the file is truncated under us)."""
        try:
            return _HEADER.unpack(self.read_at(0, _HEADER.size))[12]
        except SegmentTruncated:
            return 0

    def ring_next_record(self, ring: int) -> int:
        return self.read_u64(self.layout.ring_offset(ring))


def _owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse_foreign(path: str) -> None:
    """Refuse to publish over a symlink or another user's file at ``path``: a local user who
    creates ``/dev/shm/<name>`` first must not stop or redirect the engine."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() else "root"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}"
    way_out = (f"remove it if it is stale, or choose a segment name of this user's (e.g. vcap-{user}-0) "
               f"or a path in a directory this user owns (e.g. {runtime}/vcap-0)")
    if stat.S_ISLNK(info.st_mode):
        raise SegmentError(f"{path}: already exists as a symlink owned by {_owner_name(info.st_uid)}; "
                           f"refusing to follow or replace it: {way_out}")
    if info.st_uid != os.geteuid():
        raise SegmentError(f"{path}: already exists, owned by {_owner_name(info.st_uid)}, not by this "
                           f"user ({_owner_name(os.geteuid())}): {way_out}")


def _may_share(info: os.stat_result) -> bool:
    """Our file, or one the engine shares with a group of ours (0660: group rw, no world)."""
    if info.st_uid == os.geteuid():
        return True
    groups = set(os.getgroups()) | {os.getegid()}
    mode = info.st_mode & 0o777
    return info.st_gid in groups and mode & 0o060 == 0o060 and not mode & 0o007
