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

from tests.engine_hook.libdevice_shim import install as _install_libdevice_shim  # noqa: E402

_install_libdevice_shim()


@pytest.fixture(scope="session")
def patched():
    """vcap's plugin, registered as SGLang's load_plugins() would (once per test process)."""
    from vcap.engine_hook import sglang_plugin
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv(sglang_plugin.ENV_SEGMENT, "vcap-tests")
    sglang_plugin.register()
    yield
    monkeypatch.undo()
