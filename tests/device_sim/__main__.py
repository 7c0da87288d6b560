"""Walk the device path on any machine: run a command with the device simulator switched on.

    python -m tests.device_sim -- python -m neuron_compile.demo     # COMMAND with the simulator
    python -m tests.device_sim --env                                  # export lines for a shell
    eval "$(python -m tests.device_sim --env)"

Run from the repository root (``tests`` must import). The command's exit status is passed through.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from . import environment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.device_sim",
        description="Run COMMAND with the Neuron device simulator (fake neuronx-cc and libnrt) switched on.",
    )
    parser.add_argument("--env", action="store_true", help="print `export NAME=value` lines for a shell and exit")
    parser.add_argument("--state-dir", help="where the simulated cores' locks and the compile log live")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    env = environment(args.state_dir)
    if args.env:
        for name, value in env.items():
            print(f"export {name}={shlex.quote(value)}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --, or --env")
    os.environ.update(env)
    try:
        os.execvp(command[0], command)  # the command's exit status is this process's
    except OSError as e:
        print(f"python -m tests.device_sim: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
