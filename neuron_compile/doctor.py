"""``neuron-compile doctor``: can the neuron backend work on this machine? And what a bug report needs.

It prints, in sections: the versions of everything involved (Python, torch, jax/jaxlib, neuron_compile,
neuronx-cc, the Neuron runtime library, nki), the target ``"auto"`` resolves to and why, the NeuronCores the
runtime sees and the logical-core (LNC) setting, the compile cache directory (and the remote cache, if one
is configured), then a smoke test: a few tiny graphs compiled for the neuron target and for the CPU target,
whose results are compared. ``--bundle FILE.tar.gz`` also writes what a bug report needs (see ``write_bundle``).

Exit status (``main``): 0 the Neuron stack is here and works (every smoke test passed); 1 it is here but does
not work (a smoke test failed, the runtime's start included, the runtime library does not answer, or the core
settings are ones the runtime refuses), or ``require_remote`` (``--require-remote``) and the remote cache is
not configured or not reachable; 2 the Neuron compiler and/or runtime are not found on this machine (the smoke
test is skipped; versions and cache are still reported). An unreachable remote cache that is not required is
a note of the verdict: compiles work, they only share nothing.

Docs: docs/doctor.md.
"""

from __future__ import annotations

import datetime
import functools
import glob
import importlib.metadata
import io
import json
import os
import platform
import re
import shlex
import shutil
import sys
import tarfile
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from .cache.redact import redact, redact_url
from .errors import NeuronCompileError
from .options import Options, from_env, human_size, neuron_toolchain
from .runtime import libnrt, neuronx_cc, visible_cores
from .runtime.neuron import COMPILER_RUNS, CompilerRun, compiler_version
from .stats import STATS
from .version import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_NEURON = 2

#: Seconds the remote cache gets to answer a listing (one retry: at most about twice this).
REMOTE_TIMEOUT = 5.0

#: What ``environment.txt`` holds: variables whose names start with one of these...
ENV_PREFIXES = ("NEURON", "XLA_", "JAX_", "TORCH")
#: ...and these exact names. Nothing else of the environment goes into a bundle.
ENV_NAMES = ("PATH", "LD_LIBRARY_PATH", "LOCAL_RANK", "WORLD_SIZE")
#: A variable whose name contains one of these is left out (e.g. NEURON_COMPILE_CACHE_HMAC_KEY)...
_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")
#: ...and so is one whose value looks like a credential: an AWS access key id, or one long token of key-like
#: characters with letters and digits (not a path, not a list).
_AWS_KEY_ID = re.compile(r"(?:AKIA|ASIA)[0-9A-Z]{16}")
_LONG_TOKEN = re.compile(r"[A-Za-z0-9+=_-][A-Za-z0-9+/=_-]{31,}")
#: debug.process_dir's folder, one per process: left out of the bundle's paths.
_PROCESS_DIR = re.compile(r"/neuron_compile_[0-9]{8}-[0-9]{6}_pid[0-9]+/")

INSTALL_COMPILER = (
    "install the Neuron compiler: python -m pip install neuronx-cc "
    "--extra-index-url=https://pip.repos.neuron.amazonaws.com (Neuron SDK setup guide), so that `neuronx-cc` "
    "is on PATH"
)
INSTALL_RUNTIME = (
    "install the Neuron runtime: the aws-neuronx-runtime-lib package (with the driver aws-neuronx-dkms) from "
    f"the Neuron apt/yum repository puts libnrt.so.1 in {os.path.dirname(libnrt.DEFAULT_LIBRARY)}; or set "
    f"{libnrt.LIBRARY_ENV}=/path/to/libnrt.so.1"
)


