"""The shape-keyed compile cache: key stability, disk store, cross-process behaviour, mega-cache, CLI."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import neuron_compile.cache as nc
import neuron_compile.cache.key as key_mod
from neuron_compile import cli
from neuron_compile.cache.key import cache_key
from neuron_compile.cache.store import DiskStore
from neuron_compile.options import Options
from neuron_compile.stats import STATS

RTOL = ATOL = 1e-5  # float32 elementwise ops and small sums


# ----------------------------------------------------------------------------------------- helpers
class Block(torch.nn.Module):
    """Elementwise stand-in for a transformer block (parameters, a nonlinearity, a residual)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width))
        self.b = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.w + self.b) + x


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(d))
    monkeypatch.delenv("NEURON_COMPILE_CACHE_TRUST", raising=False)
    monkeypatch.delenv("NEURON_COMPILE_CACHE_MAX_BYTES", raising=False)
    # The key holds a hash of the package source, computed once per process: recompute it now, so a child
    # process started by this test keys like we do even while the source is being edited.
    key_mod.source_fingerprint.cache_clear()
    nc.clear_memory()
    nc.reset_cache_stats()
    STATS.reset()
    yield d
    nc.clear_memory()


def run_train_step(model, x, options=None):
    """Compiled forward+backward of ``model(x).sum()``; checks output and grads against eager."""
    torch._dynamo.reset()
    xc = x.detach().clone().requires_grad_(x.requires_grad)
    out = torch.compile(model, backend="neuron", dynamic=False, options=options)(xc)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    xe = x.detach().clone().requires_grad_(x.requires_grad)
    ref = model(xe)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(g, p.grad, rtol=RTOL, atol=ATOL)
    model.zero_grad(set_to_none=True)
    return out.detach()


def states():
    return [g.cache for g in STATS.graphs]


def aten_graph(fn, *args):
    return make_fx(fn)(*args)


OPTS = Options.from_user({"target": "cpu"})


def key_of(fn, inputs, opts=OPTS, example=None):
    gm = aten_graph(fn, *inputs)
    return cache_key(gm, list(example if example is not None else inputs), opts).digest


# ------------------------------------------------------------------------------------------ key
def _f(x, w):
    return torch.relu(x * w + 1.5).sum(0)


def _f_other_op(x, w):
    return torch.sigmoid(x * w + 1.5).sum(0)


def _f_other_scalar(x, w):
    return torch.relu(x * w + 2.5).sum(0)


X, W = torch.randn(4, 8), torch.randn(8)
KEY_CHANGES = {
    "shape": lambda: key_of(_f, [torch.randn(5, 8), W]),
    "dtype": lambda: key_of(_f, [X.to(torch.bfloat16), W.to(torch.bfloat16)]),
    "stride": lambda: key_of(_f, [X, W], example=[torch.randn(8, 4).t(), W]),
    "requires_grad": lambda: key_of(_f, [X, W], example=[X, W.clone().requires_grad_()]),
    "op": lambda: key_of(_f_other_op, [X, W]),
    "scalar constant": lambda: key_of(_f_other_scalar, [X, W]),
    "option strict": lambda: key_of(_f, [X, W], opts=Options.from_user({"target": "cpu", "strict": False})),
    "option flags": lambda: key_of(_f, [X, W], opts=Options.from_user({"target": "cpu", "neuron_cc_flags": "-O1"})),
    "generation": lambda: key_of(_f, [X, W], opts=Options.from_user({"target": "cpu", "generation": "trn3"})),
}


def test_key_is_deterministic():
    assert key_of(_f, [X, W]) == key_of(_f, [torch.randn(4, 8), torch.randn(8)])


@pytest.mark.parametrize("change", sorted(KEY_CHANGES))
def test_key_changes_with(change):
    assert KEY_CHANGES[change]() != key_of(_f, [X, W]), f"key did not change with {change}"


def test_neuron_key_changes_with_the_nki_version(monkeypatch):
    """On the neuron target the real nki decides what a kernel site is (its compiled kernel, or without it
    the reference StableHLO), so its version is in the key there; the CPU target never uses it."""
    monkeypatch.setattr(key_mod, "_neuronx_cc_version", lambda generation: "2.0-test")
    neuron = Options.from_user({"target": "neuron"})
    keys = {}
    for version in ("0.6.0", "0.7.0", "none"):
        monkeypatch.setattr(key_mod, "nki_version", lambda version=version: version)
        keys[version] = key_of(_f, [X, W], opts=neuron)
        assert key_mod.package_versions("neuron", "trn2")["nki"] == version
    assert len(set(keys.values())) == 3, keys
    assert "nki" not in key_mod.package_versions("cpu", "trn2")


