"""Test-only: the libdevice functions the routers use, for Triton's interpreter (CPU).

Triton 3.4's interpreter does not implement ``triton.language.extra.libdevice`` (a call returns
None). Under ``TRITON_INTERPRET=1`` this installs float32 numpy versions of the three that
vcap's router and SGLang's gate call (``exp``, ``log1p``, ``sqrt``), so both kernels run on the
CPU with the same math: the CPU tests compare their logic (selection, NaN order, padding); the
bitwise numerics of libdevice are checked on the GPU (tests/sglang/test_gpu_sglang.py).
"""

import os

import numpy as np

__all__ = ["install"]


def _unary(np_fn):
    def fn(arg, _semantic=None, _builder=None):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle
        data = arg.handle.data
        with np.errstate(all="ignore"):
            result = np_fn(data.astype(np.float32)).astype(data.dtype)
        return tl.core.tensor(TensorHandle(result, arg.handle.dtype), arg.type)
    return fn


def install() -> bool:
    """Installs the numpy versions when the interpreter is on; True if it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.language.extra import libdevice
    for name, np_fn in (("exp", np.exp), ("log1p", np.log1p), ("sqrt", np.sqrt)):
        setattr(libdevice, name, _unary(np_fn))
    return True
