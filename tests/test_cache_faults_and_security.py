"""Reliability and security of the compile cache, as an attacker or an unlucky user would drill it.

Security: hostile keys (mega-cache artifacts with valid checksums, CLI arguments, directory names) never
make the cache touch anything outside its root; symlinks below the root are never followed; FIFOs and
other non-regular files planted as entry files are refused without blocking; no pickle is ever loaded.
Reliability: N processes on one cold key compile it once; damaged entries (truncated, bit-flipped,
executables swapped with recomputed checksums) are warned misses that recompile; read-only and full
directories run with one warning; leftovers of killed processes are counted and swept; the cache CLI
stays light (no jax, no lowering).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
import warnings

import filelock
import pytest
import torch

import neuron_compile.cache as nc
import neuron_compile.cache.store as store_mod
from neuron_compile import cli
from neuron_compile.cache import entry as E
from neuron_compile.cache.megacache import NeuronCacheArtifact
from neuron_compile.cache.store import STALE_SECONDS, DiskStore
from neuron_compile.options import Options
from tests.test_cache import ATOL, RTOL, Block, _result, _run, cache_dir, run_train_step, states  # noqa: F401


# ----------------------------------------------------------------------------------------- helpers
def compile_block(model=None, rows=4):
    """One inference graph through the cache; returns (model, input, output)."""
    model = model or Block()
    x = torch.randn(rows, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="neuron", dynamic=False)(x)
    return model, x, out


def rerun(model, x):
    """The same graph again in a 'fresh' process: no in-process layer, Dynamo reset."""
    nc.clear_memory()
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="neuron", dynamic=False)(x)


def only_entry(cache_dir):
    (entry,) = list(DiskStore(str(cache_dir)).entries())
    return entry


def snapshot(root) -> dict[str, tuple]:
    """Every path under ``root`` (symlinks not followed) with its type, size, mode and content hash."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            digest = None
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            found[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return found


@pytest.fixture
def victim(tmp_path):
    """A directory outside the cache that nothing may touch: a file, a subdirectory."""
    d = tmp_path / "some" / "victim" / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "precious.txt").write_text("do not touch")
    (d / "sub" / "meta.json").write_text("{}")
    before = snapshot(tmp_path / "some")
    yield d
    assert snapshot(tmp_path / "some") == before, "something outside the cache root changed"


def cache_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, nc.NeuronCacheWarning)]


def rewrite_meta(meta: bytes, **changes) -> bytes:
    """meta.json with payload fields changed and its checksum recomputed (a consistent forgery)."""
    payload = json.loads(meta)["payload"]
    for k, v in changes.items():
        if k == "files":
            payload["files"].update(v)
        else:
            payload[k] = v
    body = json.dumps(payload, sort_keys=True)
    return json.dumps({"payload": payload, "sha256": E.sha256(body.encode())}, sort_keys=True, indent=1).encode()


# ------------------------------------------------------------------------ security: hostile keys
def _hostile_keys(cache_dir, victim):
    entries = os.path.join(str(cache_dir), "entries", "xx")  # where entry_dir() would have started
    return {
        "relative traversal": os.path.relpath(str(victim), entries),
        "relative ../../../../": "../../../../" + os.path.relpath(str(victim), "/"),
        "absolute path": str(victim),
        "hex then traversal": "ab" * 20 + "/../../../../" + os.path.relpath(str(victim), "/"),
        "40 chars not hex": "g" * 40,
        "upper-case hex": "AB" * 20,
        "too short": "ab" * 19,
    }


HOSTILE = sorted(_hostile_keys("/c", "/v"))


