import glob
import os
import random
import shutil
import uuid

import numpy as np
import pytest

# Without CUDA the Triton kernels run under the interpreter, which must be chosen before triton
# is first imported (torch or SGLang may import it), so look for the driver's device nodes.
if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)


@pytest.fixture
def segment_name():
    """A unique /dev/shm name, removed after the test whoever left it behind."""
    name = f"vcap-test-{uuid.uuid4().hex[:10]}"
    yield name
    # the segment, its DP ranks' (-dp<r>), the sidecar's policy history and control mode beside it
    for path in glob.glob(f"/dev/shm/{name}*"):
        if os.path.isfile(path):
            os.unlink(path)


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    has_prometheus = shutil.which("prometheus") and shutil.which("promtool")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "prometheus" in item.keywords and not has_prometheus:
            item.add_marker(pytest.mark.skip(reason="needs prometheus and promtool on PATH"))