def test_nki_version_is_none_when_the_emulator_is_forced(monkeypatch):
    """NEURON_COMPILE_NKI=emulator keeps an installed nki unused (kernels/nki_api.py): the key says so."""
    monkeypatch.setenv("NEURON_COMPILE_NKI", "emulator")
    assert key_mod.nki_version() == "none"


def test_key_changes_with_versions_and_tag(monkeypatch):
    base = key_of(_f, [X, W])
    import neuron_compile.cache.key as key_mod

    real = key_mod.package_versions
    monkeypatch.setattr(key_mod, "package_versions", lambda *a: {**real(*a), "torch": "9.9.9"})
    assert key_of(_f, [X, W]) != base, "key did not change with the torch version"
    monkeypatch.setattr(key_mod, "package_versions", real)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert key_of(_f, [X, W]) != base, "key did not change with XLA_FLAGS (the CPU target's compiler flags)"
    monkeypatch.delenv("XLA_FLAGS")
    # torch's own patch(): monkeypatch.setattr on a config module deletes the entry on undo (pytest >= 9.1)
    with torch.compiler.config.patch(cache_key_tag="my-tag"):
        assert key_of(_f, [X, W]) != base, "key did not change with cache_key_tag"


CONSTANT_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int64, torch.uint16, torch.bool, torch.complex64,
]  # fmt: skip


@pytest.mark.parametrize("dtype", CONSTANT_DTYPES, ids=str)
def test_constants_of_every_dtype_hash(dtype):
    """Issue 11: an empty bf16 constant crashed the key (numpy has no bfloat16). Every dtype, empty and
    non-contiguous constants key by value."""
    from neuron_compile.cache.key import _tensor_fingerprint

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
    other = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1).to(dtype)
    cases = {
        "empty": torch.empty(0, dtype=dtype),
        "empty 2-d": torch.empty(0, 4, dtype=dtype),
        "contiguous": base,
        "transposed": base.t(),
        "strided slice": base[:, ::2],
    }
    prints = {name: _tensor_fingerprint(t) for name, t in cases.items()}
    assert len({p for p in prints.values()}) == len(cases), prints  # shape/stride/bytes tell them apart
    assert _tensor_fingerprint(other) != prints["contiguous"], f"{dtype}: different values, same key"
    assert _tensor_fingerprint(base.clone()) == prints["contiguous"], f"{dtype}: same values, different key"
    if dtype not in (torch.bool, torch.uint16):

        class WithConst(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("c", torch.empty(0, dtype=dtype))

            def forward(self, x):
                return x + self.c.numel()

        gm = torch.fx.symbolic_trace(WithConst())
        cache_key(gm, [torch.randn(2)], OPTS)  # a real graph with an empty constant of this dtype keys


def test_key_includes_baked_constant_values():
    # (key level: the interpreter does not lower get_attr constants yet, so no end-to-end run here)
    c1, c2, same_as_c1 = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0])

    def mul_by(c):
        return lambda x: x * c

    graphs = {name: aten_graph(mul_by(c), torch.randn(3, 2)) for name, c in
              (("c1", c1), ("c2", c2), ("same", same_as_c1))}  # fmt: skip
    assert all(any(n.op == "get_attr" for n in g.graph.nodes) for g in graphs.values())
    keys = {name: cache_key(g, [torch.randn(3, 2)], OPTS).digest for name, g in graphs.items()}
    assert keys["c1"] != keys["c2"]
    assert keys["c1"] == keys["same"]


_MODEL_SRC = """
import torch
{pad}
class {cls}(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.{w} = torch.nn.Parameter(torch.randn(8))
        self.{b} = torch.nn.Parameter(torch.randn(8))

    def forward(self, inp):
        {tmp} = torch.relu(inp * self.{w} + self.{b})
        return {tmp} + inp
"""


def _load_model(tmp_path, name, **names):
    path = tmp_path / f"{name}.py"
    path.write_text(_MODEL_SRC.format(**names))
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns[names["cls"]]()


def test_key_ignores_node_module_and_file_names(cache_dir, tmp_path, builds):
    a = _load_model(tmp_path, "model_a", pad="", cls="Block", w="w", b="b", tmp="h")
    b = _load_model(tmp_path, "other_file", pad="\n" * 40, cls="Layer", w="scale", b="shift", tmp="y_1")
    x = torch.randn(4, 8, requires_grad=True)
    run_train_step(a, x)
    assert len(builds) == 2
    run_train_step(b, x)
    assert len(builds) == 2, "a renamed copy of the model in another file recompiled"
    assert states() == ["miss", "miss", "hit", "hit"]


