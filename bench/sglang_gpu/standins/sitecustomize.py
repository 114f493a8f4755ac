"""GPU machine only (on PYTHONPATH through bench/sglang_gpu/run.sh): installs bench/sgl_standin.py's
stand-ins for ``sgl_kernel`` and ``deep_gemm`` before anything imports SGLang."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import sgl_standin  # noqa: E402

sgl_standin.install()
