"""Shared helper of the import-only torchvision stub (CPU research only)."""


class _Missing:
    """Placeholder for any torchvision name; fails only when used."""

    def __init__(self, *a, **k):
        raise NotImplementedError("torchvision stub: not functional")

    def __init_subclass__(cls, **k):
        pass


def make_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Missing,), {"__module__": modname})

    return __getattr__
