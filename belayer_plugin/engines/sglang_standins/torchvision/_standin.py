"""Belayer's torchvision stand-in (see ../README.md): import-time names only, no behaviour.

SGLang's config and multimodal modules, and transformers' image utilities (which consider torchvision
available as soon as the name can be found), import `torchvision`, `torchvision.io`,
`torchvision.transforms[.v2][.functional]` and names in them at start-up; a text model never calls them.
Rather than mirror each path, any `torchvision.<sub>` module is created on import, and any name in it is a
placeholder that fails loudly when used.
"""

import enum
import importlib.abc
import importlib.machinery
import sys


class InterpolationMode(enum.Enum):
    # A real enum: modules use its members in dicts and default arguments at import time.
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    """A name imported from torchvision: can be imported and referenced; fails when called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Unavailable":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: torchvision is a Belayer import stand-in here (SGLang on CPU serves text "
            "models only); install a real torchvision to serve image or video models"
        )

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


def module_getattr(module_name: str):
    """A module-level __getattr__ handing out InterpolationMode and `_Unavailable` placeholders."""

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "InterpolationMode":
            return InterpolationMode
        return _Unavailable(f"{module_name}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates every `torchvision.<sub>` module on import, as a package so deeper imports work too."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.__path__ = []
        module.__getattr__ = module_getattr(module.__name__)


def install() -> None:
    """Registers the submodule finder once (after the regular finders: real files would win)."""
    if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleFinder())
