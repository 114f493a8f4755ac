"""Stand-ins for the compiled modules SGLang 0.5.23 imports at module level but vcap's benchmarks
and GPU tests never run (``sgl_kernel``, ``deep_gemm``, whose wheels the GPU machine lacks): every
attribute is a placeholder that raises when called, so an import passes and nothing of them can
run unnoticed. Install before importing sglang: ``import sgl_standin; sgl_standin.install()``
(``bench/sglang_gpu/standins/sitecustomize.py`` does it for the GPU tests)."""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Placeholder:
    def __init__(self, name="placeholder", *args, **kwargs):
        self._name = name if isinstance(name, str) else "placeholder"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"stand-in {self._name} called: vcap's benchmarks and GPU tests must not "
                           "reach sgl_kernel/deep_gemm")

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
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


def install():
    roots = {root for root in ("sgl_kernel", "deep_gemm")
             if importlib.util.find_spec(root) is None}
    sys.meta_path.insert(0, _Finder(roots))
    return sorted(roots)
