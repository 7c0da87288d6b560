"""The keeper of one neuronx-cc run: ``python -I -S compile_guard.py PARENT_PID WORKDIR -- COMMAND...``.

neuronx-cc runs for minutes to hours and starts processes of its own. Its parent (the user's script or
``neuron-compile precompile``) may be stopped at any time: SIGTERM, Ctrl-C, a job scheduler's SIGKILL. Then
the compiler must not run on as an orphan, nor its work directory (``neuron_compile_*``) stay behind. A
SIGKILLed process runs no code of its own, so the clean-up cannot live in it: it lives here, in a small
process between the parent and the compiler.

- This process asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``) and checks that the
  parent did not die before the request; the compiler, in a process group (session) of its own, gets SIGKILL
  when this process dies.
- On SIGTERM, SIGINT or SIGHUP (the parent died, or stopped the compile: a timeout, its own signal) it
  kills the compiler's whole process group, waits for it, removes WORKDIR and exits.
- Otherwise it waits for the compiler and ends as the compiler ended: the same exit status, or killed by
  the same signal (so the parent can say "killed by SIGKILL", not "exit -9").

Standard library only, run with ``-I -S``: it starts in a few milliseconds and imports nothing of the
package (whose import could fail or take long in a broken environment).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys

#: linux/prctl.h
PR_SET_PDEATHSIG = 1


def _libc_prctl():
    """libc's prctl, looked up before any fork (a child between fork and exec should call nothing that
    loads a library); None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def die_with_parent(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def child_setup(parent_pid: int, sig: int):
    """A ``preexec_fn`` for a child that must die (``sig``) with the process ``parent_pid`` that starts it. If
    the parent is already gone when the request is made, the child kills itself with ``sig`` at once."""

    def setup() -> None:
        die_with_parent(sig)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return setup


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: compile_guard.py PARENT_PID WORKDIR -- COMMAND...", file=sys.stderr)
        return 2
    parent_pid, workdir, command = int(argv[0]), argv[1], argv[3:]
    child: subprocess.Popen | None = None

    def stop(signum: int, frame: object) -> None:
        if child is not None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:  # not child.wait(): the interrupted wait below holds its lock
                os.waitpid(child.pid, 0)
            except ChildProcessError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"neuronx-cc: stopped ({signal.Signals(signum).name}); its work directory removed", file=sys.stderr)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        stop(signal.SIGTERM, None)
    try:
        child = subprocess.Popen(
            command, cwd=workdir, start_new_session=True, preexec_fn=child_setup(os.getpid(), signal.SIGKILL)
        )
    except OSError as e:
        print(f"neuronx-cc: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    status = child.wait()
    try:  # what the compiler started and left running (its process group) goes with it
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if status < 0:  # killed by a signal: end the same way, so that the parent sees that signal
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status  # a signal that does not end a process (SIGCHLD, SIGWINCH...)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
