"""The rank-0 rule under tensor parallelism without a collective: rank 0's live lengths reach every
rank of the node through inboxes mapped into rank 0's address space (CUDA IPC, the way SGLang's
and vLLM's custom all-reduce map their buffers).

Every rank other than 0 owns an inbox in its own memory: two epoch flags, then two slots of
``[max_bs]`` int32 live lengths (slot = epoch % 2). At build time each rank exports its inbox and
rank 0 opens them all. Each verify step (one launch on each side, eager or inside a graph, no
host sync):

- rank 0, once its hook has computed ``L``: :meth:`LiveShare.publish` stores ``L`` into slot
  ``epoch % 2`` of every peer's inbox, fences at system scope, then sets that slot's flag to
  ``epoch``;
- every other rank: :meth:`LiveShare.receive` waits until its own flag shows this step's epoch,
  then copies the slot into its ``live`` buffer.

The plugin issues its part eagerly, before the verify replay: :meth:`LiveShare.step` replays a
one-kernel CUDA graph captured at :meth:`LiveShare.bind` (Triton's own launch path costs the CPU
tens of microseconds a call; a graph launch a few).

Each rank acks the step it has read (a word of its own inbox, which rank 0 reads through the
mapping), and rank 0 writes a slot only once the peer has acked the step that slot held: it never
overwrites lengths a rank has not read, however far ahead it runs. Under TP it never waits there
(the verify's all-reduces keep rank 0 at most one step ahead), but nothing relies on that.

A rank that waits longer than ``max_spins`` polls (seconds: rank 0, or a peer, hung or died), or
finds a flag of another step, verifies every draft that step (rank 0: publishes anyway) and
counts it in ``errors`` (device memory; :meth:`LiveShare.error_count` reads it, with a sync, off
the step path). This is a last resort that keeps the engine from hanging on vcap, not a mode to
run in.

Ranks on several nodes cannot map each other's memory, and a container may forbid importing an
IPC handle: :func:`build` then returns None on every rank and the caller keeps the eager
broadcast. On the CPU (tests, under Triton's interpreter) inboxes are shared files in
``/dev/shm`` instead of IPC handles.
"""

import logging
import os
import socket
import uuid

import torch
import triton
import triton.language as tl

from ._triton import fence, use_asm

__all__ = ["LiveShare", "build", "INBOX_HEAD", "publish_reference", "receive_reference"]

INBOX_HEAD = 16          # int32 words before the slots: flag of slot 0, flag of slot 1, the ack, padding
ACK = 2                  # the last epoch this rank has read (it writes it; rank 0 reads it over the mapping)
DEFAULT_MAX_SPINS = 1 << 24
log = logging.getLogger("vcap.engine_hook")
_HEAD, _ACK = tl.constexpr(INBOX_HEAD), tl.constexpr(ACK)


@triton.jit
def _publish_kernel(live_ptr, epoch_ptr, peers_ptr, errors_ptr, num_peers, max_bs, max_spins,
                    BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    epoch = tl.load(epoch_ptr) + 1
    slot = epoch % 2
    lanes = tl.arange(0, BLOCK)
    late = 0
    for p in range(num_peers):
        inbox = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int32))
        # the slot still holds step epoch - 2 until this peer has read it
        ack = tl.atomic_add(inbox + _ACK, 0, sem="acquire", scope="sys")
        spins = 0
        while ((ack - (epoch - 2)) < 0) & (spins < max_spins):
            ack = tl.atomic_add(inbox + _ACK, 0, sem="acquire", scope="sys")
            spins += 1
        late += ((ack - (epoch - 2)) < 0).to(tl.int32)
        tl.debug_barrier()
        for start in range(0, max_bs, BLOCK):
            offsets = start + lanes
            mask = offsets < max_bs
            tl.store(inbox + _HEAD + slot * max_bs + offsets, tl.load(live_ptr + offsets, mask=mask), mask=mask)
    # every thread's stores, then one system-scope release of the flags
    tl.debug_barrier()
    epoch = fence(epoch, USE_ASM)
    for p in range(num_peers):
        inbox = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(inbox + slot, epoch, sem="release", scope="sys")
    tl.store(epoch_ptr, epoch)
    tl.store(errors_ptr, tl.load(errors_ptr) + late)


