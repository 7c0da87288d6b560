"""``neuron-compile``: inspect and manage the compile cache.

    neuron-compile cache list                 entries, newest use first (key, size, age, name, inputs)
    neuron-compile cache info KEY             one entry (a unique key prefix is enough); --stablehlo prints it
    neuron-compile cache stats                hits, misses, compile seconds saved (all processes)
    neuron-compile cache clear                remove every entry (--stats also resets the counters)
    neuron-compile cache prune --max-size 2G  evict least-recently-used entries down to a size

``--dir`` picks the directory; default: NEURON_COMPILE_CACHE_DIR, else the user cache dir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


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


def _store(args: argparse.Namespace):  # -> DiskStore (import kept lazy: --help stays fast)
    from .cache.store import DiskStore, default_cache_dir

    return DiskStore(args.dir or os.environ.get("NEURON_COMPILE_CACHE_DIR") or default_cache_dir())


def _resolve(store, prefix: str) -> str:
    matches = store.find(prefix)
    if len(matches) != 1:
        what = "no entry" if not matches else f"{len(matches)} entries"
        raise SystemExit(f"neuron-compile: {what} match key {prefix!r} in {store.root}")
    return matches[0]


def cmd_list(args: argparse.Namespace) -> int:
    from .cache.entry import CorruptEntry

    store = _store(args)
    infos = sorted(store.entries(), key=lambda e: e.last_used, reverse=True)
    now = time.time()
    print(f"{store.root}: {len(infos)} entries, {human_size(sum(e.size for e in infos))}")
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


def cmd_info(args: argparse.Namespace) -> int:
    store = _store(args)
    key = _resolve(store, args.key)
    meta = store.meta(key)
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
    print(f"hits:          {hits:.0f}{rate}  (memory {s.get('memory_hits', 0):.0f}, disk {s.get('disk_hits', 0):.0f})")
    print(f"misses:        {misses:.0f}  (stored {s.get('stores', 0):.0f})")
    print(f"corrupt:       {s.get('corrupt', 0):.0f}   evicted: {s.get('evictions', 0):.0f}")
    print(f"compile time:  {s.get('compile_seconds_saved', 0):.1f}s saved by hits, "
          f"{s.get('compile_seconds_spent', 0):.1f}s spent on misses")  # fmt: skip
    if "updated" in s:
        print(f"last update:   {human_age(time.time() - s['updated'])}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    store = _store(args)
    n = store.clear()
    if args.stats:
        store.reset_stats()
    print(f"removed {n} entries from {store.root}" + (" and reset the counters" if args.stats else ""))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    store = _store(args)
    before = store.total_bytes()
    # exactly down to the asked size, not to the automatic eviction's low-water mark
    evicted = store.evict(args.max_size, low_water=1.0)
    after = store.total_bytes()
    print(f"evicted {len(evicted)} entries: {human_size(before)} -> {human_size(after)} in {store.root}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuron-compile", description="neuron_compile tools")
    sub = p.add_subparsers(dest="group", required=True)
    cache = sub.add_parser("cache", help="inspect and manage the compile cache")
    cache.add_argument("--dir", help="cache directory (default: NEURON_COMPILE_CACHE_DIR or the user cache dir)")
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
    prune = csub.add_parser("prune", help="evict least-recently-used entries down to a size")
    prune.add_argument("--max-size", type=parse_size, required=True, help="e.g. 500M, 2G")
    prune.set_defaults(fn=cmd_prune)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
