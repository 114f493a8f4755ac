"""Maps the shared segment into CUDA: ``cudaHostRegister(Portable | Mapped)`` over the engine's
mmap, then torch views over the device-visible pointer, so kernels captured in CUDA graphs write
telemetry records and the engine status without a host sync.

Without CUDA (CI) the same views are CPU tensors over the mmap (``torch.frombuffer``).
"""

import atexit
import ctypes
import ctypes.util
import mmap
import os
import weakref

import numpy as np
import torch

from vcap.segment import Segment

__all__ = ["MappedSegment", "MappingError"]

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_TYPESTR = {torch.int32: "<i4", torch.int64: "<i8"}


class MappingError(RuntimeError):
    """cudaHostRegister or the device-pointer lookup failed; the message has the CUDA error."""


class _ArrayInterface:
    def __init__(self, pointer: int, count: int, dtype: torch.dtype):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": _TYPESTR[dtype],
                                         "data": (pointer, False), "version": 3, "strides": None}


def _load_cudart():
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    try:
        import nvidia.cuda_runtime  # noqa: F401  (pip wheel layout)
        base = os.path.join(os.path.dirname(nvidia.cuda_runtime.__file__), "lib")
        names = [os.path.join(base, n) for n in sorted(os.listdir(base)) if n.startswith("libcudart.so")] + names
    except (ImportError, OSError, TypeError):
        pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _device_pointer(host_pointer: int) -> tuple[int, str]:
    """The device address of registered host memory, and how it was found."""
    try:
        from cuda.bindings import runtime
        error, pointer = runtime.cudaHostGetDevicePointer(host_pointer, 0)
        if int(error) == 0:
            return int(pointer), "cuda.bindings cudaHostGetDevicePointer"
    except ImportError:
        pass
    cudart = _load_cudart()
    if cudart is not None:
        pointer = ctypes.c_void_p()
        error = cudart.cudaHostGetDevicePointer(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), 0)
        if error == 0:
            return int(pointer.value), "libcudart cudaHostGetDevicePointer"
    # Unified addressing: a mapped host allocation has the same address on the device.
    return host_pointer, "unified addressing (host pointer)"


class MappedSegment:
    """Device-visible views of one segment (engine side).

    >>> mapped = MappedSegment(segment, ring=0)          # doctest: +SKIP
    >>> mapped.ring_header.device                         # cuda:0, or cpu without CUDA
    """

    def __init__(self, segment: Segment, ring: int = 0, device: torch.device | str | None = None):
        layout = segment.layout
        if not 0 <= ring < layout.config.num_rings:
            raise ValueError(f"ring must be in 0..{layout.config.num_rings - 1}, got {ring}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.segment, self.layout, self.ring = segment, layout, ring
        self.device = torch.device(device)
        self._bytes = np.frombuffer(segment.buffer, dtype=np.uint8)
        self.host_pointer = int(self._bytes.ctypes.data)
        self.registered_size = 0
        self.pointer_source = "cpu mmap"
        if self.device.type == "cuda":
            self._register()
        self.status_u64 = self._view(layout.status_offset, 8, torch.int64)
        ring_offset = layout.ring_offset(ring)
        self.ring_header = self._view(ring_offset, 8, torch.int64)
        # Two typed views over the same slots: the seq words (int64) and the rest (int32).
        slots_offset, slots_bytes = ring_offset + 64, layout.config.ring_slots * layout.record_size
        self.ring_i32 = self._view(slots_offset, slots_bytes // 4, torch.int32)
        self.ring_i64 = self._view(slots_offset, slots_bytes // 8, torch.int64)
        atexit.register(_close_ref, weakref.ref(self))

    def _register(self) -> None:
        size = (self.layout.total_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        torch.cuda.init()
        error = torch.cuda.cudart().cudaHostRegister(
            self.host_pointer, size, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED)
        code = int(getattr(error, "value", error))
        if code != 0:
            raise MappingError(f"cudaHostRegister({self.segment.path}, {size} bytes) failed: {error}")
        self.registered_size = size
        self.device_pointer, self.pointer_source = _device_pointer(self.host_pointer)

    def _view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.frombuffer(self.segment.buffer, dtype=dtype, count=count, offset=offset)
        tensor = torch.as_tensor(_ArrayInterface(self.device_pointer + offset, count, dtype), device=self.device)
        if tensor.data_ptr() != self.device_pointer + offset:
            raise MappingError("torch copied the mapped view instead of wrapping it")
        return tensor

    def close(self) -> None:
        """Unregister the pages (after the GPU is done with them). Idempotent."""
        if self.registered_size:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.host_pointer)
            self.registered_size = 0


def _close_ref(ref) -> None:
    mapped = ref()
    if mapped is not None:
        try:
            mapped.close()
        except Exception:  # at interpreter exit CUDA may already be torn down
            pass