# ------------------------------------------------------------------------------------------- output
class Report:
    """The printed report: each line goes to ``out`` at once (a long smoke test shows progress) and is
    kept for ``doctor.txt``."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.lines: list[str] = []

    def line(self, text: str = "") -> None:
        """Print one line (or several, separated by newlines)."""
        for part in text.split("\n"):
            self.lines.append(part)
            print(part, file=self.out, flush=True)

    def section(self, title: str) -> None:
        """A section heading, preceded by a blank line."""
        self.line()
        self.line(f"== {title} ==")

    def row(self, key: str, value: str) -> None:
        """``key`` and ``value`` in two columns; a multi-line value is indented under its first line."""
        first, *rest = str(value).split("\n")
        self.line(f"  {key:<26} {first}")
        for more in rest:
            self.line(f"  {'':<26} {more}")

    def text(self) -> str:
        """Everything printed so far."""
        return "\n".join(self.lines) + "\n"


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


# ----------------------------------------------------------------------------------------- versions
def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nki_version() -> str:
    from .kernels import nki_api

    if not nki_api.EMULATED:
        return f"nki {_dist_version('nki')} (the real package)"
    installed = _dist_version("nki")
    if os.environ.get("NEURON_COMPILE_NKI", "").lower() == "emulator":
        return "emulator (forced by NEURON_COMPILE_NKI=emulator)"
    if installed != "not installed":
        return f"emulator (nki {installed} is installed but is not the AWS package, or does not import)"
    return "emulator (nki not installed)"


@functools.lru_cache(maxsize=None)
def _runtime_info(path: str) -> dict[str, Any] | str:
    """libnrt's version and core counts (``libnrt.library_info``: read without ``nrt_init``, so the doctor
    does not take the cores unless the smoke test runs), or the first line of why they could not be read."""
    try:
        return libnrt.library_info(path)
    except NeuronCompileError as e:
        return _first_line(str(e))


def _libnrt_row(path: str) -> str:
    info = _runtime_info(path)
    if isinstance(info, str):
        return f"{path}; version: not read ({info})"
    return f"{path}; version {info['version']}"


def _backend_registered() -> str:
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    for ep in eps:
        if ep.name == "neuron":
            return f"registered with torch.compile (entry point {ep.value})"
    return ("NOT registered: torch.compile(backend='neuron') will not find it; install the package "
            "(python -m pip install -e . in a checkout)")  # fmt: skip


def _neuron_device() -> str:
    """Which ``neuron`` device PyTorch has (PrivateUse1 holds one device, whoever registers it first):
    neuron_compile's (docs/device.md), another library's (TorchNeuron's torch_neuronx), or none."""
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        return (
            "none: PrivateUse1 is free (import neuron_compile registers the 'neuron' device where libnrt is found "
            "or NEURON_COMPILE_DEVICE=1; neuron_compile.device.register() does it here)"
        )
    module = getattr(torch, name, None)
    if name == "neuron" and type(module).__module__ == "neuron_compile.device":
        return "neuron_compile's: tensors on 'neuron' keep their data on the NeuronCore (docs/device.md)"
    owner = "TorchNeuron's torch_neuronx" if "torch_neuronx" in sys.modules else "another library"
    return (
        f"{owner}'s: PrivateUse1 is registered as {name!r}, so neuron_compile's device is not; compiled graphs "
        "take CPU tensors"
    )


def collect_versions() -> dict[str, str]:
    """The versions a bug report needs, by component (``versions.json``; the report's first section)."""
    compiler = shutil.which("neuronx-cc")
    library = _library()
    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "jax": _dist_version("jax"),
        "jaxlib": _dist_version("jaxlib"),
        "numpy": _dist_version("numpy"),
        "neuron_compile": f"{__version__} ({Path(__file__).resolve().parent})",
        "neuronx-cc": f"{compiler_version()} ({compiler})" if compiler else "not found on PATH",
        "libnrt": _libnrt_row(library) if library else _library_missing(),
        "nki": _nki_version(),
        "backend 'neuron'": _backend_registered(),
        "device 'neuron'": _neuron_device(),
    }


def _library() -> str | None:
    """libnrt.so.1's path if it is there (an explicit path that does not exist counts as not found)."""
    path = libnrt.library_path()
    if path is not None and os.path.isabs(path) and not os.path.exists(path):
        return None
    return path


def _library_missing() -> str:
    explicit = os.environ.get(libnrt.LIBRARY_ENV, "").strip()
    if explicit:
        return f"not found: {libnrt.LIBRARY_ENV}={explicit} does not exist"
    return f"not found (looked at ${libnrt.LIBRARY_ENV}, {libnrt.DEFAULT_LIBRARY} and the loader's path)"


def _neuron_devices() -> str:
    devices = sorted(glob.glob("/dev/neuron[0-9]*"), key=lambda p: int(re.sub(r"\D", "", p) or 0))
    if not devices:
        return "none (/dev/neuron* absent: not a Trainium instance, or the driver aws-neuronx-dkms is not loaded)"
    return f"{len(devices)}: {devices[0]} .. {devices[-1]}" if len(devices) > 1 else devices[0]


def _instance_type() -> str:
    try:
        return Path("/sys/devices/virtual/dmi/id/product_name").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------- machine checks
@dataclass
class Findings:
    """What the checks found that decides the exit status."""

    missing: list[str] = field(default_factory=list)  # "neuronx-cc", "libnrt.so.1"
    problems: list[str] = field(default_factory=list)  # the stack is here but something does not work
    notes: list[str] = field(default_factory=list)  # worth knowing, does not change the status
    auto_target: str = "cpu"  # what the target "auto" resolves to here
    remote_down: str = ""  # why the configured remote cache is not usable ("" when it is, or none is set)


def _user_options(report: Report, findings: Findings) -> Options | None:
    try:
        return Options.from_user({})
    except NeuronCompileError as e:
        report.row("options", f"INVALID: {e}")
        findings.problems.append(f"the backend's options do not parse: {e}")
        return None


def check_target(report: Report, findings: Findings) -> Options | None:
    """The "Target" section: the toolchain, what "auto" resolves to and why; returns the options in effect."""
    report.section("Target")
    available, found = neuron_toolchain()
    findings.auto_target = "neuron" if available else "cpu"
    report.row('"auto" resolves to', f"{findings.auto_target} ({found})")
    if shutil.which("neuronx-cc") is None:
        findings.missing.append("neuronx-cc")
    if _library() is None:
        findings.missing.append("libnrt.so.1")
    chosen = os.environ.get("NEURON_COMPILE_TARGET", "").strip()
    report.row("NEURON_COMPILE_TARGET", chosen or '(unset: the default target is "auto")')
    opts = _user_options(report, findings)
    if opts is not None:
        report.row("default target here", opts.target)
        report.row(
            "generation / opt level",
            f"{opts.generation} / -O{opts.opt_level}"
            + (f", extra flags {shlex.join(opts.neuron_cc_flags)}" if opts.neuron_cc_flags else ""),
        )
        report.row("NKI kernels", f"{opts.kernels} (option kernels / NEURON_COMPILE_KERNELS)")
    if available:
        from .kernels import nki_api

        if nki_api.EMULATED:
            findings.notes.append(
                "the real nki package is not in use, so NKI kernel sites compile as their reference StableHLO on "
                "the neuron target (the smoke test's kernel sites too): install the Neuron SDK's nki for the kernels"
            )
    report.row("instance type", _instance_type())
    report.row("Neuron devices", _neuron_devices())
    return opts


