"""``neuron-compile``'s commands: the cache commands here, the others (evaluate, doctor, precompile) in the
modules each loads when it runs. The parser is ``neuron_compile_cli.py`` beside the package (``--help`` must not
import torch, which ``import neuron_compile`` does); ``main`` here is the same command line.

``--url s3://bucket/prefix`` (any fsspec URL) makes ``list`` and ``prune --older-than`` act on that remote
cache (``cache.remote``) instead of the directory, and ``stats`` add its entry count and size; an entry's age
there is the time it was published.

``--dir`` picks the directory; default: NEURON_COMPILE_CACHE_DIR, else the user cache dir
(``cache.paths.resolve_cache_dir``, the same resolution ``torch.compile`` uses). ``clear`` and ``prune``
also remove what killed processes left in ``tmp/`` and ``trash/``; ``list`` and ``stats`` count it.

The cache commands import neither jax nor the lowering (they only read files).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# the parser, and ``main`` for ``python -m neuron_compile.cli`` and the tests' ``cli.main([...])``
from neuron_compile_cli import build_parser as build_parser
from neuron_compile_cli import main

from .options import human_size


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit} ago"
    return f"{seconds:.0f}s ago"


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


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate.cli import run

    return run(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import main as doctor

    return doctor(skip_smoke=args.skip_smoke, bundle=args.bundle, require_remote=args.require_remote)


def cmd_explain(args: argparse.Namespace) -> int:
    from .precompile import main_explain

    _no_url(args)
    return main_explain(args.key, args.dir, args.manifest, sys.stdout)


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


if __name__ == "__main__":
    sys.exit(main())
