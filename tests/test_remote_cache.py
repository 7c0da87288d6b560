"""The remote cache tier (cache/remote.py) against a real S3 API: moto's server on 127.0.0.1.

Processes that share a bucket share compiled graphs; racing writers publish one entry; damaged, unsigned
or wrongly signed entries are refused with a warning and recompiled; a remote that dies mid-run costs a
bounded delay and one warning. A TCP proxy in front of the server (``_Proxy``) loses or slows chosen
replies; reads of objects far bigger than they may be are measured in a child process's peak RSS.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
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
import neuron_compile.cache.remote as remote_mod
from neuron_compile import cli
from neuron_compile.cache.key import cache_key
from neuron_compile.cache.remote import (
    MANIFEST,
    RemoteRejected,
    RemoteStore,
    RemoteUnavailable,
)
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


@pytest.mark.extended
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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, cwd=REPO
    )
    assert out.stdout.strip() == "[]", out.stdout


# --------------------------------------------------------------------------- lost and slow replies
_REQUEST = re.compile(rb"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP/1\.1\r\n")


class _Proxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server, on its own event loop in a daemon thread.

    Forwards both ways, except the reply to a request matching a rule ``(method, path regex, action,
    seconds, times)``: ``"hold"`` never forwards it (only a "100 Continue" before it, so that the request
    reaches the server whole) and closes the connection after ``seconds`` (the write landed, its reply is
    lost); ``"trickle"`` forwards it 8 bytes per 0.1 s, for at most
    ``seconds`` (a download slower than any deadline; the client's own read time-out never fires).
    ``times``: how many requests the rule applies to (None: all). ``events``: (time, connection, method or
    "closed", path) for each request and each connection its client closed."""

    def __init__(self, upstream: str, rules: list) -> None:
        self.host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.rules = [list(rule) for rule in rules]
        self.events: list[tuple[float, int, str, str]] = []
        self._ids = itertools.count()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="test-proxy", daemon=True)
        self.thread.start()
        assert started.wait(10)
        self.endpoint = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _rule(self, method: str, path: str):
        for rule in self.rules:
            if rule[0] == method and re.search(rule[1], path) and rule[4] != 0:
                if rule[4] is not None:
                    rule[4] -= 1
                return rule[2], rule[3]
        return None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = next(self._ids)
        self.events.append((time.monotonic(), conn, "open", ""))
        up_r, up_w = await asyncio.open_connection(self.host, self.port)
        action: list = [None]  # for the reply to the last request seen on this connection

        async def to_server() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await client_r.read(65536):
                    for m in _REQUEST.finditer(data):
                        method, path = m.group(1).decode(), m.group(2).decode()
                        self.events.append((time.monotonic(), conn, method, path))
                        action[0] = self._rule(method, path)
                    up_w.write(data)
                    await up_w.drain()
            self.events.append((time.monotonic(), conn, "closed", ""))
            up_w.close()

        async def to_client() -> None:
            try:
                while data := await up_r.read(65536):
                    if action[0] is None:
                        client_w.write(data)
                        await client_w.drain()
                        continue
                    kind, seconds = action[0]
                    while data.startswith(b"HTTP/1.1 100 "):  # "100 Continue" lets the client send its body
                        interim, _, data = data.partition(b"\r\n\r\n")
                        client_w.write(interim + b"\r\n\r\n")
                        data = data or await up_r.read(65536)
                    if kind == "hold":
                        await asyncio.sleep(seconds)
                        return
                    end = time.monotonic() + seconds
                    for i in range(0, len(data), 8):
                        if time.monotonic() > end:
                            return
                        client_w.write(data[i : i + 8])
                        await client_w.drain()
                        await asyncio.sleep(0.1)
            except ConnectionError:
                pass
            finally:
                client_w.close()

        try:
            await asyncio.gather(to_server(), to_client(), return_exceptions=True)
        except asyncio.CancelledError:  # close(): ends quietly
            client_w.close()
            up_w.close()