@triton.jit
def _receive_kernel(inbox_ptr, live_ptr, epoch_ptr, errors_ptr, max_bs, stride, max_spins,
                    BLOCK: tl.constexpr):
    epoch = tl.load(epoch_ptr) + 1
    slot = epoch % 2
    flag = tl.atomic_add(inbox_ptr + slot, 0, sem="acquire", scope="sys")
    spins = 0
    while ((flag - epoch) < 0) & (spins < max_spins):
        flag = tl.atomic_add(inbox_ptr + slot, 0, sem="acquire", scope="sys")
        spins += 1
    tl.debug_barrier()
    ok = flag == epoch
    lanes = tl.arange(0, BLOCK)
    for start in range(0, max_bs, BLOCK):
        offsets = start + lanes
        mask = offsets < max_bs
        received = tl.load(inbox_ptr + _HEAD + slot * max_bs + offsets, mask=mask, volatile=True)
        tl.store(live_ptr + offsets, tl.where(ok, received, stride), mask=mask)
    # the slot is read: rank 0 may reuse it (every thread's loads first)
    tl.debug_barrier()
    tl.atomic_xchg(inbox_ptr + _ACK, epoch, sem="release", scope="sys")
    tl.store(epoch_ptr, epoch)
    tl.store(errors_ptr, tl.load(errors_ptr) + 1 - ok.to(tl.int32))


def publish_reference(live: torch.Tensor, epoch: torch.Tensor, inboxes: list[torch.Tensor],
                      errors: torch.Tensor) -> None:
    """:meth:`LiveShare.publish` in plain torch, for acks that are already in (no wait)."""
    max_bs = live.numel()
    value = int(epoch.item()) + 1
    slot = value % 2
    for inbox in inboxes:
        errors += int(int(inbox[ACK].item()) < value - 2)
        inbox[INBOX_HEAD + slot * max_bs:INBOX_HEAD + (slot + 1) * max_bs] = live
        inbox[slot] = value
    epoch.fill_(value)


def receive_reference(inbox: torch.Tensor, live: torch.Tensor, epoch: torch.Tensor, errors: torch.Tensor,
                      stride: int) -> None:
    """:meth:`LiveShare.receive` in plain torch, for a flag that is already set (no wait)."""
    max_bs = live.numel()
    value = int(epoch.item()) + 1
    slot = value % 2
    if int(inbox[slot].item()) == value:
        live.copy_(inbox[INBOX_HEAD + slot * max_bs:INBOX_HEAD + (slot + 1) * max_bs])
    else:
        live.fill_(stride)
        errors += 1
    inbox[ACK] = value
    epoch.fill_(value)


def _block(max_bs: int) -> int:
    return min(triton.next_power_of_2(max_bs), 1024)


class LiveShare:
    """One rank's end of the share: rank 0 publishes, every other rank receives."""

    def __init__(self, rank: int, inbox: torch.Tensor, peers: list[torch.Tensor], max_bs: int, stride: int,
                 max_spins: int = DEFAULT_MAX_SPINS):
        self.rank, self.max_bs, self.stride, self.max_spins = rank, max_bs, stride, max_spins
        self.device = inbox.device
        self.inbox = inbox                     # this rank's (unused on rank 0)
        self.peers = peers                     # rank 0: every other rank's inbox, mapped here
        self.peer_pointers = torch.tensor([peer.data_ptr() for peer in peers] or [0], dtype=torch.int64,
                                          device=self.device)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.errors = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.live = None
        self._graph = None

    def publish(self, live: torch.Tensor) -> None:
        """Rank 0: ``live`` (int32 ``[max_bs]``) to every peer (one launch)."""
        self._launch(live)

    def receive(self, live: torch.Tensor) -> None:
        """Every other rank: rank 0's live lengths of this step into ``live`` (one launch)."""
        self._launch(live)

    def _launch(self, live: torch.Tensor) -> None:
        """This rank's kernel (rank 0's publish, or a receive) on ``live``."""
        self._check(live)
        kernel, args, options = self._launch_args(live)
        kernel[(1,)](*args, **options)

    def _launch_args(self, live: torch.Tensor):
        options = dict(BLOCK=_block(self.max_bs), num_warps=4)
        if self.rank == 0:
            return (_publish_kernel, (live, self.epoch, self.peer_pointers, self.errors, len(self.peers), self.max_bs,
                                      self.max_spins), dict(options, USE_ASM=use_asm(self.device)))
        return (_receive_kernel, (self.inbox, live, self.epoch, self.errors, self.max_bs, self.stride, self.max_spins),
                options)

    def bind(self, live: torch.Tensor) -> "LiveShare":
        """The buffer :meth:`step` sends (rank 0) or fills; on a GPU, the step's graph is captured
        now (compiled without running: a launch would publish)."""
        self._check(live)
        self.live = live
        if self.device.type == "cuda":
            kernel, args, options = self._launch_args(live)
            kernel.warmup(*args, grid=(1,), **options)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                kernel[(1,)](*args, **options)
        return self

    def step(self) -> None:
        """This rank's part of the step on the bound buffer (a graph replay on a GPU; a plain
        launch while an outer graph is being captured, or on the CPU)."""
        if self._graph is not None and not torch.cuda.is_current_stream_capturing():
            self._graph.replay()
        else:
            self._launch(self.live)

    def error_count(self) -> int:
        """Steps this rank could not take rank 0's lengths, or (rank 0) peers it did not hear from
        before reusing their slot (syncs: diagnostics only)."""
        return int(self.errors.item())

    def _check(self, live: torch.Tensor) -> None:
        if live.dtype != torch.int32 or live.numel() != self.max_bs or not live.is_contiguous() \
                or live.device != self.device:
            raise ValueError(f"live must be contiguous int32 [{self.max_bs}] on {self.device}")


