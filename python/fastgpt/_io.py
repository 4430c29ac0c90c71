"""Atomic file writes: a file appears under its final name complete or not at all, and whatever was there before
survives a failure. Shards and checkpoints both go through here.

Modes come from the kernel, not from reading the umask: os.umask can only be read by setting it, and while it is
set to anything else, files other threads create get that mask instead of theirs."""
import contextlib
import os
import secrets
import stat
import sys

# The temp file's name holds the final name, so a leftover one says whose it was; a long final name is shortened
# in it (50 characters are at most 200 bytes), as the whole must stay within NAME_MAX (255 bytes) where the final
# name itself may take all of it.
_LONG_NAME = 200


def _temp_name(folder, name, suffix):
    stem = name if len(os.fsencode(name)) <= _LONG_NAME else name[:50]
    return os.path.join(folder, f".{stem}.{secrets.token_hex(4)}{suffix}")


@contextlib.contextmanager
def atomic_path(path):
    """Yields a temp path in the destination folder; on a clean exit the file is fsynced and renamed over `path`
    (one filesystem, so the rename is atomic); on an exception it is removed and the old `path` is untouched.
    A symlink at `path` stays: its target is what is replaced. The file gets the mode of the one it replaces, else
    the mode a plain open() would give it."""
    path = os.path.realpath(os.fspath(path))  # a rename over the link itself would leave its target as it was
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    while True:
        tmp = _temp_name(folder, name, ".tmp")
        try:
            # 0666 less the umask, applied by the kernel: the mode a plain open() gives a new file here
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            break
        except FileExistsError:  # another writer's temp file, by a 1 in 2**32 chance
            continue
    try:
        os.close(fd)
        mode = stat.S_IMODE(os.stat(tmp).st_mode)
        with contextlib.suppress(FileNotFoundError):
            mode = stat.S_IMODE(os.stat(path).st_mode) & 0o777  # what the user had set on the file it replaces
        yield tmp
        with open(tmp, "rb+") as f:  # the bytes must be on disk before the rename makes them the real file
            os.fsync(f.fileno())
        # The writer may have made the file anew (safetensors does, 0600): the mode is set on what it wrote, after
        # the fsync, which a read-only mode (a 0444 file replaced) would not let open it for.
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(folder)  # make the rename durable


def make_temp_folder(parent, prefix, suffix):
    """A new folder parent/prefixXXXXXXXXsuffix with the mode a plain mkdir() gives (tempfile.mkdtemp's is 0700,
    and setting another afterwards needs the umask)."""
    while True:
        folder = os.path.join(parent, f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            os.mkdir(folder, 0o777)  # less the umask, by the kernel
            return folder
        except FileExistsError:
            continue


def fsync_path(path):
    """fsync a file or a folder by name (a folder's entries: what a rename changed); a platform that cannot open or
    sync a folder is let be."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def stdout_to_devnull():
    """After a BrokenPipeError on stdout (the reader of `| head` left): what is printed from now on, and Python's own
    flush at exit, go to /dev/null instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def atomic_write_bytes(path, chunks):
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
