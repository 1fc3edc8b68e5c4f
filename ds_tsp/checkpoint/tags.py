"""DeepSpeed checkpoint tags that appear whole, on every rank or on none.

``engine.save_checkpoint(save_dir, tag)`` on a TSP engine (``save_tag``, which
``resharding.attach_layout_checks`` puts in its place) has DeepSpeed write the
tag into ``save_dir/.<tag>.tmp-save``. Every write of DeepSpeed's checkpoint
engine (and its copy of the recovery scripts) goes through a
``staging.SharedSave``, which holds a failed write's error instead of raising
it, so the rank still reaches DeepSpeed's barriers rather than leaving its
peers in them. Then every rank agrees: on success the temporary directory
becomes ``save_dir/<tag>`` (exchanged with an older tag of that name, which is
then removed) and global rank 0 writes ``latest``; on failure it is removed,
``latest`` and any older tag of that name are left as they were, and every
rank raises the same ``SaveError`` naming the file, the cause and the free
space (torch's own error on a full disk, "unexpected pos 7744 vs 7638", names
neither).

Checkpoint engines that finish their writes after ``save_checkpoint`` returns
(``is_decoupled()``: DeepSpeed's decoupled and DataStates engines) get
DeepSpeed's save unchanged: nothing is written yet to agree on.
"""

import contextlib
import inspect
import os
import shutil

from ds_tsp.checkpoint.staging import SharedSave, begin, commit
from ds_tsp.parallel import comm

_STAGING_NAME = "save"


def save_tag(engine, save, save_dir, tag, args, kwargs, also=None):
    """``save(save_dir, tag, *args, **kwargs)`` (DeepSpeed's own
    ``engine.save_checkpoint``) written whole (see the module docstring);
    ``also(folder)`` writes more into the tag from global rank 0 (ds_tsp's
    layout file). Collective: every rank calls it."""
    bound = inspect.signature(save).bind(save_dir, tag, *args, **kwargs)
    bound.apply_defaults()
    tag = str(bound.arguments["tag"] if bound.arguments["tag"] is not None else f"global_step{engine.global_steps}")
    if engine.checkpoint_engine.is_decoupled():
        saved = save(*bound.args, **bound.kwargs)
        if also is not None and engine.global_rank == 0:
            also(os.path.join(save_dir, tag))
        comm.barrier(None)
        return saved

    target = os.path.abspath(os.path.join(save_dir, tag))
    # DeepSpeed's own choice of the rank that makes a tag's folders.
    writer = (engine.local_rank if engine.use_node_local_storage() else engine.global_rank) == 0
    shared = SharedSave(f"engine.save_checkpoint to {target}")
    # Every rank names the temporary tag alike; its leftover from a killed save goes before DeepSpeed's first
    # barrier, which the other ranks wait at before writing.
    staging = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{_STAGING_NAME}")
    if writer:
        shared.write(target, begin, target, _STAGING_NAME)
    save_latest = bound.arguments["save_latest"]
    bound.arguments.update(tag=os.path.relpath(staging, save_dir), save_latest=False)
    try:
        with _writes_held(engine, shared):
            saved = save(*bound.args, **bound.kwargs)
        if also is not None and engine.global_rank == 0:
            shared.write(staging, also, staging)
        shared.agree(lambda: f"The partial tag was removed; {_latest(save_dir)}")
        if writer:
            shared.write(target, commit, staging, target)
        if save_latest and engine.global_rank == 0:
            shared.write(os.path.join(save_dir, "latest"), _write_latest, save_dir, tag)
        shared.agree()
    finally:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
    return saved


@contextlib.contextmanager
def _writes_held(engine, shared):
    """While the body runs, the engine's checkpoint writes go through
    ``shared.write``. DeepSpeed has no hook for a failed write; its checkpoint
    engine's ``save`` and ``makedirs`` and its copy of the recovery scripts are
    every file it writes in ``save_checkpoint`` (the NVMe-offload copy aside)."""
    checkpoint_engine = engine.checkpoint_engine
    save, makedirs, copy_scripts = (checkpoint_engine.save, checkpoint_engine.makedirs,
                                    engine._copy_recovery_script)
    with _replaced(checkpoint_engine, "save", lambda state_dict, path: shared.write(path, save, state_dict, path)), \
            _replaced(checkpoint_engine, "makedirs",
                      lambda path, *args, **kwargs: shared.write(path, makedirs, path, *args, **kwargs)), \
            _replaced(engine, "_copy_recovery_script", lambda path: shared.write(path, copy_scripts, path)):
        yield


@contextlib.contextmanager
def _replaced(obj, name, value):
    """``obj.name`` is ``value`` while the body runs, then what it was (an
    instance attribute, or the class's method again)."""
    missing = object()
    before = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


def _write_latest(save_dir, tag):
    """``latest`` naming ``tag``, replaced in one step."""
    path = os.path.join(save_dir, "latest")
    with open(path + ".tmp", "w") as f:
        f.write(tag)
    os.replace(path + ".tmp", path)


def _latest(save_dir):
    path = os.path.join(save_dir, "latest")
    try:
        with open(path) as f:
            return f"latest still names {f.read().strip()!r}"
    except OSError:
        return "there is no latest"
