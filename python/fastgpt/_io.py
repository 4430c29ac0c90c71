"""Atomic file writes: a file appears under its final name complete or not at all, and whatever was there before
survives a failure. Shards and checkpoints both go through here."""
import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path):
    """Yields a temp path in the destination folder; on a clean exit the file is fsynced and renamed over `path`
    (one filesystem, so the rename is atomic); on an exception it is removed and the old `path` is untouched."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        public_mode(tmp)  # mkstemp's (and safetensors') 0600 suits a temp file; the result gets a plain file's mode
        with open(tmp, "rb+") as f:  # the bytes must be on disk before the rename makes them the real file
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(folder)  # make the rename durable


def fsync_path(path):
    """fsync a file or a folder by name (a folder's entries: what a rename changed); a platform that cannot open or
    sync a folder is let be."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def public_mode(path, folder=False):
    """Gives what mkstemp/mkdtemp made (0600/0700) the mode a plain open/mkdir would have."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


def atomic_write_bytes(path, chunks):
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