def check_cores(report: Report, findings: Findings, opts: Options | None) -> None:
    """The "NeuronCores" section: the environment's core settings, LNC, and what the runtime counts."""
    report.section("NeuronCores")
    for name in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES"):
        report.row(name, os.environ.get(name, "").strip() or "(unset: every core of the instance)")
    visible_value = os.environ.get(visible_cores.ENV, "").strip()
    try:
        visible_cores.from_environment()
        refused = False
    except visible_cores.VisibleCoresError as e:
        refused = True
        findings.problems.append(str(e).removeprefix("neuron runtime: "))
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    if local_rank:
        report.row("LOCAL_RANK", f"{local_rank} (torchrun: without NEURON_RT_VISIBLE_CORES this rank takes core "
                   f"{local_rank} only)")  # fmt: skip
    lnc_env = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if opts is not None:
        report.row("NEURON_LOGICAL_NC_CONFIG", f"{lnc_env or '(unset)'} -> option lnc = {opts.lnc} "
                   f"(neuronx-cc --lnc {opts.lnc}; the runtime must run with the same)")  # fmt: skip
        core = opts.neuron_core if opts.neuron_core is not None else 0
        how = "option neuron_core / NEURON_COMPILE_CORE" if opts.neuron_core is not None else "the default"
        report.row("graphs run on", f"logical NeuronCore {core}, counted from the process's first one ({how})")
        from .hbm import compiler_size, hbm_per_core, limit_for

        per_core = hbm_per_core(opts.generation, opts.lnc)
        limit = limit_for(opts)
        report.row(
            "HBM per logical core",
            f"{compiler_size(per_core)} ({opts.generation} at LNC {opts.lnc}): the device's memory limit, and what "
            "neuronx-cc checks a graph's I/O tensors against (NCC_EVRF009)"
            + ("" if limit == per_core else f"; graphs are checked against option hbm_limit: "
               f"{compiler_size(limit) if limit else 'off'}"),
        )  # fmt: skip
    else:
        report.row("NEURON_LOGICAL_NC_CONFIG", lnc_env or "(unset)")
        core = None
    library = _library()
    if library is None:
        report.row("visible / total", "not read: libnrt.so.1 not found")
        return
    if refused:
        report.row("visible / total", f"not read: the runtime refuses {visible_cores.ENV}={visible_value!r} (see the "
                   "verdict)")  # fmt: skip
        return
    info = _runtime_info(library)
    if isinstance(info, str) and visible_value:
        # the runtime counts nothing while NEURON_RT_VISIBLE_CORES names cores it does not have: its total
        # without the variable says whether that is why
        total = _total_cores_without_visible(library)
        why = visible_cores.check_total(visible_value, total, _runtime_lnc()) if total is not None else None
        if why is not None:
            report.row("visible / total", f"not read: {why}")
            findings.problems.append(why)
            return
    if isinstance(info, str):
        report.row("visible / total", f"ERROR: {info}")
        findings.problems.append(f"the Neuron runtime library does not answer: {info}")
        return
    visible, total = info["visible_cores"], info["total_cores"]
    report.row("visible / total", f"{visible} of {total} logical NeuronCores")
    beyond = visible_cores.check_total(visible_value, total, _runtime_lnc()) if visible_value else None
    if beyond is not None:  # a runtime that counts anyway would fail at nrt_init
        findings.problems.append(beyond)
    if visible == 0:
        findings.problems.append(
            "the runtime sees no NeuronCore: check NEURON_RT_VISIBLE_CORES and that no other process holds the "
            "cores (neuron-top)"
        )
    elif core is not None and core >= visible:
        findings.problems.append(
            f"graphs would run on logical NeuronCore {core}, but only {visible} {'is' if visible == 1 else 'are'} "
            "visible to this process: set the option "
            "neuron_core (NEURON_COMPILE_CORE) or NEURON_RT_VISIBLE_CORES"
        )


def _runtime_lnc() -> int | str:
    """The logical-core size the runtime runs with (its environment, as the option ``lnc`` reads it)."""
    try:
        return from_env("lnc")
    except NeuronCompileError:
        return os.environ.get("NEURON_LOGICAL_NC_CONFIG", "?")


def _total_cores_without_visible(library: str) -> int | None:
    """The runtime's total logical NeuronCores counted with NEURON_RT_VISIBLE_CORES unset for the call (the
    doctor is single-threaded here, and restores it); None when it does not answer that way either."""
    saved = os.environ.pop(visible_cores.ENV, None)
    try:
        return libnrt.library_info(library)["total_cores"]
    except NeuronCompileError:
        return None
    finally:
        if saved is not None:
            os.environ[visible_cores.ENV] = saved