@pytest.mark.parametrize("how", HOSTILE)
def test_megacache_artifact_with_hostile_key_is_refused(cache_dir, victim, how):
    """Issue 8.1: a mega-cache artifact whose key is a path, with consistent checksums, loaded through
    ``torch.compiler.load_cache_artifacts``: one clear warning, nothing outside the cache changes."""
    from torch.compiler._cache import CacheArtifactManager

    compile_block()
    store = DiskStore(str(cache_dir))
    good = only_entry(cache_dir)
    meta, module, executable = store.read_raw(good.key)
    hostile = _hostile_keys(cache_dir, victim)[how]
    forged = rewrite_meta(meta, key=hostile)
    E.verify_meta(forged, hostile)  # the forgery passes every checksum
    torch.compiler.save_cache_artifacts()  # drop what earlier compiles recorded
    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager.record_artifact("neuron_compile", hostile, E.pack(forged, module, executable))
        blob, _info = torch.compiler.save_cache_artifacts()
    before = snapshot(cache_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compiler.load_cache_artifacts(blob)
    mine = cache_warnings(caught)
    assert len(mine) == 1 and "not a cache key" in mine[0], mine
    assert snapshot(cache_dir) == before, "a refused artifact changed the cache"


def test_store_refuses_hostile_keys_before_building_paths(cache_dir, victim):
    store = DiskStore(str(cache_dir))
    for how, key in _hostile_keys(cache_dir, victim).items():
        for call in (store.entry_dir, store.remove, store.read, store.lock, lambda k: store.write(k, b"", b"", b"")):
            with pytest.raises(nc.InvalidKey):
                call(key)
                pytest.fail(f"{how}: {call} accepted {key!r}")


@pytest.mark.parametrize("arg", ["../../etc", "/etc/passwd", "ab/../..", "zz", ""])
def test_cli_refuses_a_key_that_is_not_hex(cache_dir, victim, arg, capsys):
    compile_block()
    with pytest.raises(SystemExit, match="not a cache key"):
        cli.main(["cache", "--dir", str(cache_dir), "info", arg])


def test_listing_skips_names_that_are_not_keys_and_symlinks(cache_dir, victim, capsys):
    compile_block()
    store = DiskStore(str(cache_dir))
    good = only_entry(cache_dir)
    entries = cache_dir / "entries"
    (entries / "zz" / "not-a-key").mkdir(parents=True)  # planted by hand: not ours to list or delete
    (entries / good.key[:2] / ("..." + good.key[3:])).mkdir()
    shard1, shard2 = [s for s in ("cd", "ef", "01") if s != good.key[:2]][:2]
    (entries / shard1).mkdir()
    os.symlink(victim, entries / shard1 / (shard1 * 20))  # an entry that is a symlink to a victim directory
    os.symlink(victim, entries / shard2)  # a shard that is a symlink
    assert [e.key for e in store.entries()] == [good.key]
    assert cli.main(["cache", "--dir", str(cache_dir), "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert cli.main(["cache", "--dir", str(cache_dir), "prune", "--max-size", "0"]) == 0


# --------------------------------------------------------------------- security: symlinks below root
def _link_entry_dir(cache_dir, victim, key):
    d = cache_dir / "entries" / key[:2] / key
    os.rename(d, cache_dir / "moved-away")
    os.symlink(victim, d)


def _link_shard(cache_dir, victim, key):
    d = cache_dir / "entries" / key[:2]
    os.rename(d, cache_dir / "moved-away")
    os.symlink(victim, d)


def _link_entry_file(cache_dir, victim, key):
    f = cache_dir / "entries" / key[:2] / key / "executable.bin"
    f.unlink()
    os.symlink(victim / "precious.txt", f)


def _link_subdir(name):
    def link(cache_dir, victim, key):
        d = cache_dir / name
        os.rename(d, cache_dir / f"{name}-moved-away")
        os.symlink(victim, d)

    return link


SYMLINKS = {
    "entry dir": (_link_entry_dir, "damaged"),
    "shard dir": (_link_shard, "damaged"),
    "entry file": (_link_entry_file, "damaged"),
    **{f"{sub}/ dir": (_link_subdir(sub), "not using") for sub in ("entries", "tmp", "trash", "locks")},
}


@pytest.mark.parametrize("how", sorted(SYMLINKS))
def test_symlink_below_the_root_is_never_followed(cache_dir, victim, builds, how):
    plant, expect = SYMLINKS[how]
    model, x, first = compile_block()
    plant(cache_dir, victim, only_entry(cache_dir).key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = rerun(model, x)
    mine = cache_warnings(caught)
    assert len(mine) == 1 and expect in mine[0], mine
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    assert len(builds) == 2, "the entry behind a symlink was used instead of recompiling"


def test_fifo_planted_as_entry_file_does_not_hang(cache_dir, builds):
    """Issue 8.7: a FIFO as meta.json or executable.bin used to block open() forever."""

    def timeout(*_):
        raise TimeoutError("reading a FIFO planted in the cache blocked")

    old = signal.signal(signal.SIGALRM, timeout)
    try:
        for name in ("meta.json", "executable.bin"):
            model, x, first = compile_block(rows=3 if name == "meta.json" else 5)
            entry = next(e for e in DiskStore(str(cache_dir)).entries() if e.key not in builds)
            builds.append(entry.key)  # remember it (keys are never graph names)
            f = os.path.join(entry.path, name)
            os.unlink(f)
            os.mkfifo(f)
            signal.alarm(60)
            with pytest.warns(nc.NeuronCacheWarning, match="not a regular file"):
                out = rerun(model, x)
            signal.alarm(0)
            torch.testing.assert_close(out, first, rtol=0, atol=0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------- damaged entries
CORRUPTIONS = {
    "truncate executable": ("executable.bin", lambda b: b[: len(b) // 2]),
    "flip executable byte": ("executable.bin", lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:]),
    "flip module byte": ("module.mlir", lambda b: b[:50] + bytes([b[50] ^ 0x01]) + b[51:]),
    "truncate metadata": ("meta.json", lambda b: b[: len(b) // 3]),
    "edit metadata value": ("meta.json", lambda b: b.replace(b'"num_ops": ', b'"num_ops": 1', 1)),
    "empty executable": ("executable.bin", lambda b: b""),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_entry_is_recompiled(cache_dir, builds, corruption):
    fname, damage = CORRUPTIONS[corruption]
    model, x, first = compile_block()
    path = os.path.join(only_entry(cache_dir).path, fname)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with pytest.warns(nc.NeuronCacheWarning, match="damaged"):
        out = rerun(model, x)
    torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    assert states() == ["miss", "miss"] and len(builds) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", nc.NeuronCacheWarning)  # the rewritten entry is whole again
        rerun(model, x)
    assert states()[-1] == "hit"


@pytest.mark.parametrize("what", ["executables swapped", "executable of another entry"])
def test_executable_not_matching_its_metadata_is_a_warned_miss(cache_dir, builds, what):
    """Issue 8.7: checksums recomputed, so only the executable's own signature tells (it used to fail at
    run time with RuntimeProgramInputMismatch)."""
    model = Block()
    _, x4, out4 = compile_block(model, rows=4)
    _, x2, out2 = compile_block(model, rows=2)
    store = DiskStore(str(cache_dir))
    sigs = {e.key: store.meta(e.key)["key_summary"]["inputs"] for e in store.entries()}
    k4 = next(k for k, sig in sigs.items() if any(s.startswith("float32[4, 8]") for s in sig))
    k2 = next(k for k, sig in sigs.items() if any(s.startswith("float32[2, 8]") for s in sig))
    parts = {k: store.read_raw(k) for k in (k4, k2)}
    victims = [k4, k2] if what == "executables swapped" else [k4]
    for k in victims:
        other = k2 if k == k4 else k4
        meta, module, _ = parts[k]
        exe = parts[other][2]
        meta = rewrite_meta(meta, files={"executable.bin": {"size": len(exe), "sha256": E.sha256(exe)}})
        store.remove(k)
        store.write(k, meta, module, exe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again4 = rerun(model, x4)
        again2 = rerun(model, x2)
    mine = cache_warnings(caught)
    assert len(mine) == len(victims) and all("damaged" in m and "executable" in m for m in mine), mine
    torch.testing.assert_close(again4, out4, rtol=0, atol=0)
    torch.testing.assert_close(again2, out2, rtol=0, atol=0)


class _Planted:
    """Unpickling this creates ``marker``: if the file ever exists, something loaded a planted pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("where", ["meta.json", "executable.bin", "mega-cache content", "mega-cache parts"])
def test_planted_pickle_is_never_loaded(cache_dir, tmp_path, builds, where):
    marker = str(tmp_path / "pickle-was-loaded")
    evil = pickle.dumps(_Planted(marker))
    model, x, first = compile_block()
    entry = only_entry(cache_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if where == "mega-cache content":
            NeuronCacheArtifact(entry.key, evil).populate_cache()
        elif where == "mega-cache parts":
            NeuronCacheArtifact(entry.key, E.pack(evil, evil, evil)).populate_cache()
        else:
            with open(os.path.join(entry.path, where), "wb") as f:
                f.write(evil)
            out = rerun(model, x)
            torch.testing.assert_close(out, first, rtol=0, atol=0)
    mine = cache_warnings(caught)
    assert len(mine) == 1 and "damaged" in mine[0], mine
    assert not os.path.exists(marker), "a planted pickle was unpickled"


# -------------------------------------------------------------------- unwritable directories
def _read_only(cache_dir, monkeypatch):
    """Works as root too: the cache asks os.access before writing, and root's access() would say yes."""
    real = os.access

    def access(path, mode, *a, **k):
        if str(path).startswith(str(cache_dir)) and mode & os.W_OK:
            return False
        return real(path, mode, *a, **k)

    monkeypatch.setattr(store_mod.os, "access", access)


def _read_only_chmod(cache_dir, monkeypatch):
    if os.getuid() == 0:
        pytest.skip("root ignores directory permissions (the os.access variant covers root)")
    cache_dir.mkdir(mode=0o500)


def _disk_full(cache_dir, monkeypatch):
    def full(*a):  # every entry file is fsync'ed: the first place a full disk reports ENOSPC for sure
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "fsync", full)


def _not_a_dir(cache_dir, monkeypatch):
    cache_dir.parent.joinpath("a_file").write_text("")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(cache_dir.parent / "a_file" / "cache"))


UNWRITABLE = {"read-only": _read_only, "read-only (chmod)": _read_only_chmod, "disk full": _disk_full,
              "not a directory": _not_a_dir}  # fmt: skip


@pytest.mark.parametrize("how", sorted(UNWRITABLE))
def test_unwritable_cache_dir_runs_with_one_warning(cache_dir, monkeypatch, how):
    UNWRITABLE[how](cache_dir, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_train_step(Block(), torch.randn(4, 8, requires_grad=True))
        run_train_step(Block(), torch.randn(3, 8, requires_grad=True))
    mine = cache_warnings(caught)
    assert len(mine) == 1 and "cannot write" in mine[0], mine
    assert states() == ["miss"] * 4
    assert not list(DiskStore(str(cache_dir)).entries())


# --------------------------------------------------------------------- leftovers of killed processes
def _leftover(cache_dir, kind, name, age):
    d = cache_dir / kind / name
    d.mkdir(parents=True)
    (d / "executable.bin").write_bytes(b"x" * 4096)
    old = time.time() - age
    os.utime(d / "executable.bin", (old, old))
    os.utime(d, (old, old))
    return d


def test_stale_leftovers_are_swept_on_open_and_counted(cache_dir, capsys):
    """Issue 8.6: tmp/ and trash/ of killed processes: swept once stale and unlocked, counted meanwhile."""
    compile_block()  # creates the store
    store = DiskStore(str(cache_dir))
    key_busy, key_dead = "a1" * 20, "b2" * 20
    stale = STALE_SECONDS + 60
    dead_tmp = _leftover(cache_dir, "tmp", f"{key_dead}.{uuid.uuid4().hex}", stale)
    dead_trash = _leftover(cache_dir, "trash", f"{key_dead}.{uuid.uuid4().hex}", stale)
    busy_tmp = _leftover(cache_dir, "tmp", f"{key_busy}.{uuid.uuid4().hex}", stale)  # its writer holds the lock
    young_trash = _leftover(cache_dir, "trash", f"{key_dead}.{uuid.uuid4().hex}", 1)

    entries_only = sum(e.size for e in store.entries())
    assert store.total_bytes() >= entries_only + 4 * 4096, "leftovers must count against the size cap"
    d = ["cache", "--dir", str(cache_dir)]
    cli.main([*d, "list"])
    assert "4 leftovers" in capsys.readouterr().out
    cli.main([*d, "stats"])
    assert "leftovers:     4" in capsys.readouterr().out

    holder = filelock.FileLock(str(cache_dir / "locks" / f"{key_busy}.lock"))
    with holder:
        nc.CACHE._swept_roots.discard(store.root)  # a new process opening the directory
        nc.CACHE.store_for(Options.from_user(None))
        assert not dead_tmp.exists() and not dead_trash.exists()
        assert busy_tmp.exists(), "swept a temp dir whose writer still holds the key's lock"
        assert young_trash.exists(), "swept a leftover younger than the bound"
        assert nc.cache_stats()["swept"] == 2
        cli.main([*d, "clear"])
        assert busy_tmp.exists() and not young_trash.exists()
        assert "1 leftovers kept" in capsys.readouterr().out
    cli.main([*d, "clear"])
    assert not busy_tmp.exists()
    assert not store.leftovers() and not list(store.entries())


def test_leftovers_count_against_the_cap(cache_dir):
    compile_block()
    store = DiskStore(str(cache_dir))
    size, key = store.total_bytes(), only_entry(cache_dir).key
    big = _leftover(cache_dir, "tmp", f"{'c3' * 20}.{uuid.uuid4().hex}", 1)  # fresh: not sweepable yet
    (big / "executable.bin").write_bytes(b"x" * (2 * size))
    assert store.evict(int(size * 2.5)) == [key], "entries + leftovers exceed the cap: the entry goes"
    assert big.exists()


# ----------------------------------------------------------------------- processes and imports
def test_three_processes_compile_a_cold_key_once(cache_dir, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [_run(tmp_path, cache_dir, "race", ready, 3, wait=False) for _ in range(3)]
    results = [_result(p) for p in procs]
    flat = [s for r in results for s in r["states"]]
    assert flat.count("miss") == 2, results  # forward + backward graph, each compiled by one process
    assert flat.count("hit") == 4
    assert all(r["err"] <= 1e-5 for r in results)
    persisted = DiskStore(str(cache_dir)).read_stats()
    assert (persisted["misses"], persisted["stores"]) == (2, 2), persisted


_CLI_IMPORTS = """
import sys
from neuron_compile import cli
d = ["cache", "--dir", sys.argv[1]]
for args in (["list"], ["info", sys.argv[2][:8]], ["stats"], ["prune", "--max-size", "1G"], ["clear"]):
    assert cli.main([*d, *args]) == 0, args
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")
               or m.startswith(("neuron_compile.lowering", "neuron_compile.legality")))
print("HEAVY", heavy)
"""


def test_cache_cli_does_not_import_jax_or_the_lowering(cache_dir):
    """Issue 9.3: the cache commands read files; they must not pay for jax and the lowerings."""
    compile_block()
    key = only_entry(cache_dir).key
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_IMPORTS, str(cache_dir), key], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []", proc.stdout[-2000:]
