"""How the neuron target drives neuronx-cc (``runtime/neuronx_cc.py``, ``runtime/compile_guard.py``), against the
device simulator's fake compiler, which follows the CLI reference: flags by the compiler's own ``--help``, the
input format it parses (``NRTSIM_COMPILER_INPUT``), the NEFF's tensor names set in the module, custom calls it
recognises, NKI kernels compiled as nki compiles them, and a compile that never ends or whose parent dies.

The processes here are real: a compile runs under its keeper in a process of its own, and the tests that kill
things kill real processes (found by the private temporary directory in their command lines).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from neuron_compile import NeuronCompileError, NeuronCompileTimeoutError
from neuron_compile.runtime import jax_adapter, neuronx_cc
from neuron_compile.runtime.neuron import COMPILER_RUNS, NeuronTarget

from . import device_sim
from .device_sim import compute
from .device_sim import neuronx_cc as fake


def _lower(fn, *structs) -> str:
    with jax.enable_x64(True):
        return jax.jit(fn).lower(*structs).as_text()


_AXPY = _lower(
    lambda x, y: x * 2 + y, jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)
)


@pytest.fixture
def sim(tmp_path, monkeypatch):
    """The simulator on; a private state dir, cache dir and temporary directory (``tmp``); nothing remembered of
    a compiler in this process."""
    device_sim.activate(monkeypatch, state_dir=tmp_path / "state")
    for name in ("NRTSIM_COMPILER_INPUT", "NRTSIM_NATIVE_INT64", "NRTSIM_COMPILE_DELAY", "NRTSIM_COMPILE_FAIL"):
        monkeypatch.delenv(name, raising=False)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    neuronx_cc.forget()
    COMPILER_RUNS.clear()
    yield types.SimpleNamespace(cache=str(tmp_path / "cache"), tmp=tmp, state=tmp_path / "state")
    neuronx_cc.forget()


def _processes_under(directory: Path) -> list[int]:
    """Live processes whose command line names ``directory`` (a compile's keeper and compiler name its work dir)."""
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            text = Path(cmdline).read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(directory) in text:
            found.append(int(cmdline.split("/")[2]))
    return found


def _wait_until(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _compiler_pid(tmp: Path) -> int | None:
    """The pid the running fake compiler wrote in its log (the real log's lines carry it too)."""
    for log in glob.glob(str(tmp / "neuron_compile_*" / neuronx_cc.LOG_FILE)):
        for line in Path(log).read_text().splitlines():
            if "Running pass: tensorizer" in line:
                return int(line.split()[2])
    return None


# ------------------------------------------------------------------------------- flags by the compiler's help
def test_the_help_parser_reads_the_fake_compilers_help(sim) -> None:
    flags = neuronx_cc.parse_help(fake.build_parser()._subparsers._group_actions[0].choices["compile"].format_help())
    assert flags["--native-int64"].metavar == "<mode>" and flags["--native-int64"].takes_value
    assert flags["--lnc"] is flags["--logical-nc-config"] is flags["-lnc"]
    assert flags["-O"].names == ("--optlevel", "-O")
    assert not flags["--enable-saturate-infinity"].takes_value


@pytest.mark.parametrize(
    "form, int64_flag",
    [("mode", ["--native-int64", "enabled"]), ("switch", ["--native-int64"]), ("absent", [])],
)
def test_native_int64_is_passed_in_the_form_the_help_lists(sim, monkeypatch, form, int64_flag) -> None:
    """SDK 2.32 lists ``--native-int64 <mode>`` (the fake refuses it bare); a compiler listing a switch gets it
    bare, one without it gets none. Each compiles the module."""
    monkeypatch.setenv("NRTSIM_NATIVE_INT64", form)
    target = NeuronTarget(cache_dir=sim.cache)
    command = target.command("m.mlir", "m.neff")
    at = command.index("--auto-cast") + 2
    assert command[at : command.index("--output")] == int64_flag, command
    executable = target.compile(_AXPY)
    assert COMPILER_RUNS[-1].command[at : COMPILER_RUNS[-1].command.index("--output")] == int64_flag
    assert compute.read_neff(executable.neff).lnc == 2


def test_a_flag_the_help_does_not_list_is_passed_on_with_one_warning(sim, caplog) -> None:
    """neuronx-cc hides its internal flags from --help: an unlisted flag goes to the compiler as given, with one
    warning naming it and the version; the compiler decides. A listed flag missing its value is still an error."""
    version = neuronx_cc.compiler_version()
    hidden = ("--internal-enable-dge-levels", "vector_dynamic_offsets", "--tensorizer-options=--print-stats")
    target = NeuronTarget(flags=hidden, cache_dir=sim.cache)
    with caplog.at_level("WARNING", logger="neuron_compile"):
        target.compile(_AXPY)
        target.compile(_AXPY)
    run = COMPILER_RUNS[-1]
    assert run.returncode == 0
    assert list(hidden) == run.command[run.command.index("--output") - 3 : run.command.index("--output")], run.command
    said = next(line for line in run.log.splitlines() if "Command line:" in line)  # the fake compiler's argv
    assert "--internal-enable-dge-levels vector_dynamic_offsets --tensorizer-options=--print-stats" in said, said
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([w for w in warned if "--internal-enable-dge-levels" in w]) == 1, warned
    assert len([w for w in warned if "--tensorizer-options" in w]) == 1, warned
    assert all(f"{version}'s `compile --help` does not list" in w for w in warned), warned
    # not refused here: a flag no compiler takes is the compiler's to refuse, with its own words
    with pytest.raises(NeuronCompileError, match=r"unrecognized arguments: --enable-warp-drive"):
        NeuronTarget(flags=("--enable-warp-drive",), cache_dir=sim.cache).compile(_AXPY)
    with pytest.raises(NeuronCompileError, match=rf"--native-int64 .*takes a value on {re.escape(version)}.*enabled"):
        NeuronTarget(flags=("--native-int64", "--auto-cast", "none"), cache_dir=sim.cache).command("m", "n")
    fine = ("--native-int64=disabled", "-O1", "--auto-cast", "matmult", "--distribution-strategy", "llm-training")
    assert NeuronTarget(flags=fine, cache_dir=sim.cache).command("m", "n")[-8:-2] == list(fine)


@pytest.fixture
def logger_level():
    """The ``neuron_compile`` logger's level, put back after a test that sets it with --log_level."""
    import logging

    logger = logging.getLogger("neuron_compile")
    saved = logger.level
    yield logger
    logger.setLevel(saved)


# torch-neuronx's wrapper flags, as the Neuron Persistent Cache page shows them in NEURON_CC_FLAGS
# (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/neuron-caching.html)
def test_the_wrappers_flags_are_taken_and_never_reach_the_compiler(sim, tmp_path, caplog, logger_level) -> None:
    flags = (
        f"--cache_dir={tmp_path / 'neuron-cache'}", "--no_cache", "--log_level=INFO", "--retry_failed_compilation",
        "--compile_workdir", str(tmp_path / "work"), "-O1",
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="neuron_compile"):
        found = neuronx_cc.wrapper_flags(flags)
        neuronx_cc.wrapper_flags(tuple(flags))
        target = NeuronTarget(flags=flags, cache_dir=None)
        command = target.command("m.mlir", "m.neff")
        target.compile(_AXPY)
        assert logger_level.level == logging.INFO  # --log_level: our logger's level
    assert found == neuronx_cc.WrapperFlags(
        compiler=("-O1",), cache_dir=str(tmp_path / "neuron-cache"), no_cache=True, log_level="INFO",
        retry_failed_compilation=True, dropped=(f"--compile_workdir {tmp_path / 'work'}",),
    )  # fmt: skip
    for run_command in (command, COMPILER_RUNS[-1].command):
        assert not [t for t in run_command if "_" in t.split("=")[0] and t.startswith("--")], run_command
        assert "-O1" in run_command and str(tmp_path / "work") not in run_command
    dropped = [r.getMessage() for r in caplog.records if "compile-cache wrapper" in r.getMessage()]
    assert len(dropped) == 1 and f"--compile_workdir {tmp_path / 'work'}" in dropped[0], dropped
    assert neuronx_cc.wrapper_flags(("--cache_dir", "s3://bucket/p")).cache_dir == "s3://bucket/p"
    assert neuronx_cc.cache_dir_from_flags(("--cache_dir", "s3://bucket/p")) is None  # a URL is not a directory


def test_cache_dir_in_neuron_cc_flags_is_the_cache_directory_below_ours(tmp_path, monkeypatch) -> None:
    """--cache_dir of NEURON_CC_FLAGS: the compile cache's directory for the process, below option cache_dir and
    NEURON_COMPILE_CACHE_DIR; what the compiler said is kept there too."""
    from neuron_compile.cache.paths import resolve_cache_dir

    neuronx_cc.forget()
    monkeypatch.delenv("NEURON_COMPILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--model-type transformer --cache_dir={tmp_path / 'w'} -O1")
    assert resolve_cache_dir() == str(tmp_path / "w") and resolve_cache_dir(str(tmp_path / "o")) == str(tmp_path / "o")
    assert neuronx_cc.facts_dir() == str(tmp_path / "w" / "compiler")
    assert resolve_cache_dir(None, ("--cache_dir", str(tmp_path / "opt"))) == str(tmp_path / "opt")  # the option's
    assert NeuronTarget(flags=("--cache_dir", str(tmp_path / "opt"))).facts_dir == str(tmp_path / "opt" / "compiler")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir() == str(tmp_path / "env") == os.path.dirname(neuronx_cc.facts_dir())
    monkeypatch.delenv("NEURON_COMPILE_CACHE_DIR")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--cache_dir=s3://bucket/prefix")
    assert resolve_cache_dir() == resolve_cache_dir(None, ())  # a URL: the user cache dir
    neuronx_cc.forget()


def test_neuron_cc_flags_as_torch_neuronx_users_have_them_compile_on_the_simulator(
    sim, tmp_path, monkeypatch, logger_level
) -> None:
    """torch.compile with the NEURON_CC_FLAGS of a torch-neuronx setup: the graph compiles and runs, its entry is
    written where --cache_dir says; with --no_cache the same graph is compiled again and nothing is written."""
    monkeypatch.delenv("NEURON_COMPILE_CACHE_DIR", raising=False)
    cache = tmp_path / "neuron-compile-cache"
    monkeypatch.setenv(
        "NEURON_CC_FLAGS",
        f"--model-type transformer --retry_failed_compilation --cache_dir={cache} --log_level=WARNING",
    )
    x = torch.arange(6.0)

    def run() -> torch.Tensor:
        torch._dynamo.reset()
        return torch.compile(lambda t: t * 2 + 1, backend="neuron", options={"target": "neuron"})(x)

    assert torch.equal(run(), x * 2 + 1)
    entries = sorted(p.name for p in (cache / "entries").glob("*/*"))
    assert len(entries) == 1 and (cache / "compiler").is_dir(), list(cache.rglob("*"))
    compiled = device_sim.compiler_invocations()
    assert torch.equal(run(), x * 2 + 1) and device_sim.compiler_invocations() == compiled  # a cache hit
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--no_cache --cache_dir={cache}")
    assert torch.equal(run(), x * 2 + 1)
    assert device_sim.compiler_invocations() == compiled + 1  # not read...
    assert sorted(p.name for p in (cache / "entries").glob("*/*")) == entries  # ...nor written
    torch._dynamo.reset()


def test_the_wrappers_flags_are_not_in_the_cache_key() -> None:
    from neuron_compile import Options
    from neuron_compile.cache.key import environment

    plain = Options(target="neuron", neuron_cc_flags=("-O1",))
    wrapped = Options(target="neuron", neuron_cc_flags=("--log_level=ERROR", "-O1", "--retry_failed_compilation"))
    assert environment(plain)["options"] == environment(wrapped)["options"]
    assert environment(plain)["options"] != environment(Options(target="neuron"))["options"]


@pytest.mark.parametrize("retry", [True, False])
def test_retry_failed_compilation_compiles_a_failed_graph_once_more(sim, monkeypatch, caplog, retry) -> None:
    """The first compile is killed (as the host's OOM killer would); with --retry_failed_compilation it runs once
    more and the graph compiles, without it the kill is the error."""
    real, calls = neuronx_cc.run, []

    def killed_once(command, workdir, **kw):
        calls.append(command)
        if len(calls) == 1:
            return neuronx_cc.RunResult(-signal.SIGKILL, "", "", 0.1, "")
        return real(command, workdir, **kw)

    monkeypatch.setattr(neuronx_cc, "run", killed_once)
    flags = ("--retry_failed_compilation",) if retry else ()
    target = NeuronTarget(flags=flags, cache_dir=sim.cache)
    with caplog.at_level("WARNING", logger="neuron_compile"):
        if retry:
            assert compute.read_neff(target.compile(_AXPY).neff).lnc == 2
        else:
            with pytest.raises(NeuronCompileError, match="killed by SIGKILL"):
                target.compile(_AXPY)
    assert len(calls) == (2 if retry else 1) and [r.returncode for r in COMPILER_RUNS] == ([-9, 0] if retry else [-9])
    assert any("compiling it once more" in r.getMessage() for r in caplog.records) == retry


def test_the_help_is_read_once_per_compiler_version_and_kept_beside_the_cache(sim, monkeypatch) -> None:
    asked = []
    real = subprocess.run

    def run(args, *a, **kw):
        asked.append(list(args)[1:])
        return real(args, *a, **kw)

    monkeypatch.setattr(neuronx_cc.subprocess, "run", run)
    for _ in range(3):
        NeuronTarget(cache_dir=sim.cache).command("m", "n")
    neuronx_cc.forget()  # a new process: the version is asked again, the help is read from disk
    NeuronTarget(cache_dir=sim.cache).command("m", "n")
    assert asked.count(["compile", "--help"]) == 1 and asked.count(["--version"]) == 2, asked
    kept = list(Path(sim.cache, "compiler").glob("*.json"))
    assert len(kept) == 1 and "--native-int64 <mode>" in kept[0].read_text()
    monkeypatch.setenv("NRTSIM_NATIVE_INT64", "absent")  # another compiler build: its own help
    neuronx_cc.forget()
    assert "--native-int64" not in NeuronTarget(cache_dir=sim.cache).command("m", "n")
    assert asked.count(["compile", "--help"]) == 2


def test_what_the_compiler_said_is_kept_in_the_cache_directory(tmp_path, monkeypatch) -> None:
    from neuron_compile.cache.paths import resolve_cache_dir

    monkeypatch.delenv("NEURON_COMPILE_CACHE_DIR", raising=False)
    assert neuronx_cc.facts_dir() == os.path.join(resolve_cache_dir(), "compiler")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_DIR", str(tmp_path / "env"))
    assert neuronx_cc.facts_dir() == os.path.join(resolve_cache_dir(), "compiler")
    assert neuronx_cc.facts_dir(str(tmp_path / "x")) == os.path.join(resolve_cache_dir(str(tmp_path / "x")), "compiler")


# ------------------------------------------------------------------------------- the input format
@pytest.mark.parametrize("setting", fake.INPUT_FORMATS)
def test_auto_finds_the_format_the_compiler_parses_and_remembers_it(sim, monkeypatch, setting) -> None:
    """compiler_input="auto": a StableHLO module first; a build that parses HLO protos refuses it as unparsable,
    and the same module goes again as an HLO proto, once. The answer is kept per compiler version: the next
    process hands the proto at once."""
    monkeypatch.setenv("NRTSIM_COMPILER_INPUT", setting)
    executable = NeuronTarget(cache_dir=sim.cache).compile(_AXPY)
    given = [Path(run.command[2]).name for run in COMPILER_RUNS]
    assert given == (["module.mlir"] if setting == "mlir" else ["module.mlir", "module.hlo.pb"]), given
    if setting == "hlo":
        assert neuronx_cc.refused_as_unparsable(COMPILER_RUNS[0].stderr), COMPILER_RUNS[0].stderr
    x, y = np.ones((2, 3), np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)
    out = compute.execute(executable.neff, {"input0": x.tobytes(), "input1": y.tobytes()})
    np.testing.assert_array_equal(np.frombuffer(out["output0"], np.float32).reshape(2, 3), x * 2 + y)
    neuronx_cc.forget()
    COMPILER_RUNS.clear()
    NeuronTarget(cache_dir=sim.cache).compile(_AXPY)
    assert [Path(run.command[2]).name for run in COMPILER_RUNS] == [neuronx_cc.MODULE_FILES[setting]]
    other = "hlo" if setting == "mlir" else "mlir"  # an explicit format is not retried
    with pytest.raises(NeuronCompileError, match="Error parsing message|cannot parse the StableHLO module"):
        NeuronTarget(compiler_input=other, cache_dir=sim.cache).compile(_AXPY)


def test_the_input_format_option_is_in_the_cache_key() -> None:
    from neuron_compile import Options

    auto, hlo = Options(target="neuron"), Options(target="neuron", compiler_input="hlo")
    assert auto.cache_relevant()["compiler_input"] == "auto" and auto.cache_relevant() != hlo.cache_relevant()
    assert Options.from_user({"compiler_input": "mlir"}).compiler_input == "mlir"


# ------------------------------------------------------------------------------- tensor names
@pytest.mark.parametrize("outputs", [1, 2])
def test_the_tensor_names_are_set_in_both_formats_and_the_root_is_a_tuple(outputs) -> None:
    """torch-xla's form: ``neff_input_names`` on each parameter, ``neff_output_names`` on the ROOT tuple, a tuple
    for one result too; the StableHLO module carries the same attributes."""
    fn = (lambda x, n: (x + n[0],)) if outputs == 1 else (lambda x, n: (n * 2, x[:, :0]))
    text = _lower(fn, jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int64))
    outs = [f"output{i}" for i in range(outputs)]
    named = jax_adapter.neff_module(text, ["input0", "input1"], outs)
    assert 'mhlo.frontend_attributes = {neff_input_names = "input1"}' in named
    assert "stablehlo.tuple %" in named and f'neff_output_names = "{",".join(outs)}"' in named
    from jax._src.lib import xla_client

    hlo = xla_client.XlaComputation(jax_adapter.hlo_module_proto(named)).as_hlo_text()
    assert re.search(r'parameter\(1\), frontend_attributes=\{neff_input_names="input1"\}', hlo), hlo
    root = next(line for line in hlo.splitlines() if line.strip().startswith("ROOT"))
    assert " tuple(" in root and f'neff_output_names="{",".join(outs)}"' in root, root


def test_the_fake_compiler_names_the_neffs_tensors_as_the_module_asks(sim) -> None:
    text = jax_adapter.neff_module(_AXPY, ["lhs", "rhs"], ["sum"])
    src = sim.tmp / "m.mlir"
    src.write_text(text)
    argv = ["compile", str(src), "--framework", "XLA", "--target", "trn2", "--output", str(sim.tmp / "m.neff")]
    assert fake.main(argv) == 0
    table = compute.read_neff((sim.tmp / "m.neff").read_bytes()).table
    assert [(t["usage"], t["name"]) for t in table] == [("in", "lhs"), ("in", "rhs"), ("out", "sum")]


# ------------------------------------------------------------------------------- custom calls
def test_device_calls_are_recognised_targets_with_api_version_unspecified() -> None:
    """The AwsNeuron* calls the compiler recognises carry API_VERSION_UNSPECIFIED, as torch-xla's HLO and nki's
    FrameworkKernel docs write them; AwsNeuronGeluApprxTanhBackward (not in NCC_EVRF015's list) is StableHLO."""
    from neuron_compile.lowering import device_calls as dc
    from tests.test_device_sim import _target

    x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    with _target("neuron"):
        erf = _lower(dc.erf, x)
        tanh_grad = _lower(lambda g, v: dc.gelu_backward(g, v, "tanh", lambda a, b: a * b), x, x)
    assert "stablehlo.custom_call @AwsNeuronErf(" in erf and "api_version = 0 : i32" in erf
    hlo = jax._src.lib._jax.mlir.mlir_module_to_xla_computation(erf, False, True).as_hlo_text()
    assert 'custom_call_target="AwsNeuronErf"' in hlo and "api_version=API_VERSION_UNSPECIFIED" in hlo
    assert "custom_call" not in tanh_grad and "@AwsNeuronGeluApprxTanhBackward__stablehlo(" in tanh_grad


# ------------------------------------------------------------------------------- NKI kernels
def test_nki_kernels_compile_through_nkis_compile_kernel_with_its_production_options(monkeypatch) -> None:
    """A stand-in for nki's ``CompileKernel`` (nki/framework/compiled.py: a dataclass of the kernel's settings,
    ``compile(*args) -> (FrameworkConfig, cache_key)``, which builds the production CompileOptions): the kernel's
    own settings are carried over, the target and artifacts directory set, the arguments bound by position; the
    bare ``compile_kernel_to_nir`` is not called (the stand-in has none)."""
    from neuron_compile.kernels import nki_compiled

    made = []

    @dataclasses.dataclass(frozen=True)
    class CompileKernel:  # the fields of nki's Kernel and CompileKernel that matter here
        func: object
        lnc: int | None = None
        schedule: object = None
        target: str | None = None
        artifacts_dir: str = ""
        _enable_backend_opt: bool = False

        def compile(self, *args):
            made.append((self, args))
            spec = types.SimpleNamespace(shape=(4, 8), dtype=np.float32)
            config = types.SimpleNamespace(
                backend_config_b64=b"eyJrIjogMX0=",
                output_specs=[spec],
                operand_output_aliases={},
                has_collectives=False,
            )
            return config, "cache-key"

    @dataclasses.dataclass(frozen=True)
    class Kernel:  # an @nki.jit kernel
        func: object
        lnc: int | None = 2
        schedule: object = "stream"

    compiled = types.ModuleType("nki.framework.compiled")
    compiled.CompileKernel = CompileKernel
    for name, module in {"nki": types.ModuleType("nki"), "nki.framework": types.ModuleType("nki.framework"),
                         "nki.framework.compiled": compiled}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)

    def kernel_fn(a, b, scale):
        return a

    config = nki_compiled._compile(Kernel(kernel_fn), (((4, 8), np.dtype("float32")),) * 2, (0.5,), "trn3")
    ((kernel, args),) = made
    assert (kernel.func, kernel.lnc, kernel.schedule, kernel.target) == (kernel_fn, 2, "stream", "trn3")
    assert os.path.isdir(kernel.artifacts_dir) and not kernel._enable_backend_opt
    assert [a.shape for a in args[:2]] == [(4, 8), (4, 8)] and args[2] == 0.5
    assert config.backend_config == "eyJrIjogMX0=" and config.outputs == (((4, 8), "float32"),)
    assert nki_compiled._compile(Kernel(kernel_fn, lnc=None), (((4, 8), np.dtype("float32")),), (), "trn2")
    assert made[-1][0].lnc == 1  # a kernel without a launch grid: LNC 1