def check_cache(report: Report, findings: Findings, opts: Options | None, require_remote: bool = False) -> None:
    """The "Compile cache" section: the directory the cache uses (exists, writable, trusted, entries, size)
    and the remote cache if ``cache_url`` is set (reachable, with a listing under a short deadline)."""
    from .cache.paths import ENV_DIR, resolve_cache_dir
    from .cache.store import DiskStore

    report.section("Compile cache")
    from .runtime import neuronx_cc

    explicit = opts.cache_dir if opts is not None else None
    flags = tuple(opts.neuron_cc_flags) if opts is not None else None
    root = resolve_cache_dir(explicit, flags)
    # no options are given here: a cache_dir can only come from the environment
    if os.environ.get(ENV_DIR, "").strip():
        source = f"${ENV_DIR}"
    elif neuronx_cc.cache_dir_from_flags(neuronx_cc.env_flags() if flags is None else flags):
        source = "--cache_dir in $NEURON_CC_FLAGS, torch-neuronx's wrapper flag"
    else:
        source = "the user cache dir"
    report.row("directory", f"{root} (from {source})")
    if opts is not None and not opts.cache:
        report.row("enabled", "no (NEURON_COMPILE_CACHE is off: every graph is compiled again)")
    elif opts is not None and neuronx_cc.wrapper_flags(flags).no_cache:
        report.row("enabled", "no (--no_cache in NEURON_CC_FLAGS: every graph is compiled again)")
    if os.path.isdir(root):
        writable = os.access(root, os.W_OK | os.X_OK)
        report.row("exists / writable", f"yes / {'yes' if writable else 'NO: compiled graphs will not be stored'}")
        if not writable:
            findings.notes.append(f"the cache directory {root} is not writable: set {ENV_DIR} to a directory of yours")
        store = DiskStore(root)
        reason = store.untrusted_reason()
        report.row("trusted", "yes" if reason is None else f"NO ({reason}): not used unless trust_cache_dir")
        if reason is not None and not (opts is not None and opts.trust_cache_dir):
            findings.notes.append(f"the compile cache is not used ({reason}): set {ENV_DIR} to a private directory")
        infos = list(store.entries())
        left = store.leftovers()
        report.row("entries", f"{len(infos)}, {human_size(sum(e.size for e in infos))}"
                   + (f" (+ {len(left)} leftovers of interrupted writes)" if left else ""))  # fmt: skip
    elif os.path.exists(root):
        report.row("exists", "NO: it is not a directory; the cache will not be used")
        findings.notes.append(f"{root} is not a directory: set {ENV_DIR} to a directory")
    else:
        parent = root
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        ok = os.access(parent, os.W_OK | os.X_OK)
        report.row("exists", "no: created at the first compile" + ("" if ok else f", but {parent} is NOT writable"))
        if not ok:
            findings.notes.append(
                f"the cache directory {root} cannot be created: set {ENV_DIR} to a directory of yours"
            )
    check_remote(report, opts, findings, require_remote)


def check_remote(
    report: Report, opts: Options | None, findings: Findings | None = None, required: bool = False
) -> None:
    """The remote cache row(s): not configured, or reachable with its entry count, or the error. Unreachable
    is a note of the verdict, or with ``required`` (``--require-remote``) a problem, as is none configured."""
    findings = findings if findings is not None else Findings()
    url = opts.cache_url if opts is not None else None
    if not url:
        report.row("remote cache", "not configured (option cache_url / NEURON_COMPILE_CACHE_URL)")
        if required:
            findings.problems.append(
                "--require-remote, but no remote cache is configured: set NEURON_COMPILE_CACHE_URL (option cache_url)"
            )
        return
    from .cache.remote import RemoteStore, RemoteUnavailable, hmac_key_from_env

    signed = "signed (NEURON_COMPILE_CACHE_HMAC_KEY set)" if hmac_key_from_env() else "unsigned"
    shown = redact_url(url)
    report.row("remote cache", f"{shown} ({signed})")
    t0 = time.perf_counter()
    try:
        count, size = RemoteStore(url, timeout=REMOTE_TIMEOUT, hmac_key=hmac_key_from_env()).usage()
    except (RemoteUnavailable, OSError) as e:
        why = " ".join(redact(e, [url]).split()) or type(e).__name__
        report.row("reachable", f"NO ({time.perf_counter() - t0:.1f}s): {why}. "
                   "Compiles still work; they just do not share entries")  # fmt: skip
        findings.remote_down = why
        if required:
            findings.problems.append(f"the remote cache {shown} is not reachable (--require-remote): {why}")
        else:
            short = why if len(why) <= 160 else why[:157] + "..."
            findings.notes.append(
                f"the remote cache {shown} is NOT reachable ({short}): this host compiles every graph itself and "
                "shares none (precompiled entries there are not used). Check the URL, credentials and network; "
                "--require-remote makes this a failure"
            )
        return
    report.row("reachable", f"yes ({time.perf_counter() - t0:.1f}s): {count} entries, {human_size(size)}")


# --------------------------------------------------------------------------------------- smoke test
@dataclass(frozen=True)
class SmokeCase:
    """One smoke-test graph. ``run(options)`` compiles it with ``torch.compile(..., backend="neuron",
    options=options)``, runs it on fixed inputs and returns its results by label; the two targets' results
    must agree within ``rtol``/``atol``; ``min_kernel_sites``: NKI kernel sites the compiled graphs must have."""

    name: str
    run: Callable[[dict[str, Any]], dict[str, torch.Tensor]]
    rtol: float
    atol: float
    min_kernel_sites: int = 0


