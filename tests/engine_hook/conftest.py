import os

import pytest

# Without CUDA the kernels run under Triton's interpreter, which must be chosen before triton is
# imported (torch may import it), so look for the driver's device nodes rather than ask torch.
if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
