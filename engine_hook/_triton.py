"""Jit helpers shared by the hook's kernels, and the one switch for Triton's interpreter.

Inline PTX (the system-scope fence, ``%globaltimer``) runs only on a real GPU; under the
interpreter (``TRITON_INTERPRET=1``, CPU CI) the fence is skipped and the clock is read from a
device buffer the caller fills.
"""

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRET", "use_asm", "word", "put", "fence", "now_ns", "popcount"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_asm(device: torch.device) -> bool:
    """True where the kernels may use inline PTX: a CUDA device, not under the interpreter."""
    return torch.device(device).type == "cuda" and not INTERPRET


@triton.jit
def word(vector, lanes, index):
    """Element ``index`` of a register vector (exact: one value summed with zeros)."""
    return tl.sum(tl.where(lanes == index, vector, 0), 0)


@triton.jit
def put(vector, lanes, index, value):
    """``vector`` with element ``index`` set to ``value``."""
    return tl.where(lanes == index, value, vector)


@triton.jit
def fence(x, USE_ASM: tl.constexpr):
    """System-scope acquire/release fence, threaded through ``x`` so it stays in program order."""
    if USE_ASM:
        x = tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return x


@triton.jit
def now_ns(clock_ptr, USE_TIMER: tl.constexpr):
    """The GPU's ``%globaltimer`` in ns, or the value at ``clock_ptr`` (tests, the interpreter)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.load(clock_ptr)
    return t


@triton.jit
def popcount(x):
    """Set bits of each int32 element."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)