@dataclass
class SmokeResult:
    """The outcome of one ``SmokeCase``: ``error`` is the first line of what went wrong ("" when it passed)."""

    name: str
    passed: bool
    max_abs_error: float | None
    seconds: float
    error: str = ""
    details: str = ""  # the full traceback or mismatch report (bundled)
    compiler_runs: list[CompilerRun] = field(default_factory=list)  # the case's neuronx-cc runs


def _compile(fn: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    return torch.compile(fn, backend="neuron", options=options, dynamic=False)


def _inputs(seed: int, *shapes: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype) for shape, dtype in shapes]


def _add(options: dict[str, Any]) -> dict[str, torch.Tensor]:
    a, b = _inputs(1, ((64, 64), torch.float32), ((64, 64), torch.float32))
    return {"a + b": _compile(lambda x, y: x + y, options)(a, b)}


def _matmul_bf16(options: dict[str, Any]) -> dict[str, torch.Tensor]:
    a, b = _inputs(2, ((64, 128), torch.bfloat16), ((128, 64), torch.bfloat16))
    return {"a @ b": _compile(lambda x, y: x @ y, options)(a, b)}


def _nki_sites(options: dict[str, Any]) -> dict[str, torch.Tensor]:
    x, w, b = _inputs(3, ((32, 64), torch.float32), ((64,), torch.float32), ((64,), torch.float32))

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.softmax(x, dim=-1), torch.nn.functional.layer_norm(x, (64,), w, b)

    soft, norm = _compile(fn, options)(x, w, b)
    return {"softmax": soft, "layer_norm": norm}


def _mlp_step(options: dict[str, Any]) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x, y = _inputs(5, ((16, 32), torch.float32), ((16, 8), torch.float32))
    step = _compile(lambda x, y: torch.nn.functional.mse_loss(model(x), y), options)
    loss = step(x, y)
    loss.backward()
    results = {"loss": loss.detach()}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise AssertionError(f"no gradient for {name}: the backward graph did not run")
        results[f"grad {name}"] = p.grad
    return results


#: The smoke test, in order. Tolerances fit the dtype: float32 ops that round the same way on every
#: device (an add) get torch's float32 defaults; reductions and transcendental functions (softmax,
#: layer_norm, a training step) 1e-4 relative; bfloat16 results one bf16 rounding step (2^-7 ~ 0.8%) twice.
SMOKE_CASES: tuple[SmokeCase, ...] = (
    SmokeCase("add float32", _add, rtol=1.3e-6, atol=1e-5),
    SmokeCase("matmul bfloat16", _matmul_bf16, rtol=1.6e-2, atol=1e-2),
    SmokeCase("softmax + layer_norm (NKI sites)", _nki_sites, rtol=1e-4, atol=1e-5, min_kernel_sites=2),
    SmokeCase("MLP training step float32", _mlp_step, rtol=1e-4, atol=1e-5),
)


def _root_cause(e: BaseException) -> BaseException:
    """The error under torch's wrappers (Dynamo's BackendCompilerFailed and the like)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None or not type(e).__module__.startswith("torch."):
            break
        e = inner
    return e


def _describe(e: BaseException) -> str:
    cause = _root_cause(e)
    line = _first_line(str(cause))
    return f"{type(cause).__name__}: {line}" if line else type(cause).__name__


def _compare(case: SmokeCase, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(max abs error over every result, "" or what does not match)."""
    if list(got) != list(want):
        return float("nan"), f"the targets returned different results: {list(got)} vs {list(want)}"
    worst, problems = 0.0, []
    for label, a in got.items():
        b = want[label]
        if a.shape == b.shape:
            diff = (a.detach().double() - b.detach().double()).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        try:
            torch.testing.assert_close(a, b, rtol=case.rtol, atol=case.atol, equal_nan=True)
        except AssertionError as err:
            lines = [ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()]
            problems.append(f"{label}: " + ("; ".join(lines) if lines else _first_line(str(err))))
    return worst, "\n".join(problems)


def run_case(
    case: SmokeCase, target: str = "neuron", reference: str = "cpu", debug_dir: str | None = None
) -> SmokeResult:
    """Run ``case`` on ``target`` and on ``reference`` (Dynamo reset before each) and compare the results.

    With ``debug_dir``, each target's graphs are dumped under ``debug_dir/<target>`` (FX graph, StableHLO).
    On the neuron target the graphs must have run on a NeuronCore (libnrt executions counted)."""
    t0 = time.perf_counter()
    results: list[dict[str, torch.Tensor]] = []  # the target's, then the reference's
    before = list(COMPILER_RUNS)  # held, so that no new run can be mistaken for one of them
    runs = lambda: [run for run in COMPILER_RUNS if not any(run is old for old in before)]  # noqa: E731
    try:
        for which in (target, reference):
            options: dict[str, Any] = {"target": which, "cache": False, "kernels": "reference"}
            if debug_dir is not None:
                options["debug_dir"] = os.path.join(debug_dir, which)
            torch._dynamo.reset()
            first_graph, executions = len(STATS.graphs), STATS.device_executions
            results.append(case.run(options))
            sites = sum(g.nki_kernels for g in STATS.graphs[first_graph:])
            if sites < case.min_kernel_sites:
                raise AssertionError(
                    f"target {which}: {sites} NKI kernel site(s) compiled, expected >= {case.min_kernel_sites} "
                    "(are the kernels routed? see lowering/kernel_routing.py)"
                )
            if which == "neuron" and STATS.device_executions == executions:
                raise AssertionError("target neuron: nothing ran on a NeuronCore (no libnrt execution)")
    except Exception as e:
        return SmokeResult(
            case.name, False, None, time.perf_counter() - t0, _describe(e), traceback.format_exc(), runs()
        )
    finally:
        torch._dynamo.reset()
    worst, mismatch = _compare(case, results[0], results[1])
    seconds = time.perf_counter() - t0
    if mismatch:
        return SmokeResult(
            case.name,
            False,
            worst,
            seconds,
            _first_line(mismatch),
            f"{target} vs {reference}, rtol={case.rtol} atol={case.atol}:\n{mismatch}",
            runs(),
        )
    return SmokeResult(case.name, True, worst, seconds, compiler_runs=runs())


def run_smoke(
    report: Report,
    cases: tuple[SmokeCase, ...] = SMOKE_CASES,
    target: str = "neuron",
    reference: str = "cpu",
    debug_dir: str | None = None,
) -> list[SmokeResult]:
    """The "Smoke test" section: every case run and printed as a row of a pass/fail table."""
    report.section(f"Smoke test ({target} target vs {reference} target, cache off)")
    header = f"  {'graph':<34} {'result':<6} {'max abs error':>13} {'seconds':>8}"
    report.line(header)
    report.line("  " + "-" * (len(header) - 2))
    results = []
    for case in cases:
        r = run_case(case, target, reference, debug_dir and os.path.join(debug_dir, _slug(case.name)))
        err = "-" if r.max_abs_error is None else f"{r.max_abs_error:.3g}"
        report.line(f"  {r.name:<34} {'PASS' if r.passed else 'FAIL':<6} {err:>13} {r.seconds:>8.1f}")
        if not r.passed:
            _bullet(report, r.error, "      ")
        results.append(r)
    return results


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


# ------------------------------------------------------------------------------------------- compiler probes
@dataclass
class CompilerProbes:
    """What the installed neuronx-cc was found to take (``check_compiler``)."""

    version: str
    help_text: str
    #: input format -> "parses it" or why not (its refusal's first line)
    formats: dict[str, str]
    native_int64: str
    command: list[str]
    #: the runtime's listing of the probe NEFF's tensors, or why there is none
    listing: list[str] | str
    runs: list[tuple[str, CompilerRun]] = field(default_factory=list)

    def takes(self) -> list[str]:
        return [fmt for fmt, verdict in self.formats.items() if verdict == "parses it"]

    def summary(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "input_formats": self.formats,
            "takes": self.takes(),
            "native_int64": self.native_int64,
            "command": self.command,
            "probe_module": PROBE_MODULE,
        }

    def listing_text(self) -> str:
        head = f"The runtime's tensors of the probe NEFF ({PROBE_MODULE}):\n"
        if isinstance(self.listing, str):
            return head + f"  none: {self.listing}\n"
        return head + "".join(f"  {line}\n" for line in self.listing)


#: The probe graph: two inputs and two outputs, one of them int64 and one of size zero: what a first NEFF shows
#: of how the compiler names, sizes and types tensors (a zero-size tensor is a known trouble spot).
PROBE_MODULE = "inputs x: float32[2, 3], n: int64[4]; outputs n * 2: int64[4], x[:, :0]: float32[2, 0]"


def probe_module() -> str:
    """The probe graph's StableHLO (see ``PROBE_MODULE``)."""
    import jax
    import jax.numpy as jnp

    def probe(x: Any, n: Any) -> Any:
        return n * 2, x[:, :0]

    with jax.enable_x64(True):
        structs = (jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int64))
        return jax.jit(probe).lower(*structs).as_text()


def _native_int64_form(help: neuronx_cc.CompilerHelp) -> str:
    flag = help.flags.get("--native-int64")
    if flag is None:
        return "not listed: int64 is computed as int32 by this compiler (neuron_compile passes no flag)"
    if not flag.takes_value:
        return "a switch: passed bare (--native-int64)"
    values = f" ({', '.join(flag.choices)})" if flag.choices else ""
    return f"takes {flag.metavar}{values}: passed as --native-int64 enabled"


def check_compiler(report: Report, findings: Findings, opts: Options | None, runtime: bool) -> CompilerProbes:
    """The "neuronx-cc" section: what its ``compile --help`` lists, which input format it parses (the probe
    graph compiled as a StableHLO module and as an HLO proto: the answer is remembered for the cache, as a compile
    with compiler_input="auto" would learn it) and, with the runtime here, its tensors as the runtime lists them."""
    from .runtime.neuron import NeuronTarget
    from .runtime.targets import GraphLabel

    report.section("neuronx-cc")
    cache_dir = opts.cache_dir if opts is not None else None
    generation, lnc = (opts.generation, opts.lnc) if opts is not None else ("trn2", 2)
    target = NeuronTarget(generation, lnc=lnc, cache_dir=cache_dir)
    help = target.compiler_help()
    report.row("compile --help", f"{len(set(map(id, help.flags.values())))} options listed"
               + (" (none understood: the CLI reference's stand in)" if help.documented else ""))  # fmt: skip
    native = _native_int64_form(help)
    report.row("--native-int64", native)
    try:
        command = target.command("module.mlir", "module.neff")
    except NeuronCompileError as e:
        command = []
        findings.problems.append(str(e))
    text = probe_module()
    formats: dict[str, str] = {}
    runs: list[tuple[str, CompilerRun]] = []
    neff: bytes | None = None
    for fmt in neuronx_cc.INPUT_FORMATS:
        before = len(COMPILER_RUNS)
        probe = NeuronTarget(generation, lnc=lnc, compiler_input=fmt, compile_timeout=1800, cache_dir=cache_dir)
        probe.progress = report.line
        try:
            executable = probe.compile(text, graph=GraphLabel(f"doctor probe ({fmt})"))
        except NeuronCompileError as e:
            said = str(e)
            why = "does not parse it" if neuronx_cc.refused_as_unparsable(said) else "fails on it"
            formats[fmt] = f"{why}: {_first_line(said.split(':', 1)[-1])[:300]}"
        else:
            formats[fmt] = "parses it"
            neff = neff or executable.neff
        runs.extend((fmt, run) for run in list(COMPILER_RUNS)[before:])
    takes = [fmt for fmt, verdict in formats.items() if verdict == "parses it"]
    report.row("input it parses", ", ".join(takes) if takes else "NEITHER (see the problems)")
    for fmt, verdict in formats.items():
        report.row(f"  as {fmt}", verdict)
    if len(takes) == 1:  # what compiler_input="auto" would learn: remembered for the next compile
        neuronx_cc.remember(target.facts_dir, compiler_version(), input_format=takes[0])
    elif not takes:
        findings.problems.append(
            f"neuronx-cc compiled the probe graph ({PROBE_MODULE}) neither as a StableHLO module nor as an HLO proto"
        )
    listing: list[str] | str
    if neff is None:
        listing = "no probe NEFF was compiled"
    elif not runtime:
        listing = "libnrt.so.1 not found"
    else:
        try:
            listing = [f"{t.describe()} nrt_dtype={t.dtype}" for t in libnrt.tensor_listing(neff, target.core)]
        except NeuronCompileError as e:
            listing = f"the runtime refused the probe NEFF: {_first_line(str(e))}"
    report.row("probe NEFF's tensors", listing if isinstance(listing, str) else "\n".join(listing))
    return CompilerProbes(compiler_version(), help.text, formats, native, command, listing, runs)


# ------------------------------------------------------------------------------------------- bundle
def _secret_looking(name: str, value: str) -> bool:
    if any(word in name.upper() for word in _SECRET_WORDS):
        return True
    token = value.strip()
    if _AWS_KEY_ID.fullmatch(token):
        return True
    return bool(_LONG_TOKEN.fullmatch(token)) and any(c.isdigit() for c in token) and any(c.isalpha() for c in token)


def bundle_environment() -> str:
    """``environment.txt``: the variables named by ``ENV_PREFIXES``/``ENV_NAMES`` only; every secret-looking one
    (by its name or its value) left out, named in a last comment line; a URL's user:password part removed."""
    lines, left_out = [], []
    for name in sorted(os.environ):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        value = os.environ[name]
        if _secret_looking(name, value):
            left_out.append(name)
            continue
        lines.append(f"{name}={redact(value)}")
    if left_out:
        lines.append(f"# left out (secret-looking): {', '.join(left_out)}")
    return "\n".join(lines) + "\n"


def _compiler_log(run: CompilerRun, graph: str | None) -> str:
    return (f"command: {shlex.join(run.command)}\nexit code: {run.returncode}\nseconds: {run.seconds:.2f}\n"
            f"smoke graph: {graph or '-'}\n\n--- stdout ---\n{run.stdout}\n--- stderr ---\n{run.stderr}"
            + (f"\n--- log (its end) ---\n{run.log[-20000:]}" if run.log else ""))  # fmt: skip


def write_bundle(
    path: str,
    staging: str,
    report: Report,
    versions: dict[str, str],
    smoke: list[SmokeResult],
    probes: CompilerProbes | None = None,
) -> list[str]:
    """Write the tarball ``path``: ``doctor.txt`` (the report), ``versions.json``, ``environment.txt``,
    ``graphs/`` (the smoke test's FX graphs and StableHLO, from ``staging``/graphs), ``smoke/NAME.txt`` (each
    failure in full), ``compiler/NN.txt`` (each neuronx-cc run of this process: command, exit code,
    stdout, stderr, its log's end) and, with ``probes``, ``compiler/help.txt`` (its ``compile --help``),
    ``compiler/probes.json`` (the input formats it parses, how it lists --native-int64, the command line
    neuron_compile builds) and ``runtime/probe_neff.txt`` (the runtime's tensor listing of the probe NEFF).
    Returns the member names."""
    files: dict[str, str] = {
        "doctor.txt": report.text(),
        "versions.json": json.dumps(versions, indent=1) + "\n",
        "environment.txt": bundle_environment(),
    }
    for r in smoke:
        if not r.passed:
            files[f"smoke/{_slug(r.name)}.txt"] = f"{r.name}: {r.error}\n\n{r.details}\n"
    owner = {id(run): r.name for r in smoke for run in r.compiler_runs}
    if probes is not None:
        owner.update({id(run): f"probe ({fmt})" for fmt, run in probes.runs})
        files["compiler/help.txt"] = probes.help_text or "(no compile --help was read)\n"
        files["compiler/probes.json"] = json.dumps(probes.summary(), indent=1) + "\n"
        files["runtime/probe_neff.txt"] = probes.listing_text()
    for i, run in enumerate(COMPILER_RUNS, 1):
        files[f"compiler/{i:02d}.txt"] = _compiler_log(run, owner.get(id(run)))
    # whatever a member quotes (a traceback, a compiler's output), never a credential of a URL of the environment
    urls = [value for value in os.environ.values() if "://" in value]
    names = []
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = redact(text, urls).encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
            names.append(name)
        graphs = os.path.join(staging, "graphs")
        if os.path.isdir(graphs):
            for dirpath, _, filenames in sorted(os.walk(graphs)):
                for filename in sorted(filenames):
                    full = os.path.join(dirpath, filename)
                    # graphs/<case>/<target>/<graph>/...: without debug.py's per-process folder level
                    name = _PROCESS_DIR.sub("/", os.path.relpath(full, staging))
                    tar.add(full, arcname=name)
                    names.append(name)
    return names