# ------------------------------------------------------------------------------------- in-process
def test_hit_miss_counted_and_logged(cache_dir, builds, caplog):
    model, x = Block(), torch.randn(4, 8, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="neuron_compile.cache"):
        run_train_step(model, x)
        run_train_step(model, x)
    assert states() == ["miss", "miss", "hit", "hit"]
    text = caplog.text
    assert "neuron cache: miss" in text and "neuron cache: hit (memory)" in text
    s = nc.cache_stats()
    assert (s["misses"], s["hits"], s["memory_hits"], s["stores"]) == (2, 2, 2, 2)
    assert nc.persistent_stats(str(cache_dir))["misses"] == 2
    assert torch._logging._internal.log_registry.is_log("neuron_cache")

    nc.clear_memory()  # the next compile must come from disk
    run_train_step(model, x)
    assert states()[-2:] == ["hit", "hit"] and len(builds) == 2
    assert nc.cache_stats()["disk_hits"] == 2
    entries = list(DiskStore(str(cache_dir)).entries())
    assert len(entries) == 2
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700


def test_regional_six_identical_blocks_compile_once(cache_dir, builds):
    class GuardedBlock(Block):
        # A per-instance attribute Dynamo guards on makes it compile each block separately (as
        # happens across processes or after a recompile), while the aten graphs stay identical.
        def __init__(self, idx):
            super().__init__()
            self.idx = idx

        def forward(self, x):
            y = torch.relu(x * self.w + self.b)
            return y + x if self.idx >= 0 else y - x

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([GuardedBlock(i) for i in range(6)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Stack()
    for layer in model.layers:
        layer.compile(backend="neuron")
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert len(STATS.graphs) == 12, "expected Dynamo to compile each of the 6 blocks (fw+bw)"
    assert len(builds) == 2, f"the block graph was compiled {len(builds)} times"
    assert states().count("hit") == 10
    ref_layers = [lambda t, lay=lay: torch.relu(t * lay.w + lay.b) + t for lay in model.layers]
    xe = x.detach().clone().requires_grad_()
    ref = xe
    for fn in ref_layers:
        ref = fn(ref)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(g, p.grad, rtol=RTOL, atol=ATOL)


def test_world_writable_dir_refused_unless_trusted(cache_dir, builds):
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o777)
    model, x = Block(), torch.randn(4, 8, requires_grad=True)
    with pytest.warns(nc.NeuronCacheWarning, match="not using .* writable by other users"):
        run_train_step(model, x)
    assert not list(DiskStore(str(cache_dir)).entries()), "wrote into an untrusted directory"

    nc.clear_memory()
    with pytest.warns(nc.NeuronCacheWarning, match="explicitly trusted"):
        run_train_step(model, x, options={"trust_cache_dir": True})
    assert len(list(DiskStore(str(cache_dir)).entries())) == 2


@pytest.mark.parametrize("via", ["root", "ancestor"])
def test_symlinked_cache_dir_is_judged_where_it_resolves(tmp_path, via):
    # safe/cache -> ww/cache (or safe/link -> ww, root safe/link/cache) with ww/ writable by everyone and no
    # sticky bit: ww/cache itself was refused, the link to it accepted.
    from neuron_compile.cache.trust import dir_untrusted_reason

    safe, ww = tmp_path / "safe", tmp_path / "ww"
    safe.mkdir(mode=0o700)
    (ww / "cache").mkdir(parents=True, mode=0o700)
    os.chmod(ww, 0o777)
    if via == "root":
        (safe / "cache").symlink_to(ww / "cache")
    else:
        (safe / "link").symlink_to(ww)
    root = str(safe / "cache") if via == "root" else str(safe / "link" / "cache")
    direct = dir_untrusted_reason(str(ww / "cache"))
    assert direct and "writable by everyone without the sticky bit" in direct
    reason = dir_untrusted_reason(root)
    assert reason and "writable by everyone without the sticky bit" in reason, reason
    if via == "root":  # (a link among the ancestors was judged already: os.stat follows it)
        assert f"its parent {ww} is writable" in reason and f"resolves to {ww / 'cache'}" in reason, reason
    assert DiskStore(root).untrusted_reason() == reason
    os.chmod(ww, 0o1777)  # sticky: others cannot swap our directory
    assert dir_untrusted_reason(root) is None


def test_symlinked_cache_dir_refused_through_torch_compile(tmp_path, monkeypatch, cache_dir):
    ww = tmp_path / "ww"
    (ww / "cache").mkdir(parents=True, mode=0o700)
    os.chmod(ww, 0o777)
    cache_dir.symlink_to(ww / "cache")
    with pytest.warns(nc.NeuronCacheWarning, match="writable by everyone without the sticky bit"):
        run_train_step(Block(), torch.randn(4, 8, requires_grad=True))
    assert not os.listdir(ww / "cache"), "wrote into a directory others can swap"


def test_cache_dir_link_owned_by_another_user_refused(tmp_path, monkeypatch):
    from neuron_compile.cache import trust

    (tmp_path / "mine").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    real_lstat = os.lstat

    def lstat(path, *a, **k):  # the link as another user would own it
        st = real_lstat(path, *a, **k)
        if os.fspath(path) == str(tmp_path / "link"):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 4242, st.st_gid, *st[6:10]))
        return st

    monkeypatch.setattr(trust.os, "lstat", lstat)
    reason = trust.dir_untrusted_reason(str(tmp_path / "link"))
    assert reason and "symbolic link owned by uid 4242" in reason, reason
    assert trust.dir_untrusted_reason(str(tmp_path / "mine")) is None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the directory to another user")
