"""Belayer's stand-in for `torchvision` (see sglang_standins/README.md and _standin.py)."""

from torchvision._standin import InterpolationMode, install, module_getattr  # noqa: F401

__version__ = "0.0.0+belayer.standin"  # never a real release: version checks see a stand-in

install()
__getattr__ = module_getattr(__name__)
