"""``neuron-compile doctor``: without the Neuron stack (exit 2, says what is missing), with the device
simulator (exit 0, every smoke graph passes; a runtime fault makes it exit 1), and its ``--bundle``."""

from __future__ import annotations

import ctypes.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import tests.device_sim as device_sim
from neuron_compile import doctor
from neuron_compile.options import Options

SMOKE_NAMES = [case.name for case in doctor.SMOKE_CASES]


def _without_neuron_stack(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with no neuronx-cc on PATH and no libnrt.so.1 to be found (an explicit
    path that does not exist: found nowhere even on a machine that has /opt/aws/neuron/lib/libnrt.so.1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NRTSIM_")}
    env["PATH"] = os.pathsep.join(
        d for d in env.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "neuronx-cc"))
    )
    env["NEURON_COMPILE_LIBNRT"] = "/nonexistent/libnrt.so.1"
    env.update(extra or {})
    return env


def _doctor(env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_compile.cli", "doctor", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _smoke_rows(stdout: str) -> dict[str, str]:
    """Smoke-test table rows: graph name -> PASS/FAIL."""
    rows = {}
    for name in SMOKE_NAMES:
        m = re.search(rf"^  {re.escape(name)}\s+(PASS|FAIL)\b", stdout, re.M)
        if m:
            rows[name] = m.group(1)
    return rows


def _error_under(stdout: str, name: str) -> str:
    """The error printed under a FAIL row (wrapped lines joined)."""
    lines = stdout[stdout.index(f"  {name} ") :].splitlines()[1:]
    taken = []
    for line in lines:
        if not line.startswith("      "):
            break
        taken.append(line.strip())
    return " ".join(taken)


# --------------------------------------------------------------------------------- no Neuron stack
def test_without_the_neuron_stack_exit_2_names_what_is_missing_and_prints_versions() -> None:
    env = _without_neuron_stack()
    env.pop("NEURON_COMPILE_LIBNRT")
    if os.path.exists(doctor.libnrt.DEFAULT_LIBRARY) or ctypes.util.find_library("nrt"):
        env["NEURON_COMPILE_LIBNRT"] = "/nonexistent/libnrt.so.1"  # a Trainium host: hide its runtime
    proc = _doctor(env)
    out = proc.stdout
    assert proc.returncode == doctor.EXIT_NO_NEURON, out + proc.stderr
    # versions
    assert re.search(rf"^  torch\s+{re.escape(torch.__version__)}$", out, re.M), out
    for package in ("jax", "jaxlib"):
        version = __import__("importlib.metadata").metadata.version(package)
        assert re.search(rf"^  {package}\s+{re.escape(version)}$", out, re.M), out
    assert re.search(r"^  neuron_compile\s+\d+\.\d+", out, re.M), out
    assert re.search(r"^  neuronx-cc\s+not found on PATH$", out, re.M), out
    assert re.search(r"^  libnrt\s+not found", out, re.M), out
    assert re.search(r"^  nki\s+(emulator|nki )", out, re.M), out
    # what auto means here, the cache, and no smoke test
    assert re.search(r'^  "auto" resolves to\s+cpu \(no neuronx-cc on PATH and no libnrt.so.1\)$', out, re.M), out
    assert re.search(
        rf"^  directory\s+{re.escape(os.environ['NEURON_COMPILE_CACHE_DIR'])} \(from \$NEURON_COMPILE_CACHE_DIR\)$",
        out,
        re.M,
    ), out
    assert "visible / total            not read: libnrt.so.1 not found" in out
    assert "skipped: neuronx-cc and libnrt.so.1 not found" in out
    assert not _smoke_rows(out)
    # what is missing, and how to install it
    verdict = out[out.index("== Verdict ==") :]
    assert "NOT READY (exit 2)" in verdict
    assert "neuronx-cc (the Neuron compiler) is not on PATH" in verdict and "pip install" in verdict
    assert "libnrt.so.1 (the Neuron runtime)" in verdict and "aws-neuronx-runtime-lib" in verdict


def test_only_the_runtime_missing_names_only_the_runtime() -> None:
    env = _without_neuron_stack()
    env["PATH"] = str(device_sim.bin_dir()) + os.pathsep + env["PATH"]  # the (simulated) compiler is there
    proc = _doctor(env, "--skip-smoke")
    out = proc.stdout
    assert proc.returncode == doctor.EXIT_NO_NEURON, out + proc.stderr
    assert re.search(r"^  neuronx-cc\s+\S.* \(.*/neuronx-cc\)$", out, re.M), out
    assert re.search(
        r"^  libnrt\s+not found: NEURON_COMPILE_LIBNRT=/nonexistent/libnrt.so.1 does not exist$", out, re.M
    ), out
    verdict = out[out.index("== Verdict ==") :]
    assert "libnrt.so.1 (the Neuron runtime)" in verdict
    assert "neuronx-cc (the Neuron compiler)" not in verdict
    assert "skipped: libnrt.so.1 not found" in out
    # an explicit NEURON_COMPILE_LIBNRT naming a file that is not there is no runtime: "auto" stays on the CPU
    assert re.search(r'^  "auto" resolves to\s+cpu \(no libnrt.so.1\)$', out, re.M), out


def test_bundle_without_the_stack_holds_the_report_and_no_secret(tmp_path: Path) -> None:
    bundle = tmp_path / "report.tar.gz"
    env = _without_neuron_stack({
        "NEURON_COMPILE_CACHE_HMAC_KEY": "hmac-secret-value",
        # a URL with credentials in it, of a protocol fsspec does not know: unreachable without any network
        "NEURON_COMPILE_CACHE_URL": "nosuchprotocol://user:hunter2@bucket.example.invalid/cache",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
        "UNLISTED_VARIABLE": "not-in-the-bundle",
        "WORLD_SIZE": "1",
    })  # fmt: skip
    proc = _doctor(env, "--bundle", str(bundle))
    assert proc.returncode == doctor.EXIT_NO_NEURON, proc.stdout + proc.stderr
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        texts = {n: tar.extractfile(n).read().decode() for n in names}
    assert sorted(names) == ["doctor.txt", "environment.txt", "versions.json"]
    everything = "\n".join(texts.values()) + proc.stdout
    for secret in ("hmac-secret-value", "hunter2", "aws-secret-value", "not-in-the-bundle"):
        assert secret not in everything
    environment = texts["environment.txt"]
    assert "NEURON_COMPILE_CACHE_HMAC_KEY" not in environment.split("# left out")[0]  # left out, named at the end
    assert environment.endswith("# left out (secret-looking): NEURON_COMPILE_CACHE_HMAC_KEY\n"), environment
    assert "NEURON_COMPILE_CACHE_URL=nosuchprotocol://<redacted>@bucket.example.invalid/cache\n" in environment
    assert "WORLD_SIZE=1\n" in environment and "\nPATH=" in "\n" + environment
    assert all(re.match(r"(NEURON|XLA_|JAX_|TORCH|PATH=|LD_LIBRARY_PATH=|LOCAL_RANK=|WORLD_SIZE=)", ln)
               for ln in environment.splitlines() if not ln.startswith("# left out"))  # fmt: skip
    versions = json.loads(texts["versions.json"])
    assert versions["torch"] == torch.__version__ and versions["neuronx-cc"] == "not found on PATH"
    assert texts["doctor.txt"].startswith("neuron-compile doctor") and "NOT READY (exit 2)" in texts["doctor.txt"]
    # the remote cache (unreachable here: no such host) is reported, not fatal
    assert re.search(r"^  reachable\s+NO \(", texts["doctor.txt"], re.M), texts["doctor.txt"]


# ---------------------------------------------------------------------------------- the simulator
@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One ``doctor --bundle`` run with the device simulator switched on (private simulated cores)."""
    tmp = tmp_path_factory.mktemp("doctor_sim")
    env = {**os.environ, **device_sim.environment(state_dir=tmp / "state")}
    env["NEURON_COMPILE_CACHE_HMAC_KEY"] = "hmac-secret-value"
    bundle = tmp / "report.tar.gz"
    return _doctor(env, "--bundle", str(bundle)), bundle


def test_with_the_simulator_every_smoke_graph_passes(simulated: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, _ = simulated
    out = proc.stdout
    assert proc.returncode == doctor.EXIT_OK, out + proc.stderr[-3000:]
    assert _smoke_rows(out) == {name: "PASS" for name in SMOKE_NAMES}, out
    assert re.search(r'^  "auto" resolves to\s+neuron \(neuronx-cc at ', out, re.M), out
    assert re.search(r"^  visible / total\s+\d+ of \d+ logical NeuronCores$", out, re.M), out
    assert re.search(r"^  libnrt\s+/\S+libnrt.so.1; version", out, re.M), out
    assert "OK (exit 0)" in out


def test_with_the_simulator_the_bundle_holds_graphs_and_compiler_runs(
    simulated: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, bundle = simulated
    assert bundle.is_file(), proc.stdout + proc.stderr[-3000:]
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        read = lambda n: tar.extractfile(n).read().decode()  # noqa: E731
        texts = {n: read(n) for n in names if not n.startswith("graphs/")}
        stablehlo = [n for n in names if n.startswith("graphs/") and "/neuron/" in n and n.endswith("/stablehlo.mlir")]
        fx = [n for n in names if n.startswith("graphs/") and n.endswith("/fx_graph.py")]
        module = read(stablehlo[0]) if stablehlo else ""
    assert {"doctor.txt", "versions.json", "environment.txt"} <= set(names), names
    # the smoke test's graphs: one folder per case and target, FX graph and StableHLO
    assert stablehlo and fx, names
    assert "func.func public @main" in module or "func.func @main" in module, module[:500]
    assert {n.split("/")[1] for n in stablehlo} == {doctor._slug(name) for name in SMOKE_NAMES}
    # every neuronx-cc run of the process: its command line, exit code and output
    compiler = sorted(n for n in names if n.startswith("compiler/"))
    assert compiler and compiler[0] == "compiler/01.txt", names
    assert len(compiler) >= 5  # add, matmul, softmax + layer_norm, the MLP's forward and backward
    log = texts["compiler/01.txt"]
    assert log.startswith("command: neuronx-cc compile ") and "--framework XLA" in log
    assert "\nexit code: 0\n" in log and "--- stdout ---" in log and "--- stderr ---" in log
    assert f"\nsmoke graph: {SMOKE_NAMES[0]}\n" in log
    assert texts["doctor.txt"] in proc.stdout  # the report as printed
    assert json.loads(texts["versions.json"])["libnrt"].startswith("/")
    assert "left out (secret-looking): NEURON_COMPILE_CACHE_HMAC_KEY" in texts["environment.txt"]
    assert "hmac-secret-value" not in "".join(texts.values())


def test_with_the_simulator_the_bundle_holds_the_compilers_help_probes_and_a_probe_neffs_tensors(
    simulated: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """What a first Trainium user sends back (issue 48 item 11): the compiler's compile --help, which input format
    it parses and how it lists --native-int64, and the runtime's listing of a probe NEFF with two inputs and two
    outputs, one int64 and one of size zero."""
    from tests.device_sim import neuronx_cc as fake

    proc, bundle = simulated
    with tarfile.open(bundle) as tar:
        read = lambda n: tar.extractfile(n).read().decode()  # noqa: E731
        help_text, probes, listing = (
            read("compiler/help.txt"),
            read("compiler/probes.json"),
            read("runtime/probe_neff.txt"),
        )
    probes = json.loads(probes)
    assert "--native-int64 <mode>" in help_text and "--logical-nc-config <shard_degree>" in help_text
    assert probes["takes"] == [fake.input_format()] and probes["native_int64"].startswith("takes <mode>")
    assert probes["command"][probes["command"].index("--native-int64") + 1] == "enabled"
    other = "hlo" if fake.input_format() == "mlir" else "mlir"
    assert probes["input_formats"][other].startswith("does not parse it"), probes
    assert "input input1 32 bytes [4] nrt_dtype=12" in listing  # int64 (nrt.h's code 0xC)
    assert "output output1 0 bytes [2, 0]" in listing, listing  # size zero
    assert re.search(r"^  input it parses\s+" + fake.input_format() + "$", proc.stdout, re.M), proc.stdout


def test_a_runtime_fault_in_the_smoke_test_exits_1_with_the_error(tmp_path: Path) -> None:
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state")}
    env["NRTSIM_INJECT"] = "nrt_execute:1003:1"  # the first execution produces NaN (NRT_EXEC_COMPLETED_WITH_NUM_ERR)
    proc = _doctor(env)
    out = proc.stdout
    assert proc.returncode == doctor.EXIT_FAILED, out + proc.stderr[-3000:]
    rows = _smoke_rows(out)
    assert rows[SMOKE_NAMES[0]] == "FAIL" and list(rows.values())[1:] == ["PASS"] * (len(SMOKE_NAMES) - 1), out
    error = _error_under(out, SMOKE_NAMES[0])
    assert error.startswith("NeuronRuntimeError: neuron runtime: nrt_execute"), error
    assert "NRT_EXEC_COMPLETED_WITH_NUM_ERR" in error
    verdict = out[out.index("== Verdict ==") :]
    assert "NOT WORKING (exit 1)" in verdict and f"1 of {len(SMOKE_NAMES)} smoke tests failed" in verdict


def test_with_the_simulator_skip_smoke_exits_0_and_takes_no_core(tmp_path: Path) -> None:
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state"), "NEURON_RT_VISIBLE_CORES": "1"}
    proc = _doctor(env, "--skip-smoke")
    assert proc.returncode == doctor.EXIT_OK, proc.stdout + proc.stderr
    assert re.search(r"^  visible / total\s+1 of \d+ logical NeuronCores$", proc.stdout, re.M), proc.stdout
    assert "skipped (--skip-smoke)" in proc.stdout and not _smoke_rows(proc.stdout)
    assert "OK (exit 0): the Neuron stack is here (smoke test skipped)." in proc.stdout
    assert not list((tmp_path / "state").glob("core*.lock")), "the doctor started the runtime without a smoke test"


def test_a_core_beyond_the_visible_ones_exits_1_and_says_so(tmp_path: Path) -> None:
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state"),
           "NEURON_RT_VISIBLE_CORES": "2", "NEURON_COMPILE_CORE": "1"}  # fmt: skip
    proc = _doctor(env, "--skip-smoke")
    assert proc.returncode == doctor.EXIT_FAILED, proc.stdout + proc.stderr
    verdict = " ".join(proc.stdout[proc.stdout.index("== Verdict ==") :].split())
    assert "NOT WORKING (exit 1)" in verdict
    assert "graphs would run on logical NeuronCore 1, but only 1 is visible to this process" in verdict


# ------------------------------------------------------------------------------- pieces, in-process
def test_a_mismatch_fails_the_case_with_the_error_size() -> None:
    calls = []

    def differs(options: dict) -> dict[str, torch.Tensor]:
        calls.append(options["target"])
        return {"x": torch.full((4,), float(len(calls)))}  # 1.0 on the target, 2.0 on the reference

    result = doctor.run_case(doctor.SmokeCase("differs", differs, rtol=0, atol=0), target="cpu", reference="cpu")
    assert calls == ["cpu", "cpu"]
    assert not result.passed and result.max_abs_error == 1.0
    assert result.error.startswith("x: Mismatched elements: 4 / 4"), result.error


def test_a_compile_error_is_reported_as_its_own_first_line() -> None:
    def dynamic(options: dict) -> dict[str, torch.Tensor]:
        fn = torch.compile(lambda x: x * 2, backend="neuron", options=options, dynamic=True)
        return {"y": fn(torch.ones(3))}

    result = doctor.run_case(doctor.SmokeCase("dynamic", dynamic, rtol=0, atol=0), target="cpu", reference="cpu")
    assert not result.passed and result.max_abs_error is None
    # not torch's wrapper (BackendCompilerFailed: backend='neuron' raised:) but the backend's own error
    assert result.error.startswith("NeuronDynamicShapeError: "), result.error
    assert "Traceback" in result.details


def test_the_kernel_site_check_fails_a_graph_without_sites() -> None:
    def plain(options: dict) -> dict[str, torch.Tensor]:
        fn = torch.compile(lambda x: x + 1, backend="neuron", options=options, dynamic=False)
        return {"y": fn(torch.ones(3))}

    result = doctor.run_case(doctor.SmokeCase("plain", plain, rtol=0, atol=0, min_kernel_sites=1), "cpu", "cpu")
    assert not result.passed
    assert result.error.startswith("AssertionError: target cpu: 0 NKI kernel site(s) compiled"), result.error


def test_remote_cache_reachable_or_the_error(tmp_path: Path) -> None:
    ok = doctor.Report(out=io.StringIO())
    doctor.check_remote(ok, Options(cache_url=(tmp_path / "remote").as_uri()))
    assert re.search(r"^  reachable\s+yes \(\d+\.\ds\): 0 entries, 0 B$", ok.text(), re.M), ok.text()
    # one published entry (its manifest is there) and one abandoned upload: one entry, every byte counted
    published, abandoned = tmp_path / "remote" / ("a" * 40), tmp_path / "remote" / ("b" * 40)
    published.mkdir(parents=True), abandoned.mkdir()
    (published / "manifest.json").write_bytes(b"{}" * 50)
    (published / ("0" * 32 + ".entry")).write_bytes(b"x" * 1000)
    (abandoned / ("1" * 32 + ".entry")).write_bytes(b"y" * 2000)
    (tmp_path / "remote" / "not-a-key").mkdir()
    again = doctor.Report(out=io.StringIO())
    doctor.check_remote(again, Options(cache_url=(tmp_path / "remote").as_uri()))
    assert re.search(r"^  reachable\s+yes \(\d+\.\ds\): 1 entries, 3\.0 KiB$", again.text(), re.M), again.text()
    bad = doctor.Report(out=io.StringIO())
    doctor.check_remote(bad, Options(cache_url="nosuchprotocol://bucket/prefix"))
    assert re.search(r"^  reachable\s+NO \(\d+\.\ds\): .*nosuchprotocol", bad.text(), re.M), bad.text()


def test_help_documents_the_exit_codes_and_the_cli_does_not_load_the_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    from neuron_compile.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["doctor", "--help"])
    text = capsys.readouterr().out
    for code in ("0 ", "1 ", "2 "):
        assert f"\n  {code} " in text, text
    assert "--skip-smoke" in text and "--bundle FILE.tar.gz" in text
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, neuron_compile.cli; print('neuron_compile.doctor' in sys.modules)"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.strip()  # fmt: skip
    assert loaded == "False"


def test_the_entry_point_runs_the_doctor() -> None:
    exe = shutil.which("neuron-compile")
    if exe is None:
        pytest.skip("the neuron-compile entry point is not installed (pip install -e .)")
    proc = subprocess.run([exe, "doctor", "--skip-smoke"], env=_without_neuron_stack(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == doctor.EXIT_NO_NEURON, proc.stdout + proc.stderr
    assert "== Versions ==" in proc.stdout
