"""``neuron-compile``: the command line's parser, outside the package so that parsing it (``--help`` included)
imports neither torch nor jax: ``import neuron_compile`` registers the ``neuron`` device with torch. The
commands' code is ``neuron_compile/cli.py`` (the cache commands) and the modules it loads when one runs.

    neuron-compile cache list                 entries, newest use first (key, size, age, name, inputs)
    neuron-compile cache info KEY             one entry (a unique key prefix is enough); --stablehlo prints it
    neuron-compile cache stats                hits, misses, compile seconds saved (all processes)
    neuron-compile cache clear                remove every entry (--stats also resets the counters)
    neuron-compile cache prune --max-size 2G  evict least-recently-used entries down to a size
    neuron-compile cache prune --older-than 30d   remove entries not used for 30 days
    neuron-compile cache explain KEY          why a graph missed: nearest entries, the key parts that differ
    neuron-compile evaluate FILE.py:FACTORY   can this model move to Trainium? (neuron_compile/evaluate/)
    neuron-compile doctor [--bundle F.tar.gz] can the backend work on this machine? (neuron_compile/doctor.py)
    neuron-compile precompile collect|compile|check   compile once for the fleet (docs/precompile.md)

Each command group registers itself in ``build_parser`` through an ``add_<group>_commands(subparsers)``
function; a command's ``fn`` names its function in ``neuron_compile.cli``, imported once the arguments parse.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Sequence

#: The module holding each command's function (``fn`` of the parsed arguments).
COMMANDS = "neuron_compile.cli"


def parse_size(text: str) -> int:
    from neuron_compile.options import parse_size as parse  # the one size grammar (imports the package)

    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 2G)") from None


_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    m = _AGE.fullmatch(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not an age: {text!r} (e.g. 3600, 90m, 12h, 30d, 2w)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuron-compile", description="neuron_compile tools")
    sub = p.add_subparsers(dest="group", required=True)
    add_cache_commands(sub)
    add_evaluate_command(sub)
    add_doctor_command(sub)
    add_precompile_commands(sub)
    return p


def add_evaluate_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``neuron-compile evaluate FILE.py:FACTORY``; its code (neuron_compile/evaluate/) loads only when run."""
    ev = sub.add_parser("evaluate", help="can this model move to Trainium? compile it, run it, judge its numerics",
                        epilog=EVALUATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ev.add_argument("factory", metavar="FILE.py:FACTORY",
                    help="a function returning (model, example_inputs) or (model, example_inputs, loss_fn)")  # fmt: skip
    ev.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ev.add_argument("--steps", type=int, default=3, help="steady-state steps timed (medians; default 3)")
    ev.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="seconds each phase may take (default: no limit); a phase past it is reported")  # fmt: skip
    ev.add_argument("--bisect", action="store_true",
                    help="instead of the report, find where compiled is less precise than eager, each against a "
                         "float64 reference; prints what is flagged: compiled error past eager's by the multiple "
                         "(docs/bisect.md)")  # fmt: skip
    ev.add_argument("--bisect-mode", choices=("ops", "prefix", "modules"), default=None,
                    help="what --bisect judges (implies --bisect): ops, every aten op alone (default); prefix, "
                         "each graph's prefixes, bisected to the node where composed drift enters; modules, every "
                         "submodule's output and gradients")  # fmt: skip
    ev.add_argument("--bisect-multiple", type=float, default=2.0, metavar="X",
                    help="--bisect flags what has a compiled error above X times eager's (default 2)")  # fmt: skip
    ev.set_defaults(fn="cmd_evaluate")


#: Kept here (not in evaluate/cli.py) so that --help does not import torch.
EVALUATE_EPILOG = """\
exit status:
  0  every graph compiles for Trainium and the numerics pass (--bisect: nothing flagged)
  1  the report says why not: an unsupported op, a crash in a phase (the model's own error included), a
     phase past --timeout, numerics that fail, or random draws that leave them unverified (--bisect: an op,
     prefix or module flagged, a graph it could not judge, or a phase past --timeout)
  2  usage or loading error: FILE.py:FACTORY malformed or not a .py file, the file fails to import,
     FACTORY missing, raising, calling sys.exit() or returning the wrong types, --steps < 1, --timeout <= 0,
     --bisect-multiple < 1,
     a bad backend option in the environment: one line on stderr, and with --json the JSON object
     {"ok": false, "factory": ..., "error": ..., "exit_status": 2} on stdout; also a model that returns no
     tensor (a string, None, an int: nothing to compare), the report saying what it returned

--timeout SECONDS bounds each phase (default: none; under --bisect: the capture, each graph, each run of
the model). It interrupts Python code only: a phase blocked in one native call (a compiler run, a deadlock
in C) stops when that call returns. The file is imported under a
private module name (a factory file named copy.py does not replace the standard library's copy); its
directory is put first on sys.path, as python FILE.py would.
"""


DOCTOR_EPILOG = """\
exit status:
  0  the Neuron compiler and runtime were found and every smoke test passed (or --skip-smoke)
  1  they were found but do not work: a smoke test failed (the runtime's start included), the runtime
     library does not answer, or NEURON_RT_VISIBLE_CORES names cores the runtime refuses; or --require-remote
     and the remote cache is not configured or not reachable
  2  neuronx-cc and/or libnrt.so.1 were not found on this machine (it says which and how to install them;
     the smoke test is skipped, versions and the cache are still reported)

--bundle FILE.tar.gz holds doctor.txt (this report), versions.json, environment.txt (NEURON*, XLA_*, JAX_*,
TORCH* variables, PATH, LD_LIBRARY_PATH, LOCAL_RANK, WORLD_SIZE; secrets redacted), graphs/ (each smoke graph's
FX graph and StableHLO), smoke/ (each failure in full) and compiler/NN.txt (each neuronx-cc run: command
line, exit code, stdout, stderr). See docs/doctor.md.
"""