def _host_id() -> str:
    """This machine, as ranks compare it (a container's hostname is its own; the boot id is the kernel's)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return f"{socket.gethostname()}/{file.read().strip()}"
    except OSError:
        return socket.gethostname()


def _ipc_zeros(size: int, device: torch.device) -> torch.Tensor:
    """The inbox, kept out of expandable segments when those are on (an exported expandable
    segment needs pidfd_getfd to import, which containers without ptrace rights deny)."""
    settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if settings is None or setter is None or "expandable_segments:True" not in settings():
        return torch.zeros(size, dtype=torch.int32, device=device)
    setter("expandable_segments:False")
    try:
        return torch.zeros(size, dtype=torch.int32, device=device)
    finally:
        setter("expandable_segments:True")


def _export(inbox: torch.Tensor, path: str | None):
    if inbox.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor
        return reduce_tensor(inbox)  # (rebuild function, arguments): an IPC handle, picklable
    return path


def _open(handle, size: int) -> torch.Tensor:
    if isinstance(handle, str):
        return torch.from_file(handle, shared=True, size=size, dtype=torch.int32)
    rebuild, arguments = handle
    return rebuild(*arguments)


def build(rank: int, world_size: int, max_bs: int, stride: int, device, all_gather_object,
          max_spins: int = DEFAULT_MAX_SPINS) -> LiveShare | None:
    """Every rank of the group calls it at the same point (two rounds of ``all_gather_object``,
    e.g. SGLang's ``GroupCoordinator.all_gather_object``). None on every rank when the ranks are
    on several machines, or any rank could not export or map an inbox (the reason is logged):
    the caller keeps the broadcast then."""
    device = torch.device(device)
    size = INBOX_HEAD + 2 * max_bs
    path, handle, problem = None, None, None
    try:
        if device.type == "cuda":
            inbox = _ipc_zeros(size, device)
        else:
            path = f"/dev/shm/vcap-inbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            inbox = torch.from_file(path, shared=True, size=size, dtype=torch.int32)
            inbox.zero_()
        handle = _export(inbox, path) if rank else None
    except Exception as error:  # noqa: BLE001 - any failure means: keep the broadcast
        problem = f"rank {rank} could not export its inbox: {error}"
    everyone = all_gather_object((_host_id(), handle, problem))
    if len(everyone) != world_size:
        raise RuntimeError(f"vcap: all_gather_object returned {len(everyone)} entries for {world_size} ranks")
    problems = [problem for _, _, problem in everyone if problem]
    if len({host for host, _, _ in everyone}) > 1:
        problems.append("the ranks are on several machines")
    peers, problem = [], None
    if rank == 0 and not problems:
        try:
            peers = [_open(peer_handle, size) for _, peer_handle, _ in everyone[1:]]
        except Exception as error:  # noqa: BLE001
            problem = f"rank 0 could not map the other ranks' inboxes: {error}"
    # second round: every rank learns whether rank 0 mapped them (and the CPU files can go)
    problems += [problem for problem in all_gather_object(problem) if problem]
    _remove(path)
    if problems:
        if rank == 0:
            log.warning("vcap: no mapped inboxes for the rank-0 rule (%s)", "; ".join(problems))
        return None
    return LiveShare(rank, inbox, peers, max_bs, stride, max_spins)


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
