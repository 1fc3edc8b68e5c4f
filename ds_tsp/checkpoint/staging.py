"""Directories that appear whole: a checkpoint is written beside its target and swapped in once complete.

``staged(target)`` yields a fresh directory beside ``target``
(``.<name>.tmp-XXXX``) to write into. When the block ends without an error it
becomes ``target`` in one step: a rename where ``target`` does not exist, else
an atomic exchange of the two directories (Linux ``renameat2(RENAME_EXCHANGE)``;
where the file system refuses it, two renames, between which ``target`` is
briefly absent but never a mix). What ``target`` held besides the files the new
checkpoint replaces (a tokenizer, training arguments, a Trainer's
``checkpoint-N`` folders) is carried over first as hard links (copies where
links are refused), so nothing of it is moved or lost. The old directory is
removed after the swap.

A process killed before the swap leaves ``target`` as it was and a temporary
directory that no loader looks at (its name starts with a dot and is not
``target``); the next ``staged`` of the same target removes it.
"""

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import tempfile

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def leftovers(target):
    """Temporary directories a staged write of ``target`` left behind."""
    parent, name = os.path.split(os.path.abspath(target))
    return sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")))


@contextlib.contextmanager
def staged(target, replaced=lambda name: True):
    """Write ``target`` as a whole (see the module docstring). ``replaced(name)``
    says which entries of an existing ``target`` the new contents replace
    (default: all of them); the others are carried over."""
    target = os.path.abspath(os.fspath(target))
    for leftover in leftovers(target):
        shutil.rmtree(leftover, ignore_errors=True)
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        yield staging
        if not os.path.isdir(target):
            os.rename(staging, target)
            return
        for entry in os.listdir(target):
            if not replaced(entry) and not os.path.lexists(os.path.join(staging, entry)):
                _carry(os.path.join(target, entry), os.path.join(staging, entry))
        _exchange(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _carry(source, destination):
    """``source`` at ``destination`` too, by hard links (files, recursively)."""
    if os.path.isdir(source) and not os.path.islink(source):
        shutil.copytree(source, destination, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(source, destination)


def link_or_copy(source, destination):
    """``source`` at ``destination`` too: a hard link, or a copy where links are refused."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _exchange(staging, target):
    """Swap the two directories in one step where the system can; ``staging``
    then holds the old contents."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None and renameat2(_AT_FDCWD, os.fsencode(staging), _AT_FDCWD, os.fsencode(target),
                                           _RENAME_EXCHANGE) == 0:
        return
    if renameat2 is not None and ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), target)
    old = staging + ".old"
    os.rename(target, old)
    os.rename(staging, target)
    os.rename(old, staging)
