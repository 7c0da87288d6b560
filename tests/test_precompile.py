"""``neuron-compile precompile`` (neuron_compile/precompile.py) and "why did this miss" (cache explain).

The fleet's path end to end on the device simulator: a script collected on the CPU target (no neuronx-cc on
PATH), compiled by the fake neuronx-cc N at a time, then run on the simulated neuron target in a fresh
process that invokes the compiler zero times (its compile log), against the same local cache and, from a
second "host" (another cache dir), against a moto S3 remote cache.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.device_sim as device_sim
from neuron_compile import precompile
from neuron_compile.cache import key as key_mod
from neuron_compile.cache.compile_cache import describe_differences
from neuron_compile.cache.key import key_differences, part_name

from .test_remote_cache import s3, s3_endpoint, url  # noqa: F401 - the moto S3 fixtures

REPO = device_sim.REPO_ROOT

#: A model-zoo training script (a conv net: the CPU target keeps its activations channels-last, the neuron
#: target does not, and the backward's key must still be the neuron run's). Prints compiles, hits, loss.
ZOO_SCRIPT = """\
import sys
import torch
from tests import model_zoo
from neuron_compile.stats import STATS
torch.manual_seed(0)
case = getattr(model_zoo, sys.argv[1])()
compiled = torch.compile(case.model, backend="neuron", dynamic=False)
opt = torch.optim.SGD(case.model.parameters(), lr=0.01)
for _ in range(2):
    loss, _ = case.step(compiled, case.inputs)
    loss.backward(); opt.step(); opt.zero_grad()
print("RESULT", sum(g.cache == "miss" for g in STATS.graphs), sum(g.cache == "hit" for g in STATS.graphs), float(loss.detach()))
"""

#: N inference graphs (one per shape bucket), from one source line each: for parallelism, shards, failures.
BUCKETS_SCRIPT = """\
import logging, os, sys
if os.environ.get("LOG"):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import torch
from neuron_compile.stats import STATS
f = torch.compile(lambda x: torch.relu(x * 2.0 + 1.0).sum(0), backend="neuron", dynamic=False)
with torch.no_grad():
    outs = [f(torch.ones(n, 3)) for n in range(1, int(sys.argv[1]) + 1)]