def test_lost_reply_to_the_manifest_upload_keeps_the_entry(url, s3, s3_endpoint, tmp_path, monkeypatch):
    """The first manifest PUT lands but its reply never comes: the retry finds the manifest, which is the
    publisher's own, so its payload stays and the next host hits (it used to delete its payload: a
    manifest naming nothing, a miss for every host, never repaired)."""
    proxy = _Proxy(s3_endpoint, [("PUT", r"/manifest\.json$", "hold", float(TIMEOUT) + 1.5, 1)])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    try:
        first = compile_here(tmp_path / "a", url)
    finally:
        proxy.close()
    puts = [e for e in proxy.events if e[2] == "PUT" and e[3].endswith(MANIFEST)]
    # retried (by us; aiohttp also resends an idempotent PUT once when a reused connection drops unanswered)
    assert len(puts) >= 2, proxy.events
    assert first["stats"]["remote_stores"] == 1 and not first["warnings"], first
    ((_, names),) = _objects(s3, url).items()
    assert len(names) == 2 and MANIFEST in names, names

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    monkeypatch.setattr(nc.CACHE, "_remotes", {})  # another host: its own connection, not the proxy's
    second = compile_here(tmp_path / "b", url)
    assert second["stats"]["remote_hits"] == 1 and second["stats"]["misses"] == 0, second
    assert second["err"] <= ATOL and not second["warnings"], second


@pytest.mark.parametrize("age", ["young: republished by the reader", "old: removed by the reader"])
def test_manifest_without_its_payload_is_warned_and_repaired(url, s3, tmp_path, monkeypatch, age):
    compile_here(tmp_path / "a", url)
    ((key, _),) = _objects(s3, url).items()
    base = f"{url.removeprefix('s3://')}/{key}"
    payload = json.loads(s3.cat_file(f"{base}/{MANIFEST}"))["payload"]
    s3.rm_file(f"{base}/{payload}")  # as a writer that lost its payload left it

    if age.startswith("old"):  # a reader that proves it dangling clears it, even if it cannot republish
        monkeypatch.setattr(remote_mod, "DANGLING_SECONDS", 0.0, raising=False)
        with pytest.raises(
            RemoteRejected, match=f"names payload {payload}, which does not exist; removed the manifest"
        ):
            RemoteStore(url).fetch(key)
        assert key not in _objects(s3, url)
    else:
        second = compile_here(tmp_path / "b", url)
        assert second["err"] <= ATOL and second["stats"]["misses"] == 1, second
        assert second["stats"]["remote_rejected"] == 1 and second["stats"]["remote_stores"] == 1, second["stats"]
        assert len(second["warnings"]) == 1, second["warnings"]
        assert "is damaged" in second["warnings"][0] and "does not exist" in second["warnings"][0], second["warnings"]
        assert "removed" not in second["warnings"][0]  # young: maybe a filesystem showing files late

    third = compile_here(tmp_path / "c", url)
    assert third["stats"]["remote_hits" if age.startswith("young") else "remote_stores"] == 1, third
    assert not third["warnings"], third["warnings"]
    assert RemoteStore(url).fetch(key) is not None


def test_timed_out_download_is_cancelled_before_the_retry(url, s3, s3_endpoint, monkeypatch):
    """A download slower than its deadline (the server keeps sending, so no read time-out fires) is
    cancelled at the deadline: its connection closed before the retry starts, none left running after the
    call gives up (it used to go on in a thread while the retry started a second one)."""
    key = "ab" * 20
    s3.pipe_file(f"{url.removeprefix('s3://')}/{key}/{MANIFEST}", b"x" * 4000)
    proxy = _Proxy(s3_endpoint, [("GET", rf"/{key}/manifest\.json", "trickle", 12.0, None)])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    try:
        remote = RemoteStore(url)
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            with pytest.raises(RemoteUnavailable, match="no answer within") as failed:
                remote.fetch(key)
        elapsed = time.monotonic() - t0
        time.sleep(1.0)
        events = list(proxy.events)
    finally:
        proxy.close()
    why = (elapsed, str(failed.value), events)
    gets = [(t, conn) for t, conn, method, path in events if method == "GET" and key in path]
    closed = {conn: t for t, conn, method, _ in events if method == "closed"}
    assert gets, why
    for started, conn in gets:  # each stopped at its deadline (the proxy would trickle on for 12 s)
        assert conn in closed and closed[conn] - started < float(TIMEOUT) + 1, why
    for (_, conn), (retry_started, _) in itertools.pairwise(gets):
        assert closed[conn] <= retry_started, why  # never two downloads at once
    assert elapsed < 2 * float(TIMEOUT) + 2, why


