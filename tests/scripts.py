"""Run a Python script as ``python script.py args`` would (``argv`` is
``[script.py, *args]``), in a process forked from the rank pools' fork server,
which has already imported torch, transformers, DeepSpeed and ds_tsp: a
benchmark, an example or a rank that is meant to die starts in well under a
second instead of paying those imports (about 8 s of CPU) again.

The script runs as ``__main__`` with its own ``sys.argv``, environment and
working directory, its directory first on ``sys.path``, and its standard output
and error written to files; it leads a process group of its own, so that a
timeout ends it and every process it started. Variables read when torch is
imported are set again where torch reads them later (``OMP_NUM_THREADS``).
"""

import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing import resource_tracker

from distributed import forkserver_context


def _own_resource_tracker():
    """As in a fresh interpreter, the script's semaphores are tracked by a
    tracker of its own, which reports what the script leaves behind (a rank
    that dies on purpose skips its finalizers) on the script's standard error,
    not the test process's."""
    tracker = resource_tracker.ResourceTracker()
    resource_tracker._resource_tracker = tracker
    for name in ("ensure_running", "register", "unregister", "getfd"):
        setattr(resource_tracker, name, getattr(tracker, name))


def _main(path, argv, env, cwd, stdout_file, stderr_file):
    os.setsid()
    for fd, name in ((1, stdout_file), (2, stderr_file)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    _own_resource_tracker()
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")  # SystemExit(code) becomes the exit status, as in Python


class Script:
    """A started script; ``wait`` returns a ``subprocess.CompletedProcess``."""

    def __init__(self, argv, env, cwd):
        path, args = str(argv[0]), [str(arg) for arg in argv[1:]]
        self._dir = tempfile.TemporaryDirectory(prefix="ds_tsp_script_")
        self._out, self._err = (os.path.join(self._dir.name, name) for name in ("stdout", "stderr"))
        self.args = [sys.executable, path, *args]
        self._proc = forkserver_context().Process(
            target=_main, args=(path, args, dict(os.environ if env is None else env),
                                str(cwd or os.getcwd()), self._out, self._err))
        self._proc.start()

    def wait(self, timeout):
        self._proc.join(timeout)
        timed_out = self._proc.exitcode is None
        self.kill()
        stdout, stderr = self._outputs()
        self._dir.cleanup()
        if timed_out:
            raise subprocess.TimeoutExpired(self.args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(self.args, self._proc.exitcode, stdout, stderr)

    def kill(self):
        """End the script and every process it started."""
        if self._proc.exitcode is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.join()

    def _outputs(self):
        texts = []
        for name in (self._out, self._err):
            with open(name, errors="replace") as f:
                texts.append(f.read())
        return texts


def start_script(argv, env=None, cwd=None):
    return Script(argv, env, cwd)


def run_script(argv, env=None, cwd=None, timeout=300):
    return start_script(argv, env, cwd).wait(timeout)


def run_as_launched(argv, world_size, env=None, cwd=None, timeout=300):
    """``world_size`` ranks of a script on one node, each started as the
    deepspeed launcher starts it (``deepspeed/launcher/launch.py``: the
    rendezvous variables, ``RANK`` and ``LOCAL_RANK``, ``--local_rank=N``
    before the script's own arguments), without the launcher's two processes;
    ``tests/test_engine.py`` runs the launcher itself. Returns each rank's
    ``subprocess.CompletedProcess``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = {**(os.environ if env is None else env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size), "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(world_size)}
    started = [start_script([argv[0], f"--local_rank={rank}", *argv[1:]], {**node, "RANK": str(rank),
                                                                            "LOCAL_RANK": str(rank)}, cwd)
               for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    try:
        return [script.wait(max(1.0, deadline - time.monotonic())) for script in started]
    finally:
        for script in started:
            script.kill()
