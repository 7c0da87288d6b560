"""The remote cache tier (cache/remote.py) against a real S3 API: moto's server on 127.0.0.1.

Processes that share a bucket share compiled graphs; racing writers publish one entry; damaged, unsigned
or wrongly signed entries are refused with a warning and recompiled; a remote that dies mid-run costs a
bounded delay and one warning.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import moto.server as moto_server  # the test extra installs moto[server] and s3fs: a missing one is an error
import pytest
import s3fs  # noqa: F401
import torch

import neuron_compile.cache as nc
import neuron_compile.cache.key as key_mod
from neuron_compile import cli
from neuron_compile.cache.key import cache_key
from neuron_compile.cache.remote import MANIFEST, RemoteRejected, RemoteStore
from neuron_compile.cache.store import DiskStore
from neuron_compile.errors import NeuronOptionsError
from neuron_compile.options import Options
from neuron_compile.stats import STATS

REPO = Path(nc.__file__).resolve().parents[2]
ATOL = 1e-6  # elementwise float32: compiled and eager agree to rounding
#: Remote calls time out after this many seconds in these tests (default 10): a dead remote costs ~2x it.
TIMEOUT = "2"
_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def f(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2.0 + 1.0) - x


def _start_server() -> tuple[object, str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server for the module; children inherit the endpoint and fake credentials via env."""
    server, endpoint = _start_server()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _AWS.items():
            mp.setenv(k, v)
        mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        yield endpoint
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    import fsspec

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL_TIMEOUT", TIMEOUT)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_HMAC_KEY", raising=False)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    return fsspec.filesystem("s3", skip_instance_cache=True)


@pytest.fixture
def url(s3):
    """A fresh bucket per test; the cache lives under a prefix, as users configure it."""
    bucket = f"nc-{uuid.uuid4().hex[:12]}"
    s3.mkdir(bucket)
    return f"s3://{bucket}/compile-cache"


@pytest.fixture(autouse=True)
def _fresh_process_state():
    key_mod.source_fingerprint.cache_clear()  # children key like us even while the source is edited
    nc.clear_memory()
    nc.reset_cache_stats()
    STATS.reset()
    yield
    nc.clear_memory()


def _objects(fs, url: str) -> dict[str, list[str]]:
    """key -> object names under the cache URL."""
    root = url.removeprefix("s3://")
    out: dict[str, list[str]] = {}
    for path in fs.find(root):
        key, name = path[len(root) + 1 :].split("/")
        out.setdefault(key, []).append(name)
    return {k: sorted(v) for k, v in out.items()}


def compile_here(local: Path, url: str, shape=(4, 8)) -> dict:
    """Compile ``f`` in this process with its own local cache dir; its result, counters and cache warnings."""
    torch._dynamo.reset()
    nc.clear_memory()
    nc.reset_cache_stats()
    x = torch.randn(*shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="neuron", dynamic=False, options={"cache_dir": str(local), "cache_url": url})(x)
    return {
        "err": (out - f(x)).abs().max().item(),
        "stats": nc.cache_stats(),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, nc.NeuronCacheWarning)],
    }


# --------------------------------------------------------------------------- other processes
_CHILD = """
import json, os, sys, time, warnings
import torch
import neuron_compile.cache as nc
import neuron_compile.compiler as C
import neuron_compile.cache.key as K
from neuron_compile.stats import STATS

# Key like the test process, although other work may edit the package's source (hashed into the key)
# between the children of one test; what is tested here is sharing, not that hash.
K.source_fingerprint = lambda: os.environ["NC_TEST_SOURCE_FINGERPRINT"]

if sys.argv[1] == "race":
    ready, n = sys.argv[2], int(sys.argv[3])
    open(os.path.join(ready, str(os.getpid())), "w").close()
    while len(os.listdir(ready)) < n:
        time.sleep(0.02)
    real = C.build_artifact
    def slow(*a, **k):  # all racers miss, compile and publish at about the same time
        time.sleep(1.0)
        return real(*a, **k)
    C.build_artifact = slow

def f(x):
    return torch.relu(x * 2.0 + 1.0) - x

x = torch.randn(4, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = torch.compile(f, backend="neuron", dynamic=False)(x)
print(json.dumps({
    "states": [g.cache for g in STATS.graphs],
    "err": (out - f(x)).abs().max().item(),
    "stats": nc.cache_stats(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, nc.NeuronCacheWarning)],
}))
"""


