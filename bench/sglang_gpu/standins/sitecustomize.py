"""GPU machine only (on PYTHONPATH through bench/sglang_gpu/run.sh): stand-ins for the compiled
packages SGLang imports at module level there (``sgl_kernel``, ``deep_gemm``), whose wheels are
not on that machine. Every attribute is a placeholder that raises when called, so an import
passes and nothing of theirs can run unnoticed."""

import importlib.abc
import importlib.machinery
import sys
import types

_PREFIXES = ("sgl_kernel", "deep_gemm")


class _Placeholder:
    def __init__(self, name="placeholder", *args, **kwargs):
        self._name = name if isinstance(name, str) else "placeholder"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"stand-in {self._name} called: the GPU tests must not reach sgl_kernel/deep_gemm")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _PREFIXES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