def add_doctor_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``neuron-compile doctor [--skip-smoke] [--bundle FILE.tar.gz]``; its code (neuron_compile/doctor.py)
    loads only when run."""
    doc = sub.add_parser(
        "doctor",
        help="can the neuron backend work here? versions, NeuronCores, cache, a smoke test; --bundle for bug reports",
        description="Check that the neuron backend can work on this machine (versions, the target 'auto' picks, "
        "NeuronCores, the compile cache), run a smoke test (tiny graphs compiled for the neuron and the cpu "
        "target, results compared), and gather what a bug report needs (--bundle).",
        epilog=DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doc.add_argument("--skip-smoke", action="store_true", help="do not compile and run the smoke-test graphs")
    doc.add_argument("--bundle", metavar="FILE.tar.gz", help="also write a tarball of what a bug report needs")
    doc.add_argument("--require-remote", action="store_true",
                     help="the remote cache (NEURON_COMPILE_CACHE_URL) must be configured and reachable, else exit 1 "
                     "(hosts that rely on precompiled entries); without it an unreachable one is a note")  # fmt: skip
    doc.set_defaults(fn="cmd_doctor")


def add_cache_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``neuron-compile cache {list,info,stats,clear,prune}``."""
    cache = sub.add_parser("cache", help="inspect and manage the compile cache")
    cache.add_argument("--dir", help="cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
    cache.add_argument("--url", help="a remote cache (s3://bucket/prefix or any fsspec URL) for list, stats, prune")
    csub = cache.add_subparsers(dest="cmd", required=True)
    csub.add_parser("list", help="list entries").set_defaults(fn="cmd_list")
    info = csub.add_parser("info", help="show one entry")
    info.add_argument("key", help="a key or unique key prefix")
    info.add_argument("--stablehlo", action="store_true", help="print the entry's StableHLO module")
    info.set_defaults(fn="cmd_info")
    csub.add_parser("stats", help="hits, misses, compile seconds saved").set_defaults(fn="cmd_stats")
    clear = csub.add_parser("clear", help="remove every entry")
    clear.add_argument("--stats", action="store_true", help="also reset the hit/miss counters")
    clear.set_defaults(fn="cmd_clear")
    prune = csub.add_parser("prune", help="evict entries down to a size (least recently used first) or by age")
    prune.add_argument("--max-size", type=parse_size, help="e.g. 500M, 2G")
    prune.add_argument("--older-than", type=parse_age, help="unused (remote: published) longer than, e.g. 12h, 30d")
    prune.set_defaults(fn="cmd_prune")
    explain = csub.add_parser("explain", help="why a key missed: the nearest entries and the key parts that differ")
    explain.add_argument("key", help="a key or unique key prefix (of an entry, or of a graph of --manifest)")
    explain.add_argument("--manifest", help="a precompile manifest whose graphs' keys may be named too")
    explain.set_defaults(fn="cmd_explain")


PRECOMPILE_EPILOG = """\
  collect --manifest M -- CMD...   run CMD (e.g. python train.py) on the CPU target, recording every graph
                                   as the neuron target will key and compile it (NEURON_COMPILE_PRECOMPILE_MANIFEST)
  compile M [--jobs N] [--shard I/N]   compile what the caches lack, N neuronx-cc at once; exit 1 if any failed
  check M [--cache-url URL]        coverage per graph (and why each miss); exit 1 below 100%
A manifest that is not one (wrong types, missing fields, not JSON) exits 2, one line per problem naming the
file and the field. See docs/precompile.md.
"""


def add_precompile_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``neuron-compile precompile {collect,compile,check}``; neuron_compile/precompile.py loads only when run."""
    pre = sub.add_parser("precompile", help="compile every graph of a run ahead of it, in parallel, for the fleet",
                         epilog=PRECOMPILE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    psub = pre.add_subparsers(dest="cmd", required=True)
    col = psub.add_parser("collect", help="run a script on the CPU target and record its graphs for the neuron target")
    col.add_argument("--manifest", required=True, help="the manifest file (its modules go in modules/ beside it)")
    col.add_argument("command", nargs=argparse.REMAINDER, help="-- the command, e.g. -- python train.py ARGS")
    col.set_defaults(fn="cmd_precompile_collect")
    comp = psub.add_parser("compile", help="compile the recorded graphs the caches lack, in parallel")
    comp.add_argument("manifest")
    comp.add_argument("--jobs", type=int, default=None, help="compiler processes at once (default: the cores)")
    comp.add_argument("--shard", metavar="I/N", help="this host's share: every N-th key from the I-th (0-based)")
    comp.add_argument("--dir", help="local cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
    comp.add_argument("--cache-url", help="remote cache (default: NEURON_COMPILE_CACHE_URL)")
    comp.set_defaults(fn="cmd_precompile_compile")
    chk = psub.add_parser("check", help="coverage of a manifest by the caches; exit 1 below 100%%")
    chk.add_argument("manifest")
    chk.add_argument("--dir", help="local cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
    chk.add_argument("--cache-url", help="remote cache (default: NEURON_COMPILE_CACHE_URL)")
    chk.set_defaults(fn="cmd_precompile_check")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(getattr(importlib.import_module(COMMANDS), args.fn)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