# --------------------------------------------------------------------------- huge objects
_PEAK_CHILD = """
import json, sys, warnings
from neuron_compile.cache.remote import RemoteRejected, RemoteStore

def kib(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))

remote = RemoteStore(sys.argv[1])
assert remote.fetch("0" * 40) is None  # s3fs and botocore loaded and connected: a plain miss
try:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak RSS starts again from here
except OSError:
    pass
before = kib("VmRSS")
try:
    remote.fetch(sys.argv[2])
    error = None
except RemoteRejected as e:
    error = str(e)
print(json.dumps({"growth_mib": (kib("VmHWM") - before) / 1024, "error": error}))
"""
HUGE = 200 * 1024**2


@pytest.mark.parametrize("where", ["manifest", "payload"])
def test_huge_object_is_never_read_whole(url, s3, tmp_path, where):
    """A 200 MB object where a manifest or a payload should be: the reader reads at most the bytes it may
    have (the manifest's limit; the size its manifest states), so its memory stays far below the object."""
    key = "cd" * 20
    base = f"{url.removeprefix('s3://')}/{key}"
    if where == "manifest":
        s3.pipe_file(f"{base}/{MANIFEST}", bytes(HUGE))
        expected = "manifest is larger than"
    else:
        payload = f"{uuid.uuid4().hex}.entry"
        manifest = {"format": 1, "key": key, "payload": payload, "size": 1000, "sha256": "0" * 64, "created": 0.0}
        s3.pipe_file(f"{base}/{MANIFEST}", json.dumps(manifest).encode())
        s3.pipe_file(f"{base}/{payload}", bytes(HUGE))
        expected = "payload is larger than the 1000 bytes its manifest says"
    script = tmp_path / "peak.py"
    script.write_text(_PEAK_CHILD)
    # a deadline that would let a whole read finish: the limit, not the clock, must bound it
    env = {**os.environ, "NEURON_COMPILE_CACHE_URL_TIMEOUT": "60"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, str(script), url, key], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert expected in (result["error"] or ""), result
    assert result["growth_mib"] < 32, result  # the object is 200 MiB; reading it whole took >= that


# --------------------------------------------------------------------------- broken filesystems
@pytest.mark.parametrize("broken", ["ftp://127.0.0.1:1/cache", "zip://x", "tar://x", "dir://x"])
def test_filesystem_that_fails_to_set_up_costs_one_warning_not_the_compile(s3, tmp_path, monkeypatch, broken):
    """ftp: the connection is refused while the filesystem is created; zip, tar: the (empty) archive path
    is a directory; dir: no target filesystem. Each used to fail the compile (BackendCompilerFailed)."""
    monkeypatch.chdir(tmp_path)
    runs = [compile_here(tmp_path / "local", broken, shape=(rows, 8)) for rows in (3, 5)]
    assert all(r["err"] <= ATOL and r["stats"]["misses"] == 1 for r in runs), runs
    warned = [w for r in runs for w in r["warnings"]]
    assert len(warned) == 1 and "not usable" in warned[0] and "local cache only" in warned[0], warned
    assert runs[0]["stats"]["remote_errors"] == 1 and runs[1]["stats"]["remote_errors"] == 0, runs
    with pytest.raises(SystemExit) as exit_:
        cli.main(["cache", "--url", broken, "list"])
    message = str(exit_.value.code)
    assert message.startswith("neuron-compile: the remote cache is not usable: ") and "\n" not in message, message