# ------------------------------------------------------------------------------- a compile that never ends
def _mm_relu(x, w):
    return torch.mm(x, w).relu()  # the largest op: this line


def test_a_hung_compile_ends_at_the_timeout_with_the_graph_its_largest_op_and_the_log(sim, monkeypatch, capfd):
    """NRTSIM_COMPILE_DELAY stands for a compile that does not end: compile_timeout stops it; the error names the
    graph, the source line of its largest op and the end of the compiler's log; a progress line came every
    compile_progress_seconds; nothing is left running, no work directory is left."""
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", "120")
    torch._dynamo.reset()
    compiled = torch.compile(
        _mm_relu,
        backend="neuron",
        dynamic=False,
        options={"target": "neuron", "cache": False, "compile_timeout": 4, "compile_progress_seconds": 1,
                 "cache_dir": sim.cache},
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(Exception) as raised:
        compiled(torch.randn(64, 32), torch.randn(32, 128))
    elapsed = time.monotonic() - t0
    torch._dynamo.reset()
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    timeout = next((e for e in chain if isinstance(e, NeuronCompileTimeoutError)), None)
    assert timeout is not None, raised.value
    message = str(timeout)
    line = _mm_relu.__code__.co_firstlineno + 1
    assert elapsed < 60, elapsed
    assert "within 4s" in message and "compile_timeout" in message, message
    assert re.search(r"graph '\S*forward\S*'|graph '\S+'", message) and f"test_neuronx_cc.py:{line}" in message, message
    assert "Running pass: read input" in message  # the log's tail
    progress = [ln for ln in capfd.readouterr().err.splitlines() if "neuronx-cc is compiling graph" in ln]
    assert len(progress) >= 2, progress  # one a second, the compile's own passes named
    assert all(
        re.search(r"graph '\S+': \ds of 4s; last pass: (read input|verify|lower|tensorizer)", p) for p in progress
    )
    assert _wait_until(lambda: not _processes_under(sim.tmp)), _processes_under(sim.tmp)
    assert not list(sim.tmp.glob("neuron_compile_*"))


def test_a_compiler_killed_by_sigkill_is_said_to_be(sim, monkeypatch) -> None:
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", "120")
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, NeuronTarget(cache_dir=sim.cache).compile, _AXPY))
    thread.start()
    assert _wait_until(lambda: _compiler_pid(sim.tmp) is not None)
    os.kill(_compiler_pid(sim.tmp), signal.SIGKILL)
    thread.join(60)
    (error,) = errors
    assert "neuronx-cc was killed by SIGKILL (signal 9)" in str(error) and "exit -9" not in str(error), error
    assert "out-of-memory killer" in str(error)
    assert _wait_until(lambda: not _processes_under(sim.tmp) and not list(sim.tmp.glob("neuron_compile_*")))


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:
        errors.append(e)