# --------------------------------------------------------------------------------------------- main
def main(
    skip_smoke: bool = False, bundle: str | None = None, out: TextIO | None = None, require_remote: bool = False
) -> int:
    """Run every check, print the report, write the bundle if asked; the exit status (``EXIT_*``).
    ``require_remote``: the remote cache must be configured and reachable (else exit 1)."""
    report = Report(out)
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    report.line(f"neuron-compile doctor ({now})")
    findings = Findings()

    report.section("Versions")
    versions = collect_versions()
    for name, value in versions.items():
        report.row(name, value)

    opts = check_target(report, findings)
    check_cores(report, findings, opts)
    check_cache(report, findings, opts, require_remote)

    staging = tempfile.mkdtemp(prefix="neuron_compile_doctor_") if bundle else None
    smoke: list[SmokeResult] = []
    probes: CompilerProbes | None = None
    try:
        if findings.missing:
            report.section("Smoke test")
            report.line(f"  skipped: {' and '.join(findings.missing)} not found (see below)")
        elif skip_smoke:
            report.section("Smoke test")
            report.line("  skipped (--skip-smoke)")
        else:
            smoke = run_smoke(report, debug_dir=staging and os.path.join(staging, "graphs"))
        if "neuronx-cc" not in findings.missing and (bundle or not skip_smoke):
            probes = check_compiler(report, findings, opts, runtime="libnrt.so.1" not in findings.missing)
        status = _verdict(report, findings, smoke)
        if bundle:
            assert staging is not None
            report.line()
            report.line(f"bundle: {bundle} (attach it to the bug report; review it first: it holds the graphs' code)")
            write_bundle(bundle, staging, report, versions, smoke, probes)
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    return status


def _bullet(report: Report, text: str, first: str = "  - ") -> None:
    """``text`` wrapped at 110 columns, its first line starting with ``first``, the others indented."""
    indent = " " * max(4, len(first) - len(first.lstrip()) + 2) if first.strip() else first
    report.line(textwrap.fill(text, width=110, initial_indent=first, subsequent_indent=indent,
                              break_on_hyphens=False, break_long_words=False))  # fmt: skip


def _verdict(report: Report, findings: Findings, smoke: list[SmokeResult]) -> int:
    report.section("Verdict")
    for note in findings.notes:
        _bullet(report, note, "  note: ")
    if findings.missing:
        runs = (
            "runs with target 'cpu' here"
            if findings.auto_target == "cpu"
            else "fails here with the default target (\"auto\" picks neuron); options={'target': 'cpu'} works"
        )
        _bullet(report, "NOT READY (exit 2): the Neuron stack is not complete on this machine; "
                f"torch.compile(backend='neuron') {runs}.", "  ")  # fmt: skip
        if "neuronx-cc" in findings.missing:
            _bullet(report, f"neuronx-cc (the Neuron compiler) is not on PATH: {INSTALL_COMPILER}.")
        if "libnrt.so.1" in findings.missing:
            _bullet(report, f"libnrt.so.1 (the Neuron runtime) {_library_missing()}: {INSTALL_RUNTIME}.")
        for problem in findings.problems:
            _bullet(report, f"also: {problem}")
        return EXIT_NO_NEURON
    failed = [r for r in smoke if not r.passed]
    if findings.problems or failed:
        report.line("  NOT WORKING (exit 1): the Neuron stack is here but does not work:")
        for problem in findings.problems:
            _bullet(report, problem)
        if failed:
            _bullet(report, f"{len(failed)} of {len(smoke)} smoke tests failed: " + ", ".join(r.name for r in failed))
        _bullet(report, "Fix what is named above; a failure it does not explain is a bug: report it with the bundle "
                "of `neuron-compile doctor --bundle report.tar.gz` attached.", "  ")  # fmt: skip
        return EXIT_FAILED
    remote = " The remote cache is NOT reachable (see the note)." if findings.remote_down else ""
    if smoke:
        report.line(f"  OK (exit 0): the Neuron stack is here and all {len(smoke)} smoke tests passed.{remote}")
    else:
        report.line(f"  OK (exit 0): the Neuron stack is here (smoke test skipped).{remote}")
    return EXIT_OK
