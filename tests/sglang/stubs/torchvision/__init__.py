"""Import-only torchvision stub. SGLang 0.5.23 imports torchvision at module level
in sglang/srt/multimodal/internvl_utils.py (and transformers then sees a
'torchvision' spec and imports torchvision.io / transforms.v2.functional).
Nothing here works; it only lets the import graph resolve on a CPU-only box."""
from torchvision._stub import make_getattr

__version__ = "0.0.0+stub"
__getattr__ = make_getattr(__name__)
