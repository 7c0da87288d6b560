"""``neuron-compile``: inspect and manage the compile cache.

    neuron-compile cache list                 entries, newest use first (key, size, age, name, inputs)
    neuron-compile cache info KEY             one entry (a unique key prefix is enough); --stablehlo prints it
    neuron-compile cache stats                hits, misses, compile seconds saved (all processes)
    neuron-compile cache clear                remove every entry (--stats also resets the counters)
    neuron-compile cache prune --max-size 2G  evict least-recently-used entries down to a size
    neuron-compile cache prune --older-than 30d   remove entries not used for 30 days
    neuron-compile evaluate FILE.py:FACTORY   can this model move to Trainium? (neuron_compile/evaluate/)
    neuron-compile doctor [--bundle F.tar.gz] can the backend work on this machine? (neuron_compile/doctor.py)
    neuron-compile cache explain KEY          why a graph missed: nearest entries, the key parts that differ
    neuron-compile precompile collect|compile|check   compile once for the fleet (docs/precompile.md)

``--url s3://bucket/prefix`` (any fsspec URL) makes ``list`` and ``prune --older-than`` act on that remote
cache (``cache.remote``) instead of the directory, and ``stats`` add its entry count and size; an entry's age
there is the time it was published.

``--dir`` picks the directory; default: NEURON_COMPILE_CACHE_DIR, else the user cache dir
(``cache.paths.resolve_cache_dir``, the same resolution ``torch.compile`` uses). ``clear`` and ``prune``
also remove what killed processes left in ``tmp/`` and ``trash/``; ``list`` and ``stats`` count it.

The cache commands import neither jax nor the lowering (they only read files). Each command group
registers itself in ``build_parser`` through a ``add_<group>_commands(subparsers)`` function.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Sequence

from .options import human_size


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"


def parse_size(text: str) -> int:
    from .options import parse_size as parse

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


def _remote(args: argparse.Namespace):  # -> RemoteStore, or None without --url (import kept lazy)
    if not args.url:
        return None
    if "://" not in args.url:
        from .cache.redact import redact

        raise SystemExit(
            f"neuron-compile: --url {redact(repr(args.url), [args.url])} is not a URL (e.g. s3://bucket/prefix); "
            "--dir takes a directory"
        )
    from .cache.remote import RemoteStore, hmac_key_from_env

    return RemoteStore(args.url, hmac_key=hmac_key_from_env())


def _remote_call(fn, url: str):
    from .cache.redact import redact
    from .cache.remote import RemoteUnavailable

    try:
        return fn()
    except (RemoteUnavailable, OSError) as e:  # e.g. a filesystem that cannot be set up; denied on prune
        why = " ".join(redact(e, [url]).split()) or type(e).__name__  # one line, whatever the backend's message
        raise SystemExit(f"neuron-compile: the remote cache is not usable: {why}") from None


def _no_url(args: argparse.Namespace) -> None:
    if args.url:
        raise SystemExit(f"neuron-compile: 'cache {args.cmd}' works on the local directory only; drop --url")


def _store(args: argparse.Namespace):  # -> DiskStore (import kept lazy: --help stays fast)
    from .cache.paths import resolve_cache_dir
    from .cache.store import DiskStore

    return DiskStore(resolve_cache_dir(args.dir))


def _resolve(store, prefix: str) -> str:
    from .cache.paths import InvalidKey, check_key_prefix

    try:
        prefix = check_key_prefix(prefix)  # a key never becomes a path unchecked
    except InvalidKey as e:
        raise SystemExit(f"neuron-compile: {e}") from None
    matches = store.find(prefix)
    if len(matches) != 1:
        what = "no entry" if not matches else f"{len(matches)} entries"
        raise SystemExit(f"neuron-compile: {what} match key {prefix!r} in {store.root}")
    return matches[0]


def cmd_list(args: argparse.Namespace) -> int:
    from .cache.entry import CorruptEntry

    remote = _remote(args)
    if remote is not None:
        entries = sorted(_remote_call(remote.entries, args.url), key=lambda e: e.modified, reverse=True)
        now = time.time()
        print(f"{remote.url}: {len(entries)} entries, {human_size(sum(e.size for e in entries))}")
        for r in entries:
            print(f"{r.key[:16]}  {human_size(r.size):>10}  published {human_age(now - r.modified):>10}  {r.name}")
        return 0
    store = _store(args)
    infos = sorted(store.entries(), key=lambda e: e.last_used, reverse=True)
    now = time.time()
    print(f"{store.root}: {len(infos)} entries, {human_size(sum(e.size for e in infos))}{_leftover_note(store)}")
    for e in infos:
        try:
            meta = store.meta(e.key)
            desc = f"{meta['name']:<22} {meta['num_ops']:>5} ops  {', '.join(meta['key_summary']['inputs'][:3])}"
            if len(meta["key_summary"]["inputs"]) > 3:
                desc += ", ..."
        except (OSError, CorruptEntry, KeyError) as err:
            desc = f"<damaged: {err}>"
        print(f"{e.key[:16]}  {human_size(e.size):>10}  used {human_age(now - e.last_used):>10}  {desc}")
    return 0


def _leftover_note(store) -> str:
    left = store.leftovers()
    if not left:
        return ""
    return f" + {len(left)} leftovers of interrupted writes/deletes, {human_size(sum(lo.size for lo in left))}"


def cmd_info(args: argparse.Namespace) -> int:
    from .cache.entry import CorruptEntry

    _no_url(args)
    store = _store(args)
    key = _resolve(store, args.key)
    try:
        meta = store.meta(key)
    except (OSError, CorruptEntry) as e:
        raise SystemExit(f"neuron-compile: entry {key} is damaged ({e}); the next compile replaces it") from None
    if args.stablehlo:
        _, module, _ = store.read_raw(key)
        sys.stdout.write(module.decode())
        return 0
    info = next(e for e in store.entries() if e.key == key)
    summary = meta["key_summary"]
    lines = [
        ("key", key),
        ("path", store.entry_dir(key)),
        ("graph", f"{meta['name']} ({meta['num_ops']} ops)"),
        ("created", f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(meta['created']))} "
                    f"({human_age(time.time() - meta['created'])})"),
        ("last used", human_age(time.time() - info.last_used)),
        ("size", human_size(info.size) + "  (" + ", ".join(
            f"{n} {human_size(f['size'])}" for n, f in meta["files"].items()) + ")"),
        ("compile", f"lowering {meta['lower_seconds']:.3f}s + target compile {meta['compile_seconds']:.3f}s"),
        ("target", f"{summary['target']} ({meta['target_version']})"),
        ("options", json.dumps(summary["options"], sort_keys=True)),
        ("versions", json.dumps(summary["versions"], sort_keys=True)),
        ("tag", summary["tag"] or "-"),
    ]  # fmt: skip
    for k, v in lines:
        print(f"{k + ':':<11} {v}")
    print("inputs:")
    for i, s in enumerate(summary["inputs"]):
        print(f"  {i:>3}  {s}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    store = _store(args)
    s = store.read_stats()
    infos = list(store.entries())
    hits, misses = s.get("hits", 0), s.get("misses", 0)
    rate = f" ({100 * hits / (hits + misses):.0f}% hits)" if hits + misses else ""
    print(f"cache dir:     {store.root}")
    print(f"entries:       {len(infos)}, {human_size(sum(e.size for e in infos))}")
    left = store.leftovers()
    print(
        f"leftovers:     {len(left)}, {human_size(sum(lo.size for lo in left))}  (tmp/ and trash/ of interrupted processes)"
    )
    print(f"hits:          {hits:.0f}{rate}  (memory {s.get('memory_hits', 0):.0f}, disk {s.get('disk_hits', 0):.0f})")
    print(f"misses:        {misses:.0f}  (stored {s.get('stores', 0):.0f})")
    print(f"corrupt:       {s.get('corrupt', 0):.0f}   evicted: {s.get('evictions', 0):.0f}")
    print(f"compile time:  {s.get('compile_seconds_saved', 0):.1f}s saved by hits, "
          f"{s.get('compile_seconds_spent', 0):.1f}s spent on misses")  # fmt: skip
    if any(s.get(k, 0) for k in ("remote_hits", "remote_misses", "remote_stores", "remote_rejected", "remote_errors")):
        print(f"remote:        {s.get('remote_hits', 0):.0f} hits, {s.get('remote_misses', 0):.0f} misses, "
              f"{s.get('remote_stores', 0):.0f} published, {s.get('remote_rejected', 0):.0f} refused "
              f"(damaged or unsigned), {s.get('remote_errors', 0):.0f} errors")  # fmt: skip
    if "updated" in s:
        print(f"last update:   {human_age(time.time() - s['updated'])}")
    remote = _remote(args)
    if remote is not None:
        entries = _remote_call(remote.entries, args.url)
        print(f"remote cache:  {remote.url}: {len(entries)} entries, {human_size(sum(e.size for e in entries))}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    _no_url(args)
    store = _store(args)
    n = store.clear()
    if args.stats:
        store.reset_stats()
    left = store.leftovers()
    kept = f"; {len(left)} leftovers kept (still being written)" if left else ""
    print(f"removed {n} entries from {store.root}" + (" and reset the counters" if args.stats else "") + kept)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    if args.max_size is None and args.older_than is None:
        raise SystemExit("neuron-compile: cache prune needs --max-size SIZE and/or --older-than AGE")
    remote = _remote(args)
    if remote is not None:
        if args.max_size is not None or args.older_than is None:
            raise SystemExit("neuron-compile: with --url, prune by age only (--older-than AGE)")
        removed, objects = _remote_call(lambda: remote.prune(args.older_than), args.url)
        print(f"removed {len(removed)} entries ({objects} objects, abandoned uploads included) from {remote.url}")
        return 0
    store = _store(args)
    before = store.total_bytes()
    swept = store.sweep()
    evicted = []
    if args.older_than is not None:
        cutoff = time.time() - args.older_than
        for info in list(store.entries()):
            if info.last_used < cutoff:
                store.remove(info.key)
                evicted.append(info.key)
    if args.max_size is not None:
        # exactly down to the asked size, not to the automatic eviction's low-water mark
        evicted += store.evict(args.max_size, low_water=1.0)
    after = store.total_bytes()
    gone = f" and {len(swept)} stale leftovers" if swept else ""
    print(f"evicted {len(evicted)} entries{gone}: {human_size(before)} -> {human_size(after)} in {store.root}")
    return 0


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
    ev.set_defaults(fn=cmd_evaluate)


#: Kept here (not in evaluate/cli.py) so that --help does not import torch; evaluate/cli.py's docstring agrees.
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


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate.cli import run

    return run(args)


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
    doc.set_defaults(fn=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor

    return doctor(skip_smoke=args.skip_smoke, bundle=args.bundle, require_remote=args.require_remote)


def add_cache_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``neuron-compile cache {list,info,stats,clear,prune}``."""
    cache = sub.add_parser("cache", help="inspect and manage the compile cache")
    cache.add_argument("--dir", help="cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
    cache.add_argument("--url", help="a remote cache (s3://bucket/prefix or any fsspec URL) for list, stats, prune")
    csub = cache.add_subparsers(dest="cmd", required=True)
    csub.add_parser("list", help="list entries").set_defaults(fn=cmd_list)
    info = csub.add_parser("info", help="show one entry")
    info.add_argument("key", help="a key or unique key prefix")
    info.add_argument("--stablehlo", action="store_true", help="print the entry's StableHLO module")
    info.set_defaults(fn=cmd_info)
    csub.add_parser("stats", help="hits, misses, compile seconds saved").set_defaults(fn=cmd_stats)
    clear = csub.add_parser("clear", help="remove every entry")
    clear.add_argument("--stats", action="store_true", help="also reset the hit/miss counters")
    clear.set_defaults(fn=cmd_clear)
    prune = csub.add_parser("prune", help="evict entries down to a size (least recently used first) or by age")
    prune.add_argument("--max-size", type=parse_size, help="e.g. 500M, 2G")
    prune.add_argument("--older-than", type=parse_age, help="unused (remote: published) longer than, e.g. 12h, 30d")
    prune.set_defaults(fn=cmd_prune)
    explain = csub.add_parser("explain", help="why a key missed: the nearest entries and the key parts that differ")
    explain.add_argument("key", help="a key or unique key prefix (of an entry, or of a graph of --manifest)")
    explain.add_argument("--manifest", help="a precompile manifest whose graphs' keys may be named too")
    explain.set_defaults(fn=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    from .precompile import main_explain

    _no_url(args)
    return main_explain(args.key, args.dir, args.manifest, sys.stdout)


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
    col.set_defaults(fn=cmd_precompile_collect)
    comp = psub.add_parser("compile", help="compile the recorded graphs the caches lack, in parallel")
    comp.add_argument("manifest")
    comp.add_argument("--jobs", type=int, default=None, help="compiler processes at once (default: the cores)")
    comp.add_argument("--shard", metavar="I/N", help="this host's share: every N-th key from the I-th (0-based)")
    comp.add_argument("--dir", help="local cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
    comp.add_argument("--cache-url", help="remote cache (default: NEURON_COMPILE_CACHE_URL)")
    comp.set_defaults(fn=cmd_precompile_compile)
    chk = psub.add_parser("check", help="coverage of a manifest by the caches; exit 1 below 100%%")
    chk.add_argument("manifest")
    chk.add_argument("--dir", help="local cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
    chk.add_argument("--cache-url", help="remote cache (default: NEURON_COMPILE_CACHE_URL)")
    chk.set_defaults(fn=cmd_precompile_check)


def cmd_precompile_collect(args: argparse.Namespace) -> int:
    from .precompile import main_collect

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return main_collect(args.manifest, command)


def cmd_precompile_compile(args: argparse.Namespace) -> int:
    from .precompile import main_compile

    if args.jobs is not None and args.jobs < 1:
        raise SystemExit("neuron-compile: --jobs needs a number >= 1")
    return main_compile(args.manifest, args.jobs, args.shard, args.dir, args.cache_url)


def cmd_precompile_check(args: argparse.Namespace) -> int:
    from .precompile import main_check

    return main_check(args.manifest, args.dir, args.cache_url)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
