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

A save that several ranks join (``SharedSave``, ``staged_together``) fails on
every rank or on none. A rank holds the error of a failed write (no space,
permission, quota: any error of the file system or of the writing library)
instead of raising it, writes nothing more and goes on joining the save's
collectives; before anything is swapped in, one small collective
(``comm.count_true``) tells every rank whether a write failed anywhere, and
if one did every rank raises the same ``SaveError``, naming the rank, the
file and the cause, and nothing is swapped in. The swap is agreed on the same
way, so no rank ever waits in a collective that a failed rank never joins.
"""

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import tempfile

from ds_tsp.parallel import comm

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
    staging = begin(target)
    try:
        yield staging
        commit(staging, target, replaced)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def begin(target, name=None):
    """A fresh directory beside ``target`` to write it in (``name``: that
    name, else a random one of the same pattern), once the leftovers of earlier
    writes of ``target`` are removed."""
    for leftover in leftovers(target):
        shutil.rmtree(leftover, ignore_errors=True)
    parent, base = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    if name is None:
        return tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    staging = os.path.join(parent, f".{base}.tmp-{name}")
    os.makedirs(staging)
    return staging


def commit(staging, target, replaced=lambda name: True):
    """``staging`` becomes ``target``; an existing ``target``'s entries that
    ``replaced`` spares are carried over first, and its old contents end up in
    ``staging``."""
    if not os.path.isdir(target):
        os.rename(staging, target)
        return
    for entry in os.listdir(target):
        if not replaced(entry) and not os.path.lexists(os.path.join(staging, entry)):
            _carry(os.path.join(target, entry), os.path.join(staging, entry))
    _exchange(staging, target)


class SaveError(OSError):
    """A save that failed on some rank, raised on every rank that joined it.
    The message names the rank, the file and the cause; ``errno`` is the
    cause's where it carried one."""


class SharedSave:
    """One save that every rank of ``group`` (None: the world) joins; ``what``
    names it in the error (see the module docstring)."""

    def __init__(self, what, group=None):
        self.what, self.group = what, group
        self.failure = None  # (report, errno, agreed, exception) of this rank's first failed write

    @property
    def failed(self):
        return self.failure is not None

    def write(self, path, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, this rank's write of ``path``; returns its
        result, or None where it failed (the error is held for ``agree``) or
        was skipped after an earlier failure."""
        if self.failure is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # any write error: it is raised on every rank by agree()
            if isinstance(error, SaveError):
                # An inner save's failure, already agreed on: its message is the report.
                self.failure = (str(error), error.errno, True, error)
                return None
            cause = next((e for e in _chain(error) if isinstance(e, OSError) and e.errno), None)
            report = f"{path}: {type(error).__name__}: {error}"
            if cause is not None and cause.strerror and cause.strerror not in report:
                report += f" ({cause.strerror})"
            self.failure = (report + _free_space(path), cause.errno if cause is not None else None, False, error)
            return None

    def agree(self, outcome=""):
        """Collective over the group: return where every rank's writes
        succeeded, else raise the same ``SaveError`` on every rank
        (``outcome``, a string or a function giving one, ends its message:
        what was kept)."""
        if not comm.count_true(self.failed, self.group):
            return
        reports = comm.all_gather_objects(self.failure[:3] if self.failed else None, self.group)
        ranks = [rank if self.group is None else comm.global_rank(self.group, rank) for rank in range(len(reports))]
        failed = [(rank, report) for rank, report in zip(ranks, reports) if report]
        (rank, (report, errno_, agreed)), others = failed[0], [rank for rank, _ in failed[1:]]
        if agreed:
            message = report
        else:
            message = f"{self.what} failed: rank {rank} could not write {report}"
            if others:
                message += f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too"
        outcome = outcome() if callable(outcome) else outcome
        error = SaveError(message + (f". {outcome}" if outcome else ""))
        error.errno = errno_
        raise error from (self.failure[3] if self.failed else None)


@contextlib.contextmanager
def staged_together(target, save, writing, replaced=lambda name: True):
    """``staged`` for a ``SharedSave`` that every rank of its group enters:
    yields the directory to write in on the ``writing`` rank (None elsewhere,
    or where it could not be made: that error is held like a write's). When
    the block ends every rank agrees, the writing rank swaps the directory in
    and every rank agrees again: every rank returns, or every rank raises the
    same ``SaveError``, with ``target`` as it was when a write failed. An
    error the block raises itself (a refusal) passes through unagreed."""
    target = os.path.abspath(os.fspath(target))
    staging = save.write(target, begin, target) if writing else None
    try:
        yield staging
        save.agree(f"{target} is as it was before the save")
        if staging is not None:
            save.write(target, commit, staging, target, replaced)
        save.agree()
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _chain(error):
    """``error`` and the errors it was raised from or during."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _free_space(path):
    """"; the file system at MOUNT has F of T bytes free" (or "is full") for
    ``path``'s file system, which torch.save's error on a full disk does not
    say; "" where it cannot be read."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    mount = existing
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        usage = shutil.disk_usage(existing)
    except OSError:
        return ""
    if usage.free == 0:
        return f"; the file system at {mount} is full (0 of {usage.total:,} bytes free)"
    return f"; the file system at {mount} has {usage.free:,} of {usage.total:,} bytes free"


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