def test_ctrl_c_in_the_process_stops_the_compile_and_removes_its_directory(sim, monkeypatch) -> None:
    """A Ctrl-C (SIGINT to the main thread, Python's default handler: KeyboardInterrupt) while neuronx-cc runs stops
    the compile: nothing left running, its work directory removed."""
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", "600")
    sent = []

    def ctrl_c() -> None:
        # Before the pass this waits for, the fake compiler runs its --help, imports jax and parses the module:
        # on a loaded machine that can take more than the 20 s default.
        if _wait_until(lambda: _compiler_pid(sim.tmp) is not None, seconds=300):
            sent.append(True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # What a terminal's user has, whatever an earlier test of this process left: Python's own handler, SIGINT not
    # blocked (twice in full runs of the suite, the SIGINT raised nothing and the compile ran on for 10 minutes).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        timer = threading.Thread(target=ctrl_c)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            NeuronTarget(cache_dir=sim.cache).compile(_AXPY)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert sent, "the compiler never reached its tensorizer pass"
    assert _wait_until(lambda: not _processes_under(sim.tmp)), _processes_under(sim.tmp)
    assert not list(sim.tmp.glob("neuron_compile_*"))


def test_stop_all_ends_every_compile_of_the_process(sim, monkeypatch) -> None:
    """What ``precompile compile`` does on Ctrl-C (then one line and exit 130, no traceback)."""
    monkeypatch.setenv("NRTSIM_COMPILE_DELAY", "120")
    errors = []
    threads = [threading.Thread(target=_catch, args=(errors, NeuronTarget(cache_dir=sim.cache).compile, _AXPY))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    assert _wait_until(lambda: len(glob.glob(str(sim.tmp / "neuron_compile_*" / neuronx_cc.LOG_FILE))) == 2)
    assert neuronx_cc.stop_all() == 2
    for t in threads:
        t.join(60)
    assert len(errors) == 2 and all(isinstance(e, NeuronCompileError) for e in errors), errors
    assert _wait_until(lambda: not _processes_under(sim.tmp) and not list(sim.tmp.glob("neuron_compile_*")))


_PARENT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from neuron_compile.runtime.neuron import NeuronTarget
    with jax.enable_x64(True):
        text = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).as_text()
    NeuronTarget(cache_dir={cache!r}).compile(text)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_the_compiler_dies_with_its_parent_and_leaves_no_directory(sim, sig) -> None:
    """A process compiling (the user's script, ``precompile compile``) is stopped by SIGTERM or killed by SIGKILL:
    the compiler does not run on as an orphan, its ``neuron_compile_*`` directory is removed."""
    env = {**os.environ, "TMPDIR": str(sim.tmp), "NRTSIM_COMPILE_DELAY": "120"}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT.format(cache=sim.cache)],
        env=env,
        cwd=device_sim.REPO_ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _wait_until(lambda: _compiler_pid(sim.tmp) is not None, 120), parent.poll()
        compiler = _compiler_pid(sim.tmp)
        os.kill(parent.pid, sig)
        assert parent.wait(60) == -sig
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.communicate()
    assert _wait_until(lambda: not os.path.exists(f"/proc/{compiler}/cmdline") or not _processes_under(sim.tmp))
    assert _wait_until(lambda: not _processes_under(sim.tmp)), _processes_under(sim.tmp)
    assert _wait_until(lambda: not list(sim.tmp.glob("neuron_compile_*"))), list(sim.tmp.iterdir())


def test_precompile_compile_ends_on_ctrl_c_with_one_line_and_status_130(monkeypatch, capsys) -> None:
    """``neuron-compile precompile compile``: compile_manifest stops the running compiles and says what it left
    (``stop_all``, above); the command then exits 130 without a traceback."""
    from neuron_compile import precompile

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(precompile, "compile_manifest", interrupted)
    assert precompile.main_compile("m.json", None, None, None, None) == 130
    assert "Traceback" not in capsys.readouterr().err