def test_dir_owned_by_another_user_refused(cache_dir):
    cache_dir.mkdir(mode=0o700)
    os.chown(cache_dir, 65534, 65534)
    with pytest.warns(nc.NeuronCacheWarning, match="owned by uid 65534"):
        run_train_step(Block(), torch.randn(4, 8, requires_grad=True))
    assert states() == ["miss", "miss"]


def test_eviction_keeps_dir_under_cap(cache_dir):
    model = Block(width=8)
    store = DiskStore(str(cache_dir))

    def compile_rows(rows, cap=None):
        torch._dynamo.reset()
        x = torch.randn(rows, 8)
        with torch.no_grad():
            out = torch.compile(model, backend="neuron", dynamic=False, options={"cache_max_bytes": cap})(x)
            torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)
        inputs = [store.meta(e.key)["key_summary"]["inputs"] for e in store.entries()]
        return {next(s.split(" stride")[0] for s in sig if s.endswith(", 8]") or ", 8] " in s) for sig in inputs}

    compile_rows(1)
    cap = int(store.total_bytes() * 3.5)  # room for three entries of this size
    compile_rows(2, cap)
    compile_rows(3, cap)
    nc.clear_memory()
    compile_rows(1, cap)  # a disk hit: now the most recently used entry
    assert compile_rows(4, cap) == {"float32[1, 8]", "float32[3, 8]", "float32[4, 8]"}
    assert store.total_bytes() <= cap
    for rows in (5, 6, 7):
        assert "float32[%d, 8]" % rows in compile_rows(rows, cap)
        assert store.total_bytes() <= cap
    assert nc.cache_stats()["evictions"] == 4


def test_cli(cache_dir, capsys):
    run_train_step(Block(), torch.randn(4, 8, requires_grad=True))
    store = DiskStore(str(cache_dir))
    keys = [e.key for e in store.entries()]
    d = ["cache", "--dir", str(cache_dir)]
    assert cli.main([*d, "list"]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and "KiB" in out and "ago" in out
    assert cli.main([*d, "info", keys[0][:10]]) == 0
    out = capsys.readouterr().out
    assert keys[0] in out and "float32[" in out and "torch" in out
    assert cli.main([*d, "info", keys[0], "--stablehlo"]) == 0
    assert "stablehlo" in capsys.readouterr().out
    nc.persistent_stats(str(cache_dir))
    assert cli.main([*d, "stats"]) == 0
    out = capsys.readouterr().out
    assert "misses:        2" in out and "saved" in out
    assert cli.main([*d, "prune", "--max-size", "1K"]) == 0
    assert "evicted 2 entries" in capsys.readouterr().out
    nc.clear_memory()
    run_train_step(Block(), torch.randn(4, 8, requires_grad=True))
    assert len(list(store.entries())) == 2
    assert cli.main([*d, "clear"]) == 0
    assert not list(store.entries())


# ------------------------------------------------------------------------------- other processes
_SCRIPT = """
import json, os, sys, time
import torch
import neuron_compile.cache as nc
import neuron_compile.compiler as C
from neuron_compile.stats import STATS

mode = sys.argv[1]
torch.manual_seed(0)
w, b = torch.randn(8), torch.randn(8)
x = torch.randn(4, 8)

def f(x, w, b):
    return torch.relu(x * w + b) + x

if mode == "megacache-load":
    with open(sys.argv[2], "rb") as fh:
        info = torch.compiler.load_cache_artifacts(fh.read())
    assert info is not None, "load_cache_artifacts failed"
if mode == "race":
    # start together: wait until all racers are up, and widen the window in which all of them miss
    ready = sys.argv[2]
    open(os.path.join(ready, str(os.getpid())), "w").close()
    while len(os.listdir(ready)) < int(sys.argv[3]):
        time.sleep(0.02)
    real = C.build_artifact
    def slow(*a, **k):
        time.sleep(1.0)
        return real(*a, **k)
    C.build_artifact = slow
ws, bs, xs = (t.clone().requires_grad_() for t in (w, b, x))
out = torch.compile(f, backend="neuron", dynamic=False)(xs, ws, bs)
out.sum().backward()
ref_in = [t.clone().requires_grad_() for t in (x, w, b)]
ref = f(*ref_in)
ref.sum().backward()
err = max((out - ref).abs().max().item(), *((a.grad - r.grad).abs().max().item() for a, r in zip((xs, ws, bs), ref_in)))
print(json.dumps({"states": [g.cache for g in STATS.graphs], "err": err, "stats": nc.cache_stats()}))
"""


def _run(tmp_path, cache, *args, wait=True):
    script = tmp_path / "child.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "NEURON_COMPILE_CACHE_DIR": str(cache)}
    cmd = [sys.executable, str(script), *map(str, args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _result(proc) if wait else proc


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_fresh_process_hits(cache_dir, tmp_path):
    assert _run_same_as_script() == ["miss", "miss"]
    second = _run(tmp_path, cache_dir, "plain")
    assert second["states"] == ["hit", "hit"], second
    assert second["stats"]["disk_hits"] == 2 and second["err"] <= 1e-5


def test_megacache_round_trip(cache_dir, tmp_path):
    torch.compiler.save_cache_artifacts()  # drop what earlier tests recorded from the next blob
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        nc.CACHE.recorded.clear()
        first = _run_same_as_script()
        saved = torch.compiler.save_cache_artifacts()
    assert saved is not None
    blob, info = saved
    assert len(info.artifacts["neuron_compile"]) == 2
    path = tmp_path / "mega.bin"
    path.write_bytes(blob)
    empty = tmp_path / "empty_cache"
    result = _run(tmp_path, empty, "megacache-load", path)
    assert result["states"] == ["hit", "hit"], result
    assert result["err"] <= 1e-5
    assert first == ["miss", "miss"]


def _run_same_as_script():
    """What the child script compiles, compiled here (same graph, shapes, options: same keys)."""
    torch.manual_seed(0)
    w, b, x = torch.randn(8), torch.randn(8), torch.randn(4, 8)

    def f(x, w, b):
        return torch.relu(x * w + b) + x

    args = [t.clone().requires_grad_() for t in (x, w, b)]
    torch.compile(f, backend="neuron", dynamic=False)(*args).sum().backward()
    return states()


def test_megacache_damaged_blob_is_skipped(cache_dir):
    from neuron_compile.cache.megacache import NeuronCacheArtifact

    with pytest.warns(nc.NeuronCacheWarning, match="damaged"):
        NeuronCacheArtifact("0" * 40, b"NCCE" + b"\0" * 30).populate_cache()
    assert not list(DiskStore(str(cache_dir)).entries())


@pytest.mark.parametrize(
    "sizes, kept",
    [
        ([30, 30, 30], ["a", "b", "c"]),
        ([60, 30, 30], ["b", "c"]),  # 120 bytes > 100: the least recently used goes
        ([30, 30, 30, 30, 30], ["c", "d", "e"]),  # (max_bytes binds before the 4-entry capacity)
        ([10, 10, 10, 10, 10], ["b", "c", "d", "e"]),  # the entry capacity binds
        ([30, 150], ["b"]),  # the newest stays, however large: its graph is in use
    ],
)
def test_memory_layer_is_bounded_by_entries_and_bytes(sizes, kept):
    """The in-process layer is all that holds the executables of graphs gone (deleted model, reset): it
    keeps the most recently used within both bounds."""
    from types import SimpleNamespace

    from neuron_compile.cache.memory import MemoryLRU

    memory = MemoryLRU(capacity=4, max_bytes=100)
    for key, size in zip("abcde", sizes):
        memory.put(key, SimpleNamespace(loaded=object(), executable=b"x" * size))
    assert [k for k in "abcde" if memory.get(k) is not None] == kept, sizes
