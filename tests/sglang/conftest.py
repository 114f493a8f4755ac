"""SGLang 0.5.23's real source, installed with --no-deps (see requirements.txt).

Its multimodal utilities import torchvision at module level; ``stubs/torchvision`` (test-only,
import-only placeholders that raise if used) lets those modules import without the real
package, whose wheels would pull a CUDA build of torch.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "stubs"))
pytest.importorskip("sglang.srt.plugins.hook_registry",
                    reason="SGLang 0.5.23 is not installed (pip install --no-deps sglang==0.5.23 "
                           "and tests/sglang/requirements.txt)")
