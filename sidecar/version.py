"""The installed vcap's version, for ``--version``."""

from importlib import metadata

__all__ = ["version_text"]


def version_text() -> str:
    try:
        return metadata.version("vcap")
    except metadata.PackageNotFoundError:   # run from a checkout that was never installed
        return "unknown (not installed)"
