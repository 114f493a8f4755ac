"""Opening the files an operator names (history, policy file, token, recordings): only regular
files. A FIFO or device at such a path would block the sidecar in ``open`` or ``read`` (a FIFO
without a writer blocks a reader forever), so it is refused with a message instead.
"""

import errno
import os
import stat

__all__ = ["NotRegularFile", "open_regular", "read_regular", "check_writable"]


class NotRegularFile(OSError):
    """The path names a FIFO, socket, device or directory where a regular file must be."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, follow_symlinks: bool = True) -> int:
    """A blocking fd of the regular file ``path`` (``os.open`` flags and mode).

    Opened with ``O_NONBLOCK`` so that a FIFO cannot block the open, then checked.

    Raises:
        NotRegularFile: ``path`` is a FIFO, socket, device or directory.
        OSError: as ``os.open`` (a symlink with ``follow_symlinks=False``: ELOOP).
    """
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except OSError as error:
        if error.errno == errno.ENXIO:   # a FIFO opened for writing with no reader
            raise NotRegularFile(f"{path} is a FIFO, not a regular file") from None
        if error.errno == errno.ELOOP and not follow_symlinks:
            raise OSError(error.errno, f"{path} is a symbolic link; give the file's own path") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegularFile(f"{path} is {_kind(info.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str, limit: int = -1) -> bytes:
    """At most ``limit`` bytes (all with -1) of the regular file ``path``."""
    with os.fdopen(open_regular(path), "rb") as file:
        return file.read(limit)


def check_writable(path: str) -> None:
    """Fail now, not at the first write, when a file cannot be appended at ``path``: an existing
    one must be a regular file this process may write (not through a symlink), a new one needs
    a writable directory. Creates nothing.

    Raises:
        OSError: naming what is wrong.
    """
    if os.path.lexists(path):
        os.close(open_regular(path, os.O_WRONLY | os.O_APPEND, follow_symlinks=False))
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, f"{path}: its directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{path}: this process cannot create files in {directory}")
