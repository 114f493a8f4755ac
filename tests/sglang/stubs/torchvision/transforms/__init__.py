from torchvision._stub import make_getattr
from torchvision.transforms.functional import InterpolationMode  # noqa: F401

__getattr__ = make_getattr(__name__)