print("RESULT", sum(g.cache == "miss" for g in STATS.graphs), sum(g.cache == "hit" for g in STATS.graphs), [float(o.sum()) for o in outs])
"""


def _env(tmp_path: Path, cache: str = "cache", sim: bool = False, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_COMPILE_", "NRTSIM_"))}
    env.update({"NEURON_COMPILE_CACHE_DIR": str(tmp_path / cache), "PYTHONPATH": str(REPO)})
    if sim:
        env.update(device_sim.environment(tmp_path / "state"))
    else:  # collecting needs no Neuron tool at all: neither compiler nor runtime on PATH
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "nrtsim" not in p)
    env.update(extra)
    return env


def _run(
    cmd: list[str], env: dict[str, str], cwd: Path, ok: bool = True, timeout: float = 900
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuron_compile.cli", *args]


def _fingerprint() -> str:
    return key_mod.source_fingerprint.__wrapped__()


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SCRIPTS = {
    # the demo trains a small transformer (SDPA, layer norm, embeddings)
    "demo": lambda tmp: [sys.executable, "-m", "neuron_compile.demo", "--steps", "2", "--layers", "1"],
    "zoo_resnet": lambda tmp: [sys.executable, str(_script(tmp, "zoo_train.py", ZOO_SCRIPT)), "resnet"],
}


def _fleet(tmp_path: Path, script: list[str], url: str) -> dict:
    """collect (CPU, no Neuron tool) -> compile --jobs 4 into the local and remote cache -> check -> the real
    run on the simulated neuron target, on this host and on a second host with its own (empty) cache dir."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    manifest = tmp_path / "pre" / "manifest.json"
    collected = _run(
        _cli("precompile", "collect", "--manifest", str(manifest), "--", *script), _env(tmp_path), tmp_path
    )
    graphs = precompile.read_manifest(str(manifest))
    before = _run(_cli("precompile", "check", str(manifest)), _env(tmp_path, sim=True), tmp_path, ok=False)
    sim = _env(tmp_path, sim=True, NRTSIM_COMPILE_DELAY="0.1", NEURON_COMPILE_CACHE_URL=url)
    _run(_cli("precompile", "compile", str(manifest), "--jobs", "4"), sim, tmp_path)
    compiled = device_sim.compiler_invocations(tmp_path / "state")
    after = _run(_cli("precompile", "check", str(manifest), "--cache-url", url), _env(tmp_path, sim=True), tmp_path)
    runs = {}
    for host, cache in (("same host", "cache"), ("second host", "cache_host2")):
        env = _env(tmp_path, cache=cache, sim=True, NEURON_COMPILE_TARGET="neuron", NEURON_COMPILE_CACHE_URL=url)
        proc = _run(script, env, tmp_path)
        runs[host] = (device_sim.compiler_invocations(tmp_path / "state") - compiled, proc.stdout)
        compiled = device_sim.compiler_invocations(tmp_path / "state")
    return dict(collected=collected, graphs=graphs, before=before, after=after, compiled=compiled, runs=runs)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.extended) if n == "zoo_resnet" else n for n in sorted(SCRIPTS)]
)
def test_collect_compile_then_the_neuron_run_compiles_nothing(tmp_path, url, name) -> None:
    fingerprint = _fingerprint()
    out = _fleet(tmp_path, SCRIPTS[name](tmp_path), url)
    # neuron_compile's source fingerprint is part of the key: an edit mid-test makes the run miss, rightly
    assert _fingerprint() == fingerprint, "neuron_compile's source changed during the test; run it again"
    graphs = out["graphs"]
    assert len(graphs) >= 2 and all(r.error is None for r in graphs.values()), out["collected"].stdout
    assert all(r.summary["target"] == "neuron" and r.source != "<unknown source line>" for r in graphs.values())
    # before compiling: every graph named as missing, with its source line, and a non-zero exit
    assert out["before"].returncode == 1
    for r in graphs.values():
        assert re.search(rf"MISS .* {re.escape(r.name)} .*{re.escape(r.source)}", out["before"].stdout), out[
            "before"
        ].stdout
    assert "coverage: 100.0%" not in out["before"].stdout and f"coverage: 0/{len(graphs)}" in out["before"].stdout
    assert f"coverage: {len(graphs)}/{len(graphs)} graphs (100.0%)" in out["after"].stdout
    for host, (compiles, stdout) in out["runs"].items():
        assert compiles == 0, f"{name} on the {host}: {compiles} neuronx-cc runs\n{stdout[-2000:]}"
    if name == "zoo_resnet":  # the counted compiles of the run itself, and its loss equals the collecting run's
        collected_loss = out["collected"].stdout.split("RESULT")[1].split()
        for host, (_, stdout) in out["runs"].items():
            misses, hits, loss = stdout.split("RESULT")[1].split()
            assert (misses, hits) == ("0", str(len(graphs))), (host, stdout)
            assert abs(float(loss) - float(collected_loss[2])) <= 1e-5 * abs(float(loss)), (host, loss, collected_loss)


@pytest.fixture(scope="module")
def buckets(tmp_path_factory) -> Path:
    """A manifest of 8 one-line graphs, collected once for the module's tests."""
    tmp = tmp_path_factory.mktemp("buckets")
    script = _script(tmp, "buckets.py", BUCKETS_SCRIPT)
    manifest = tmp / "pre" / "manifest.json"
    _run(
        _cli("precompile", "collect", "--manifest", str(manifest), "--", sys.executable, str(script), "8"),
        _env(tmp),
        tmp,
    )
    return manifest


@pytest.mark.extended
def test_eight_graphs_of_four_seconds_compile_in_about_two_rounds_with_four_jobs(tmp_path, buckets) -> None:
    """The same 8 compiles without and with a 4 s delay each: the delay adds about two rounds (8 s), where
    one compiler at a time would add 32 s. (The difference leaves out starting the fake compiler, python +
    jax, which on a machine shared by several jobs costs as much as the delay.)"""
    walls = {}
    for delay in ("0", "4"):
        env = _env(tmp_path, cache=f"cache{delay}", sim=True, NRTSIM_COMPILE_DELAY=delay)
        t0 = time.monotonic()
        proc = _run(_cli("precompile", "compile", str(buckets), "--jobs", "4"), env, tmp_path)
        walls[delay] = time.monotonic() - t0
        assert "8 compiled, 0 already cached, 0 failed" in proc.stderr, proc.stderr
    assert device_sim.compiler_invocations(tmp_path / "state") == 16
    added = walls["4"] - walls["0"]
    print(f"8 graphs, --jobs 4: {walls['0']:.1f} s wall without delay, {walls['4']:.1f} s with 4 s each "
          f"(+{added:.1f} s; serial: +32 s)")  # fmt: skip
    assert added < 14, f"the 4 s delays added {added:.1f}s: not parallel (two rounds: 8 s; serial: 32 s)"
    again = _run(_cli("precompile", "compile", str(buckets), "--jobs", "4"), env, tmp_path)
    assert "0 to compile, 8 already cached" in again.stderr  # resumable: what is stored is not compiled again


def test_two_shards_cover_every_key_exactly_once(tmp_path, buckets, monkeypatch) -> None:
    device_sim.activate(monkeypatch, tmp_path / "state")
    graphs = precompile.read_manifest(str(buckets))
    done = []
    for i in range(2):
        result = precompile.compile_manifest(str(buckets), jobs=2, shard=(i, 2), cache_dir=str(tmp_path / f"host{i}"),
                                             cache_url="", out=io.StringIO())  # fmt: skip
        assert not result.failed and not result.already
        done.append(set(result.compiled))
    versions = precompile.host_versions(with_nki=False)
    assert done[0].isdisjoint(done[1]) and len(done[0]) == len(done[1]) == 4
    assert done[0] | done[1] == {precompile.resolve(r, versions)[0] for r in graphs.values()}


@pytest.mark.extended
def test_a_failing_graph_is_listed_with_the_compiler_message_and_the_others_finish(tmp_path, buckets) -> None:
    graphs = sorted(precompile.read_manifest(str(buckets)).values(), key=lambda r: r.name)
    bad = graphs[3]
    from tests.device_sim.neuronx_cc import module_digest  # of the module in whatever form neuronx-cc is given it

    digest = module_digest(precompile.read_object(str(buckets), bad.module, ".mlir").decode())
    env = _env(tmp_path, sim=True, NRTSIM_COMPILE_FAIL=digest[:16])
    proc = _run(_cli("precompile", "compile", str(buckets), "--jobs", "3"), env, tmp_path, ok=False)
    assert proc.returncode == 1, proc.stderr
    assert "7 compiled, 0 already cached, 1 failed" in proc.stderr, proc.stderr
    failed = proc.stderr.split(f"FAILED {bad.name} ", 1)[1]
    assert bad.source in failed.splitlines()[0] and "NCC_SIM006" in failed, proc.stderr
    check = _run(_cli("precompile", "check", str(buckets)), env, tmp_path, ok=False)
    assert check.returncode == 1 and "coverage: 7/8 graphs (87.5%)" in check.stdout, check.stdout
    assert re.search(rf"MISS .* {re.escape(bad.name)} .*{re.escape(bad.source)}", check.stdout), check.stdout


@pytest.mark.extended
def test_a_run_with_a_changed_option_says_which_key_part_differs(tmp_path, buckets) -> None:
    sim = _env(tmp_path, sim=True)
    _run(_cli("precompile", "compile", str(buckets), "--jobs", "4"), sim, tmp_path)
    script = buckets.parent.parent / "buckets.py"
    env = _env(tmp_path, sim=True, NEURON_COMPILE_TARGET="neuron", NEURON_COMPILER_OPT_LEVEL="3", LOG="1")
    proc = _run([sys.executable, str(script), "1"], env, tmp_path)
    why = [line for line in proc.stderr.splitlines() if "missed:" in line]
    assert why and "options: options.opt_level 3 here, 2 there" in why[0], proc.stderr[-3000:]
    # on demand: the new entry against the precompiled one
    key = re.search(r"why ([0-9a-f]{12}) missed", why[0]).group(1)
    explained = _run(_cli("cache", "explain", key), sim, tmp_path)
    assert "options.opt_level 3 here, 2 there" in explained.stdout, explained.stdout


# ----------------------------------------------------------------------------------- key parts, units
@pytest.mark.parametrize(
    "change, path, part",
    [
        (lambda s: s["options"].update(opt_level=3), "options.opt_level", "options"),
        (
            lambda s: s["options"].update(neuron_cc_flags=["--enable-saturate-infinity"]),
            "options.neuron_cc_flags",
            "flags",
        ),
        (lambda s: s["options"].update(generation="trn3"), "options.generation", "generation"),
        (lambda s: s["versions"].update({"neuronx-cc": "2.1"}), "versions.neuronx-cc", "versions"),
        (lambda s: s.update(target="cpu"), "target", "target"),
        (lambda s: s["inputs"].__setitem__(0, "float32[4, 4] stride=(4, 1) cpu"), "inputs[0]", "input shapes/dtypes"),
        (lambda s: s.update(graph="0" * 40), "graph", "graph"),
    ],
    ids=["opt_level", "flags", "generation", "compiler_version", "target", "input_shape", "graph"],
)
def test_key_differences_name_the_part(change, path, part) -> None:
    summary = {"format": 3, "target": "neuron", "graph": "a" * 40, "inputs": ["float32[8, 4] stride=(4, 1) cpu"],
               "options": {"generation": "trn2", "opt_level": 2, "neuron_cc_flags": []},
               "versions": {"neuronx-cc": "2.0"}, "tag": ""}  # fmt: skip
    other = json.loads(json.dumps(summary))
    change(other)
    diffs = key_differences(other, summary)
    assert [d[0] for d in diffs] == [path] and part_name(path) == part
    assert describe_differences(diffs).startswith(f"{part}: {path} ")
    assert key_mod.key_digest(other) != key_mod.key_digest(summary)


def test_resolve_puts_this_hosts_compiler_version_into_the_key() -> None:
    summary = {"format": 3, "graph": "b" * 40, "versions": {"neuronx-cc": "neuronx-cc-unavailable", "torch": "x"}}
    record = precompile.Recorded(key_mod.key_digest(summary), summary, "g", "f.py:1", [])
    key, resolved = precompile.resolve(record, {"neuronx-cc": "NeuronX Compiler version 2.99"})
    assert resolved["versions"] == {"neuronx-cc": "NeuronX Compiler version 2.99", "torch": "x"}
    assert key == key_mod.key_digest(resolved) != record.key
    assert precompile.resolve(record, {"neuronx-cc": "neuronx-cc-unavailable"}) == (record.key, summary)


def test_shards_are_disjoint_and_cover() -> None:
    keys = [f"{i:040x}" for i in range(11)]
    parts = [precompile.shard_of(keys, (i, 3)) for i in range(3)]
    assert sorted(k for p in parts for k in p) == sorted(keys) and sum(map(len, parts)) == len(keys)
    with pytest.raises(ValueError, match="0 <= I < N"):
        precompile.parse_shard("3/3")