def _child(tmp_path: Path, local: Path, url: str, *args: object) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {
        **os.environ,
        "NEURON_COMPILE_CACHE_DIR": str(local),
        "NEURON_COMPILE_CACHE_URL": url,
        "NC_TEST_SOURCE_FINGERPRINT": key_mod.source_fingerprint(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, str(script), *map(str, args or ("plain",))]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_gets_a_remote_hit_without_compiling(url, s3, tmp_path):
    first = _result(_child(tmp_path, tmp_path / "host_a", url))
    assert first["states"] == ["miss"] and first["err"] <= ATOL, first
    assert first["stats"]["remote_misses"] == 1 and first["stats"]["remote_stores"] == 1, first["stats"]
    second = _result(_child(tmp_path, tmp_path / "host_b", url))
    assert second["states"] == ["hit"] and second["err"] <= ATOL, second
    stats = second["stats"]
    assert (stats["misses"], stats["remote_hits"], stats["compile_seconds_spent"]) == (0, 1, 0), stats
    assert not first["warnings"] and not second["warnings"], (first["warnings"], second["warnings"])
    assert len(list(DiskStore(str(tmp_path / "host_b")).entries())) == 1  # copied into the local cache


def test_four_racing_processes_publish_exactly_one_entry(url, s3, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [_child(tmp_path, tmp_path / f"host_{i}", url, "race", ready, 4) for i in range(4)]
    results = [_result(p) for p in procs]
    assert all(r["err"] <= ATOL and not r["warnings"] for r in results), results
    assert sum(r["stats"]["remote_stores"] for r in results) == 1, [r["stats"] for r in results]
    objects = _objects(s3, url)
    assert len(objects) == 1, objects
    ((key, names),) = objects.items()
    assert len(names) == 2 and MANIFEST in names, names  # one manifest and the one payload it names
    assert RemoteStore(url).fetch(key) is not None  # and it is complete


@pytest.mark.parametrize("race", ["published before the upload", "published during the upload"])
def test_losing_writer_leaves_no_payload(url, s3, tmp_path, monkeypatch, race):
    compile_here(tmp_path / "a", url)
    ((key, names),) = _objects(s3, url).items()
    parts = DiskStore(str(tmp_path / "a")).read_raw(key)
    remote = RemoteStore(url)
    if race == "published during the upload":  # the exists() check passes; the create-only write must not
        fs, _ = remote._filesystem()
        monkeypatch.setattr(fs, "exists", lambda path: False)
    assert remote.publish(key, parts) == "exists"
    assert _objects(s3, url) == {key: names}


def _damage(fs, url: str, key: str, how: str) -> None:
    base = f"{url.removeprefix('s3://')}/{key}"
    manifest = json.loads(fs.cat_file(f"{base}/{MANIFEST}"))
    payload = f"{base}/{manifest['payload']}"
    if how == "truncated payload":
        fs.pipe_file(payload, fs.cat_file(payload)[:-100])
    elif how == "bit-flipped payload":
        data = bytearray(fs.cat_file(payload))
        data[len(data) // 2] ^= 0x01
        fs.pipe_file(payload, bytes(data))
    elif how == "bit-flipped manifest checksum":
        manifest["sha256"] = ("0" if manifest["sha256"][0] != "0" else "1") + manifest["sha256"][1:]
        fs.pipe_file(f"{base}/{MANIFEST}", json.dumps(manifest).encode())
    elif how == "size beyond any entry":
        manifest["size"] = 2**50
        fs.pipe_file(f"{base}/{MANIFEST}", json.dumps(manifest).encode())
    elif how == "truncated manifest":
        fs.pipe_file(f"{base}/{MANIFEST}", fs.cat_file(f"{base}/{MANIFEST}")[:20])
    elif how == "payload named by a path":
        manifest["payload"] = "../" + manifest["payload"]
        fs.pipe_file(f"{base}/{MANIFEST}", json.dumps(manifest).encode())
    else:
        raise AssertionError(how)


#: how an entry is damaged -> what the warning must give as the reason (so each check is the one that caught it)
DAMAGES = {
    "truncated payload": "truncated",
    "bit-flipped payload": "payload checksum mismatch",
    "bit-flipped manifest checksum": "payload checksum mismatch",
    "size beyond any entry": "beyond any entry",  # refused before a download with a deadline of days
    "truncated manifest": "unreadable manifest",
    "payload named by a path": "is not one of ours",  # never read: it could name anything in the bucket
}


@pytest.mark.parametrize("how", list(DAMAGES))
def test_damaged_remote_entry_is_ignored_recompiled_and_replaced(url, s3, tmp_path, how):
    compile_here(tmp_path / "a", url)
    ((key, _),) = _objects(s3, url).items()
    _damage(s3, url, key, how)

    second = compile_here(tmp_path / "b", url)
    assert second["err"] <= ATOL
    assert second["stats"]["misses"] == 1 and second["stats"]["remote_rejected"] == 1, (how, second["stats"])
    assert len(second["warnings"]) == 1 and "is damaged" in second["warnings"][0], (how, second["warnings"])
    assert DAMAGES[how] in second["warnings"][0], (how, second["warnings"])
    assert second["stats"]["remote_stores"] == 1, (how, second["stats"])  # the recompiled entry replaced it

    third = compile_here(tmp_path / "c", url)
    assert third["stats"]["remote_hits"] == 1 and not third["warnings"], (how, third)
    names = _objects(s3, url)[key]
    # the replaced payload is deleted when the damaged manifest still names it; otherwise prune's job
    orphaned = how in ("truncated manifest", "payload named by a path")
    assert len(names) == (3 if orphaned else 2), (how, names)


@pytest.mark.parametrize("writer_key", [None, "not-the-fleet-key"], ids=["unsigned", "wrongly signed"])
def test_signing_key_refuses_unsigned_or_wrongly_signed_entries(url, s3, tmp_path, monkeypatch, writer_key):
    if writer_key:
        monkeypatch.setenv("NEURON_COMPILE_CACHE_HMAC_KEY", writer_key)
    compile_here(tmp_path / "a", url)
    ((key, _),) = _objects(s3, url).items()
    before = s3.cat_file(f"{url.removeprefix('s3://')}/{key}/{MANIFEST}")

    monkeypatch.setenv("NEURON_COMPILE_CACHE_HMAC_KEY", "the-fleet-key")
    second = compile_here(tmp_path / "b", url)
    assert second["err"] <= ATOL
    assert second["stats"]["misses"] == 1 and second["stats"]["remote_rejected"] == 1, second["stats"]
    assert len(second["warnings"]) == 1 and "is not trusted" in second["warnings"][0], second["warnings"]
    assert "NEURON_COMPILE_CACHE_HMAC_KEY" in second["warnings"][0]
    # not overwritten: a host with a wrong key must not replace the fleet's entries
    assert s3.cat_file(f"{url.removeprefix('s3://')}/{key}/{MANIFEST}") == before


def test_signed_entry_is_loaded_with_the_same_key(url, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_CACHE_HMAC_KEY", "the-fleet-key")
    compile_here(tmp_path / "a", url)
    second = compile_here(tmp_path / "b", url)
    assert second["stats"]["remote_hits"] == 1 and second["stats"]["misses"] == 0, second["stats"]
    assert second["err"] <= ATOL and not second["warnings"]
    ((key, _),) = _objects(s3, url).items()
    manifest = json.loads(s3.cat_file(f"{url.removeprefix('s3://')}/{key}/{MANIFEST}"))
    manifest["created"] += 1  # any edit of a signed field breaks the signature
    s3.pipe_file(f"{url.removeprefix('s3://')}/{key}/{MANIFEST}", json.dumps(manifest).encode())
    with pytest.raises(RemoteRejected, match="signature does not verify"):
        RemoteStore(url, hmac_key=b"the-fleet-key").fetch(key)


def _hanging_endpoint() -> tuple[socket.socket, str]:
    """Accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("failure", ["server stopped mid-run", "server never answers"])
def test_failing_remote_costs_a_bounded_delay_and_one_warning(s3, tmp_path, monkeypatch, failure):
    url = f"s3://nc-{uuid.uuid4().hex[:12]}/cache"
    if failure == "server stopped mid-run":
        server, endpoint = _start_server()
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
        s3.__class__(skip_instance_cache=True).mkdir(url.removeprefix("s3://").split("/")[0])
        first = compile_here(tmp_path / "local", url, shape=(3, 8))
        assert first["stats"]["remote_stores"] == 1 and not first["warnings"], first
        server.stop()
        hang = None
    else:
        hang, endpoint = _hanging_endpoint()
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    try:
        t0 = time.monotonic()
        runs = [compile_here(tmp_path / "local", url, shape=(rows, 8)) for rows in (5, 6, 7)]
        elapsed = time.monotonic() - t0
    finally:
        if hang is not None:
            hang.close()
    assert all(r["err"] <= ATOL and r["stats"]["misses"] == 1 for r in runs), runs
    warned = [w for r in runs for w in r["warnings"]]
    assert len(warned) == 1 and "not usable" in warned[0] and "local cache only" in warned[0], warned
    assert runs[0]["stats"]["remote_errors"] == 1 and not any(r["stats"]["remote_errors"] for r in runs[1:])
    assert elapsed < 30, f"{failure}: three compiles took {elapsed:.1f}s"


def test_read_only_credentials_stop_publishing_not_reading(url, s3, tmp_path, monkeypatch):
    compile_here(tmp_path / "writer", url, shape=(3, 8))
    remote = nc.CACHE.remote_for(Options.from_user({"cache_url": url}))
    fs, _ = remote._filesystem()

    def denied(path, *args, **kwargs):
        raise PermissionError(f"Access Denied: PutObject {path}")

    monkeypatch.setattr(fs, "pipe_file", denied)
    runs = [compile_here(tmp_path / "reader", url, shape=(rows, 8)) for rows in (3, 5, 6)]
    assert runs[0]["stats"]["remote_hits"] == 1 and not runs[0]["warnings"], runs[0]
    assert all(r["stats"]["misses"] == 1 and r["stats"]["remote_misses"] == 1 for r in runs[1:]), runs
    warned = [w for r in runs for w in r["warnings"]]
    assert len(warned) == 1 and "not allowed to write" in warned[0], warned
    assert remote.down is None  # still read: the next host's entry would be found


def test_cli_lists_counts_and_prunes_the_remote(url, s3, tmp_path, capsys):
    local = tmp_path / "a"
    compile_here(local, url)
    ((key, _),) = _objects(s3, url).items()
    root = url.removeprefix("s3://")
    s3.pipe_file(f"{root}/not-a-key/{MANIFEST}", b"{}")  # not ours: listed never, pruned never
    assert cli.main(["cache", "--url", url, "list"]) == 0
    out = capsys.readouterr().out
    assert "1 entries" in out and key[:16] in out and "published" in out, out
    nc.persistent_stats(str(local))
    assert cli.main(["cache", "--dir", str(local), "--url", url, "stats"]) == 0
    out = capsys.readouterr().out
    assert "1 published" in out and f"{url}: 1 entries" in out, out
    assert cli.main(["cache", "--url", url, "prune", "--older-than", "1h"]) == 0
    assert "removed 0 entries" in capsys.readouterr().out
    assert key in _objects(s3, url)
    assert cli.main(["cache", "--url", url, "prune", "--older-than", "0"]) == 0
    assert "removed 1 entries (2 objects" in capsys.readouterr().out
    assert list(_objects(s3, url)) == ["not-a-key"]
    with pytest.raises(SystemExit, match="by age only"):
        cli.main(["cache", "--url", url, "prune", "--max-size", "1G"])
    with pytest.raises(SystemExit, match="local directory only"):
        cli.main(["cache", "--url", url, "clear"])


def test_local_prune_by_age(tmp_path, capsys):
    local = tmp_path / "local"
    compile_here(local, None)
    store = DiskStore(str(local))
    (entry,) = store.entries()
    os.utime(entry.path, (time.time() - 7200, time.time() - 7200))
    assert cli.main(["cache", "--dir", str(local), "prune", "--older-than", "3h"]) == 0
    assert len(list(store.entries())) == 1
    assert cli.main(["cache", "--dir", str(local), "prune", "--older-than", "1h"]) == 0
    assert "evicted 1 entries" in capsys.readouterr().out and not list(store.entries())


def test_cache_url_option(monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "/var/tmp/neuron-compile-cache")
    with pytest.raises(NeuronOptionsError, match="NEURON_COMPILE_CACHE_URL.*fsspec URL"):
        Options.from_user(None)
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "s3://bucket/prefix")
    assert Options.from_user(None).cache_url == "s3://bucket/prefix"
    assert Options.from_user({"cache_url": None}).cache_url is None
    with pytest.raises(NeuronOptionsError, match="options\\['cache_url'\\]"):
        Options.from_user({"cache_url": "bucket/prefix"})


def test_any_fsspec_url_works_as_the_remote(tmp_path, capsys):
    url = (tmp_path / "shared").as_uri()  # file:///...: e.g. a filesystem mounted on every host
    first = compile_here(tmp_path / "a", url)
    second = compile_here(tmp_path / "b", url)
    assert first["stats"]["remote_stores"] == 1 and not first["warnings"], first
    assert second["stats"]["remote_hits"] == 1 and second["stats"]["misses"] == 0 and second["err"] <= ATOL, second
    assert cli.main(["cache", "--url", url, "list"]) == 0
    assert "1 entries" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_bad_remote_timeout_names_the_variable(monkeypatch, value):
    from neuron_compile.cache.remote import timeout_from_env

    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL_TIMEOUT", value)
    with pytest.raises(NeuronOptionsError, match=f"NEURON_COMPILE_CACHE_URL_TIMEOUT={value!r}.*seconds > 0"):
        timeout_from_env()


def test_cache_url_is_not_part_of_the_key():
    gm = torch.fx.symbolic_trace(f)
    x = [torch.randn(4, 8)]
    keys = {cache_key(gm, x, Options.from_user({"cache_url": u})).digest for u in (None, "s3://a/b", "gs://c/d")}
    assert len(keys) == 1, keys


def test_import_does_not_load_fsspec():
    code = "import sys, neuron_compile; print(sorted(m for m in sys.modules if m.split('.')[0] in {}))".format(
        ("fsspec", "s3fs", "botocore")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout
