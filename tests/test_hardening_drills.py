"""Issue 46's drills, each repeated as a test: no traceback, no hang, no secret, and an error that names the
thing (the manifest's file and field, the variable and its value, the LNC of each side, what a model returned).

Items: 5 (manifest schema), 6 (module paths of a manifest), 7 (secrets of a cache URL), 8
(NEURON_RT_VISIBLE_CORES), 9 (evaluate of a model returning no tensor), 12 (LNC mismatch; the doctor and an
unreachable remote cache).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
import torch

import tests.device_sim as device_sim
from neuron_compile import doctor
from neuron_compile.cache.redact import redact, redact_url
from neuron_compile.options import Options

REPO = device_sim.REPO_ROOT
#: Every secret of the drill's URL (user-info password, presigned S3 signature and credential, token, SAS sig).
SECRETS = ("HUNTER2", "SIGSECRET0", "CREDSECRET0", "TOKSECRET0", "SASSECRET0")
SECRET_URL = (
    "s3://u:HUNTER2@bucket/prefix?X-Amz-Signature=SIGSECRET0&X-Amz-Credential=CREDSECRET0"
    "&token=TOKSECRET0&sig=SASSECRET0&versionId=3"
)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "neuron_compile.cli", *args]


def _no_stack_env(**extra: str) -> dict[str, str]:
    """No neuronx-cc on PATH, no libnrt.so.1, no network to speak of (as test_doctor's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NRTSIM_", "NEURON_COMPILE_CACHE_URL"))}
    env["PATH"] = os.pathsep.join(
        d for d in env.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "neuronx-cc"))
    )
    env["NEURON_COMPILE_LIBNRT"] = "/nonexistent/libnrt.so.1"
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 300, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO, **kw)


def _assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{secret} leaked:\n{text[-3000:]}"


# ------------------------------------------------------------------------------- 7: secrets of a URL
def test_redact_url_removes_user_info_and_secret_query_values() -> None:
    shown = redact_url(SECRET_URL)
    _assert_no_secret(shown)
    assert shown.startswith("s3://<redacted>@bucket/prefix?X-Amz-Signature=<redacted>&") and "versionId=3" in shown
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"


def test_redact_finds_the_secrets_a_library_quotes_without_the_url() -> None:
    # botocore's words for s3://u:HUNTER2@bucket/x: the URL is not quoted whole, its user-info is
    botocore = 'listing: ParamValidationError: Invalid bucket name "u:HUNTER2@bucket": Bucket name must match'
    assert redact(botocore, [SECRET_URL]) == botocore.replace("u:HUNTER2", "<redacted>")
    # a presigned query quoted in free text, and another URL with credentials in the same message
    text = "GET /prefix?X-Amz-Credential=CREDSECRET0&sig=SASSECRET0 failed; see https://a:TOKSECRET0@h/x"
    _assert_no_secret(redact(text))


def test_doctor_bundle_of_an_s3_url_with_a_password_holds_no_secret(tmp_path: Path) -> None:
    bundle = tmp_path / "report.tar.gz"
    env = _no_stack_env(NEURON_COMPILE_CACHE_URL=SECRET_URL)
    proc = _run(_cli("doctor", "--skip-smoke", "--bundle", str(bundle)), env)
    assert proc.returncode == doctor.EXIT_NO_NEURON, proc.stdout + proc.stderr
    with tarfile.open(bundle) as tar:
        members = [tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()]
    _assert_no_secret(proc.stdout, proc.stderr, *members)
    # botocore refused the bucket name, quoting it without the URL
    assert re.search(r"^  reachable\s+NO \(", proc.stdout, re.M) and "<redacted>@bucket" in proc.stdout


def test_a_url_without_its_scheme_is_neither_echoed_by_the_options_nor_bundled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "u:HUNTER2@bucket/prefix")
    report, findings = doctor.Report(out=io.StringIO()), doctor.Findings()
    assert doctor._user_options(report, findings) is None  # not a URL: the option does not parse
    _assert_no_secret(report.text(), *findings.problems, doctor.bundle_environment())
    assert "is not valid for option 'cache_url'" in report.text(), report.text()


def test_remote_cache_warnings_and_errors_hold_no_secret() -> None:
    from neuron_compile.cache.remote import RemoteStore, RemoteUnavailable

    remote = RemoteStore(SECRET_URL, timeout=5)
    _assert_no_secret(remote.url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RemoteUnavailable) as raised:
            remote.fetch("a" * 40)
    _assert_no_secret(str(raised.value), remote.down or "", *(str(w.message) for w in caught))
    assert caught and "<redacted>@bucket" in str(caught[0].message)


@pytest.mark.parametrize(
    "args",
    [("cache", "--url", SECRET_URL, "list"), ("cache", "--url", "u:HUNTER2@bucket/x", "list"),
     ("precompile", "check", "no-manifest.json", "--cache-url", SECRET_URL)],
    ids=["cache-list", "cache-list-not-a-url", "precompile-check"],
)  # fmt: skip
def test_cache_cli_and_precompile_print_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: tuple[str, ...]
) -> None:
    from neuron_compile import cli

    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    try:
        said = str(cli.main(list(args)))
    except SystemExit as e:  # the CLI's one-line errors
        said = str(e.code)
    out = capsys.readouterr()
    _assert_no_secret(said, out.out, out.err)
    assert "<redacted>" in said + out.out + out.err, said + out.out + out.err


# ------------------------------------------------------------ 12: the doctor and an unreachable remote
def _check_remote(url: str | None, required: bool) -> tuple[doctor.Findings, str]:
    report, findings = doctor.Report(out=io.StringIO()), doctor.Findings()
    doctor.check_remote(report, Options(cache_url=url), findings, required)
    return findings, report.text()


def test_an_unreachable_remote_is_a_note_and_with_require_remote_a_problem() -> None:
    findings, text = _check_remote("nosuchprotocol://bucket/prefix", required=False)
    assert re.search(r"^  reachable\s+NO \(", text, re.M) and not findings.problems, text
    assert findings.remote_down and any("is NOT reachable" in n and "--require-remote" in n for n in findings.notes)
    findings, _ = _check_remote("nosuchprotocol://bucket/prefix", required=True)
    assert any("not reachable (--require-remote)" in p for p in findings.problems), findings
    findings, _ = _check_remote(None, required=True)
    assert any("no remote cache is configured" in p for p in findings.problems), findings
    findings, _ = _check_remote(None, required=False)
    assert not findings.problems and not findings.notes


def test_the_verdict_of_a_working_stack_says_the_remote_is_not_reachable() -> None:
    findings, _ = _check_remote("nosuchprotocol://bucket/prefix", required=False)
    report = doctor.Report(out=io.StringIO())
    assert doctor._verdict(report, findings, []) == doctor.EXIT_OK
    verdict = " ".join(report.text().split())
    assert "note: the remote cache nosuchprotocol://bucket/prefix is NOT reachable" in verdict, verdict
    assert "OK (exit 0): the Neuron stack is here (smoke test skipped). The remote cache is NOT reachable" in verdict


def test_doctor_require_remote_on_a_working_stack_with_an_unreachable_remote_exits_1(tmp_path: Path) -> None:
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state"),
           "NEURON_COMPILE_CACHE_URL": "nosuchprotocol://bucket/prefix"}  # fmt: skip
    proc = _run(_cli("doctor", "--skip-smoke", "--require-remote"), env)
    verdict = " ".join(proc.stdout[proc.stdout.index("== Verdict ==") :].split())
    assert proc.returncode == doctor.EXIT_FAILED, proc.stdout + proc.stderr
    assert "NOT WORKING (exit 1)" in verdict and "is not reachable (--require-remote)" in verdict, verdict


# -------------------------------------------------------------------- 8: NEURON_RT_VISIBLE_CORES
@pytest.mark.parametrize(
    "value, says",
    [
        ("0-", "NEURON_RT_VISIBLE_CORES='0-' has '0-', which is neither a core index nor a range"),
        ("abc", "NEURON_RT_VISIBLE_CORES='abc' has 'abc', which is neither a core index nor a range"),
        ("3-1", "NEURON_RT_VISIBLE_CORES='3-1' has the range 3-1, which runs backwards (write 1-3)"),
        ("0,2", "NEURON_RT_VISIBLE_CORES='0,2' names cores that are not contiguous and increasing (0 then 2)"),
        ("1,,2", "NEURON_RT_VISIBLE_CORES='1,,2' has '', which is neither a core index nor a range"),
    ],
)
def test_visible_cores_values_the_runtime_refuses_are_named(value: str, says: str) -> None:
    from neuron_compile.runtime import visible_cores

    with pytest.raises(visible_cores.VisibleCoresError) as raised:
        visible_cores.parse(value)
    assert str(raised.value).startswith(f"neuron runtime: {says}"), raised.value


@pytest.mark.parametrize("value, cores", [("3", [3]), ("0-3", [0, 1, 2, 3]), ("0,1", [0, 1]), ("0-1,2", [0, 1, 2])])
def test_visible_cores_values_the_runtime_takes(value: str, cores: list[int]) -> None:
    from neuron_compile.runtime import visible_cores

    assert list(visible_cores.parse(value)) == cores
    assert visible_cores.check_total(value, 4, 2) is None and visible_cores.check_total(value, cores[-1], 2)


@pytest.mark.parametrize(
    "value, says",
    [
        ("0-", "NEURON_RT_VISIBLE_CORES='0-' has '0-', which is neither a core index nor a range"),
        ("99", "NEURON_RT_VISIBLE_CORES=99 names logical NeuronCore 99, but this instance has 4 (cores 0-3 at LNC 2)"),
    ],
)
def test_doctor_names_a_visible_cores_value_the_runtime_refuses(tmp_path: Path, value: str, says: str) -> None:
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state"), "NEURON_RT_VISIBLE_CORES": value}
    env.pop("NEURON_LOGICAL_NC_CONFIG", None)
    proc = _run(_cli("doctor", "--skip-smoke"), env)
    verdict = " ".join(proc.stdout[proc.stdout.index("== Verdict ==") :].split())
    assert proc.returncode == doctor.EXIT_FAILED, proc.stdout + proc.stderr
    assert says in verdict, verdict
    assert "does not answer" not in proc.stdout, proc.stdout


#: Runs one tiny graph on the neuron target; prints the error's type and message instead of a traceback.
RUN_ONE_GRAPH = """\
import sys, torch
options = {"target": "neuron", "cache": False, **eval(sys.argv[1])}
try:
    print(torch.compile(lambda x: x * 2 + 1, backend="neuron", dynamic=False, options=options)(torch.ones(4)))
except Exception as e:
    print("ERROR", type(e).__name__, " ".join(str(e).split()))
"""


def _run_one_graph(tmp_path: Path, options: str, **env_changes: str | None) -> str:
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state")}
    for name, value in env_changes.items():
        env.pop(name, None) if value is None else env.__setitem__(name, value)
    proc = _run([sys.executable, "-c", RUN_ONE_GRAPH, options], env)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def test_a_run_names_the_visible_cores_value_before_nrt_init(tmp_path: Path) -> None:
    value = "3-1"  # every form the runtime refuses is parsed by the same function (tests above)
    # the runtime's start, as a graph's first run makes it (compiling first adds nothing to the drill)
    start = (
        "from neuron_compile.runtime import libnrt\ntry:\n    libnrt.runtime()\nexcept Exception as e:\n"
        "    print('ERROR', type(e).__name__, ' '.join(str(e).split()))\n"
    )
    env = {**os.environ, **device_sim.environment(state_dir=tmp_path / "state"), "NEURON_RT_VISIBLE_CORES": value}
    proc = _run([sys.executable, "-c", start], env)
    out = proc.stdout
    assert f"ERROR VisibleCoresError neuron runtime: NEURON_RT_VISIBLE_CORES={value!r} " in out, out + proc.stderr
    assert "another process" not in out and "nrt_init returned" not in out, out
    assert not list((tmp_path / "state").glob("core*.lock")), "nrt_init ran"


# -------------------------------------------------------------------------------- 12: an LNC mismatch
def test_a_neff_of_another_lnc_than_the_runtimes_names_the_mismatch(tmp_path: Path) -> None:
    out = _run_one_graph(tmp_path, "{'lnc': 1}", NEURON_LOGICAL_NC_CONFIG=None)
    assert "ERROR NeuronRuntimeError neuron runtime: nrt_load refused the NEFF (NRT_INVALID = 2)" in out, out
    assert (
        "compiled for logical-core size LNC 1 (option lnc, neuronx-cc --lnc 1) but the runtime runs with LNC 2" in out
    )
    assert "neuron-compile cache clear" not in out, out


def test_other_load_refusals_keep_their_own_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron_compile.errors import NeuronRuntimeError
    from neuron_compile.runtime.neuron import NeuronTarget

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)  # the runtime's LNC: its default, 2
    target = NeuronTarget(lnc=1)
    assert target._lnc_mismatch(NeuronRuntimeError("x", 10, "nrt_load")) is None  # not NRT_INVALID
    assert target._lnc_mismatch(NeuronRuntimeError("x", 2, "nrt_execute")) is None  # not a load
    assert NeuronTarget(lnc=2)._lnc_mismatch(NeuronRuntimeError("x", 2, "nrt_load")) is None  # same LNC


# ------------------------------------------------------------------------- 5, 6: precompile manifests
KEY = "a" * 40
GOOD_RECORD = {
    "key": KEY,
    "summary": {"options": {"generation": "trn2", "neuron_cc_flags": [], "opt_level": 2, "lnc": 2},
                "versions": {"neuronx-cc": "2.0"}, "inputs": ["float32[2] stride=(1,) cpu"]},
    "name": "graph0_inference", "source": "train.py:3", "inputs": ["float32[2] stride=(1,) cpu"],
    "module": "b" * 64, "plan": "c" * 64, "num_ops": 1, "lower_seconds": 0.1, "error": None,
}  # fmt: skip


def _manifest(**record_changes: object) -> dict:
    return {"format": 1, "graphs": {KEY: {**GOOD_RECORD, **record_changes}}}


@pytest.mark.parametrize(
    "document, lines",
    [
        # the drills' tracebacks: 'int' object has no attribute 'items'; Recorded.__init__() missing 4 required
        # positional arguments; '<' not supported between 'str' and 'NoneType'
        ({"format": 1, "graphs": 3}, ["graphs: expected an object, got int"]),
        ({"format": 1, "graphs": {KEY: {"key": KEY}}},
         [f"graphs.{KEY}.{f}: missing" for f in ("inputs", "name", "source", "summary")]),
        (_manifest(name=None), [f"graphs.{KEY}.name: expected a string, got null"]),
        (_manifest(inputs=3, num_ops="many"),
         [f"graphs.{KEY}.inputs: expected a list, got int", f"graphs.{KEY}.num_ops: expected an integer, got str"]),
        (_manifest(summary={"options": {"generation": "trn9", "neuron_cc_flags": "-O3", "opt_level": 2},
                            "versions": {}, "inputs": []}),
         [f"graphs.{KEY}.summary.options.generation: expected 'trn2' or 'trn3', got 'trn9'",
          f"graphs.{KEY}.summary.options.neuron_cc_flags: expected a list, got str"]),
        (_manifest(key="d" * 40), [f"graphs.{KEY}.key: '{'d' * 40}' is not the key it is filed under"]),
        ({"format": 2, "graphs": {}}, ["format: expected 1, got 2"]),
        ([], ["expected an object, got list"]),
        # item 6: a module path is a sha256, never a path
        (_manifest(module="../fifo"),
         [f"graphs.{KEY}.module: expected the sha256 (64 lowercase hex digits) of a file in modules/, or null, "
          "got '../fifo'"]),
    ],
    ids=["graphs-int", "record-missing-fields", "name-null", "wrong-types", "options", "key-mismatch", "format",
         "not-an-object", "module-path"],
)  # fmt: skip
def test_a_bad_manifest_gives_one_line_per_problem_naming_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], document: object, lines: list[str]
) -> None:
    import json

    from neuron_compile import precompile

    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(document))
    assert precompile.main_check(str(path), str(tmp_path / "cache"), "") == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"neuron-compile: {path}: {line}" for line in lines], err


@pytest.mark.parametrize(
    "data, line",
    [(b"\x89PNG\r\n\x1a\n\x00\xff", "not a manifest: not UTF-8 text (byte 0x89 at offset 0)"),
     (b"[" * 100_000 + b"]" * 100_000, "not a manifest: JSON nested too deeply to read"),
     (b'{"format": 1, "graphs": {', "not a manifest: not JSON (line 1 column 26")],
    ids=["binary", "recursion", "truncated"],
)  # fmt: skip
def test_a_file_that_is_not_json_is_named(tmp_path: Path, data: bytes, line: str) -> None:
    from neuron_compile import precompile

    path = tmp_path / "manifest.json"
    path.write_bytes(data)
    with pytest.raises(precompile.ManifestError) as raised:
        precompile.read_manifest(str(path))
    assert raised.value.problems[0].startswith(f"{path}: {line}"), raised.value.problems


def test_precompile_compile_of_a_manifest_naming_a_fifo_exits_2_without_hanging(tmp_path: Path) -> None:
    import json

    pre = tmp_path / "pre"
    (pre / "modules").mkdir(parents=True)
    os.mkfifo(pre / "fifo.mlir")  # what "modules/../fifo" + ".mlir" named: it blocked the compile forever
    (pre / "manifest.json").write_text(json.dumps(_manifest(module="../fifo")))
    env = {**_no_stack_env(NEURON_COMPILE_CACHE_DIR=str(tmp_path / "cache")), "PYTHONPATH": str(REPO)}
    env["PATH"] = str(device_sim.bin_dir()) + os.pathsep + env["PATH"]  # a neuronx-cc to get past its check
    proc = _run(_cli("precompile", "compile", str(pre / "manifest.json")), env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and f"manifest.json: graphs.{KEY}.module: expected the sha256" in proc.stderr


@pytest.mark.parametrize("planted", ["fifo", "symlink-outside", "directory"])
def test_a_module_file_that_is_not_a_regular_file_inside_the_folder_is_refused(tmp_path: Path, planted: str) -> None:
    from neuron_compile import precompile

    manifest = tmp_path / "pre" / "manifest.json"
    modules = manifest.parent / precompile.OBJECTS_DIR
    modules.mkdir(parents=True)
    digest = "e" * 64
    target = modules / f"{digest}.mlir"
    if planted == "fifo":
        os.mkfifo(target)
    elif planted == "symlink-outside":
        (tmp_path / "elsewhere.mlir").write_text("module {}")
        target.symlink_to(tmp_path / "elsewhere.mlir")
    else:
        target.mkdir()
    with pytest.raises(ValueError, match=r"modules/eeeeeeeeeeee\.mlir (cannot be used|resolves outside)"):
        precompile.read_object(str(manifest), digest, ".mlir")


# ----------------------------------------------------------------- 9: evaluate of a model with no tensor
class _Returns(torch.nn.Module):
    """Returns ``value`` whatever its input; with ``weight`` a parameter, so that it trains."""

    def __init__(self, value: object, trains: bool = False) -> None:
        super().__init__()
        self.value = value
        self.weight = torch.nn.Parameter(torch.ones(2)) if trains else None

    def forward(self, x: torch.Tensor) -> object:
        return self.value


@pytest.mark.parametrize(
    "value, trains, said",
    [("abc", False, "a str ('abc')"), (None, False, "None"), (3, False, "an int (3)"),
     ((1, "a"), False, "a tuple ((1, 'a'))"), ("abc", True, "a str ('abc')")],
    ids=["str", "none", "int", "tuple", "str-training"],
)  # fmt: skip
def test_evaluate_of_a_model_returning_no_tensor_is_not_a_pass(value: object, trains: bool, said: str) -> None:
    from neuron_compile.evaluate import evaluate

    report = evaluate(_Returns(value, trains), (torch.ones(2),), options={"target": "cpu"}, progress=False)
    assert not report.ok and report.nothing_to_judge.startswith(f"the model returned {said}, no tensor"), report
    assert "CANNOT JUDGE: the model returned" in str(report) and "YES" not in str(report)
    assert report.to_dict()["nothing_to_judge"] == report.nothing_to_judge


def test_evaluate_cli_of_a_model_returning_none_exits_2_saying_what_it_returned(tmp_path: Path) -> None:
    factory = tmp_path / "returns_none.py"
    factory.write_text(
        "import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n        return None\n\n"
        "def make():\n    return M(), (torch.ones(2),)\n"
    )
    proc = _run(_cli("evaluate", f"{factory}:make"), {**os.environ, "NEURON_COMPILE_TARGET": "cpu"})
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert "the model returned None, no tensor" in proc.stderr and "YES" not in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr
