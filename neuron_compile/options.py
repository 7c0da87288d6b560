"""Backend options: ``torch.compile(..., backend="neuron", options={...})`` and environment variables.

Precedence: explicit ``options`` > environment variable > default. Both go through the same parser per
field (``_FIELDS``), so ``options={"cache": "no"}`` and ``NEURON_COMPILE_CACHE=no`` mean the same, and a
value of the wrong type or form is a ``NeuronOptionsError`` naming the option (or the environment
variable), the value and what is accepted, at option time, before anything is compiled or cached.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

from .errors import NeuronOptionsError

TARGETS = ("auto", "cpu", "neuron")
#: Logical NeuronCore sizes (physical cores per logical one): neuronx-cc --lnc and the runtime's
#: NEURON_LOGICAL_NC_CONFIG, which must agree.
LNC_SIZES = (1, 2)
GENERATIONS = ("trn2", "trn3")
#: neuronx-cc's -O levels (its CLI reference: "Possible numeric values are {1, 2, 3}").
OPT_LEVELS = (1, 2, 3)
#: NKI kernel modes (see the ``kernels`` field); kernel_routing.py acts on them.
KERNEL_MODES = ("reference", "emulate", "off")
#: What an eager op on the ``neuron`` device that cannot be compiled does (``eager_fallback``).
EAGER_FALLBACKS = ("off", "cpu")
#: How eager ops on the ``neuron`` device run (``eager_mode``): each as its own graph, or recorded and run together.
EAGER_MODES = ("op", "lazy")
#: Which graph inputs may stay on the NeuronCore between calls (``input_residency``; runtime/libnrt.py).
INPUT_RESIDENCY = ("off", "version_counter")
#: What the neuron target hands neuronx-cc: a StableHLO module, an HLO proto, or "auto" (runtime/neuronx_cc.py).
COMPILER_INPUTS = ("auto", "mlir", "hlo")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?")
_SCALE = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class _Rejected(Exception):
    """A parser's refusal; the caller names the option or environment variable."""


def parse_size(text: str) -> int:
    """Bytes from "123", "500K", "500M", "10G", "1.5G", "10GiB", "10GB" (binary units). Raises ValueError."""
    m = _SIZE.fullmatch(text.strip().upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 500M, 10G)")
    return int(float(m.group(1)) * _SCALE[m.group(2)])


def human_size(n: float) -> str:
    """``n`` bytes for people: "512 B", "1.5 KiB", "10.0 GiB" (binary units, as ``parse_size`` reads them)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise _Rejected


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise _Rejected

    return parse


def _size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            raise _Rejected from None
    raise _Rejected


def _path(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        # a bytes PathLike is refused: every path here is text; a NUL byte is no path at all
        if isinstance(path, str) and "\0" not in path:
            return path or None
    raise _Rejected


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


def _url(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str) and _URL.fullmatch(value.strip()):
        return value.strip()
    raise _Rejected


#: The remote cache's deadline per call is bounded: an infinite or huge one overflows the clock (and a
#: remote that takes an hour to answer is down).
MAX_REMOTE_TIMEOUT = 3600.0


def _seconds(value: Any) -> float:
    """A finite number of seconds, 0 < t <= MAX_REMOTE_TIMEOUT (an int, a float or their string)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _Rejected from None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and 0 < value <= MAX_REMOTE_TIMEOUT:
        return float(value)
    raise _Rejected


def _duration(value: Any) -> float:
    """A finite number of seconds >= 0 (an int, a float or their string)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _Rejected from None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    raise _Rejected


def _secret(value: Any) -> bytes | None:
    """A key: bytes, or text (encoded as UTF-8); empty is no key."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = value.encode("utf-8")  # an environment variable that is not UTF-8 holds lone surrogates
        except UnicodeEncodeError:
            raise _Rejected from None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value) or None
    raise _Rejected


def _flags(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))  # quoted flags keep their spaces, as in a shell
        except ValueError:
            raise _Rejected from None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise _Rejected


def _small_int(choices: tuple[int, ...] | None) -> Callable[[Any], int]:
    """An int (or its digit string), one of ``choices`` when given, else any int >= 0."""

    def parse(value: Any) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            if choices is None or value in choices:
                return value
        raise _Rejected

    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


def _opt_level(value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value in OPT_LEVELS:
        return value
    raise _Rejected


class _Field(NamedTuple):
    parse: Callable[[Any], Any]
    accepts: str
    env: str | None
    secret: bool = False  # its value is never shown in an error message


_BOOL = "a bool, or one of the strings " + "/".join(_TRUE + _FALSE) + " (any case)"
_PATH = "a str or os.PathLike directory path, without NUL bytes (or None)"

#: One row per option: its parser, what it accepts (for the error message) and its environment variable.
_FIELDS: dict[str, _Field] = {
    "target": _Field(_choice(TARGETS), f"one of {TARGETS}", "NEURON_COMPILE_TARGET"),
    "generation": _Field(_choice(GENERATIONS), f"one of {GENERATIONS}", "NEURON_COMPILE_GENERATION"),
    "strict": _Field(_bool, _BOOL, "NEURON_COMPILE_STRICT"),
    "cache": _Field(_bool, _BOOL, "NEURON_COMPILE_CACHE"),
    "cache_dir": _Field(_path, _PATH, "NEURON_COMPILE_CACHE_DIR"),
    "trust_cache_dir": _Field(_bool, _BOOL, "NEURON_COMPILE_CACHE_TRUST"),
    "cache_max_bytes": _Field(
        _size,
        "an int >= 0 (bytes), a size string such as '500M', '10G', '1.5G' (K/M/G/T are powers of 1024), or None",
        "NEURON_COMPILE_CACHE_MAX_BYTES",
    ),
    "cache_url": _Field(
        _url,
        "an fsspec URL with a scheme, e.g. 's3://bucket/prefix' or 'file:///shared/dir' (or None); "
        "a local directory is NEURON_COMPILE_CACHE_DIR's job",
        "NEURON_COMPILE_CACHE_URL",
        secret=True,  # a URL may carry a password or a signed token (cache/redact.py): a refused one is not shown
    ),
    "cache_url_timeout": _Field(
        _seconds,
        f"seconds > 0 and <= {MAX_REMOTE_TIMEOUT:g}, finite: an int, a float or their string (e.g. 10)",
        "NEURON_COMPILE_CACHE_URL_TIMEOUT",
    ),
    "cache_hmac_key": _Field(
        _secret,
        "bytes, or a str of valid text (encoded as UTF-8), or None; e.g. a hex or base64 string",
        "NEURON_COMPILE_CACHE_HMAC_KEY",
        secret=True,
    ),
    "debug_dir": _Field(_path, _PATH, "NEURON_COMPILE_DEBUG_DIR"),
    "allow_eager_fallback": _Field(_bool, _BOOL, None),
    "neuron_cc_flags": _Field(
        _flags, "a str of flags (split as a shell would) or a list/tuple of str", "NEURON_CC_FLAGS"
    ),
    "opt_level": _Field(_opt_level, f"an int in {OPT_LEVELS} (or its digit string)", "NEURON_COMPILER_OPT_LEVEL"),
    "compiler_input": _Field(_choice(COMPILER_INPUTS), f"one of {COMPILER_INPUTS}", "NEURON_COMPILE_COMPILER_INPUT"),
    "compile_timeout": _Field(
        _duration, "a number of seconds >= 0 (0: no limit), or its string", "NEURON_COMPILE_TIMEOUT"
    ),
    "compile_progress_seconds": _Field(
        _duration, "a number of seconds >= 0 (0: no progress lines), or its string", "NEURON_COMPILE_PROGRESS_SECONDS"
    ),
    "compile_jobs": _Field(
        _optional(_small_int(None)),
        "an int >= 0 (0: each graph compiled when it is traced, in the caller's thread) or None (cores and memory)",
        "NEURON_COMPILE_JOBS",
    ),
    "hbm_limit": _Field(
        _size,
        "an int >= 0 (bytes; 0: no check) or a size string such as '24G' (K/M/G/T are powers of 1024), or None "
        "(one NeuronCore's HBM for generation and lnc)",
        "NEURON_COMPILE_HBM_LIMIT",
    ),
    "kernels": _Field(_choice(KERNEL_MODES), f"one of {KERNEL_MODES}", "NEURON_COMPILE_KERNELS"),
    # the runtime's own variable: the compiler's --lnc then always agrees with the runtime it runs on
    "lnc": _Field(_small_int(LNC_SIZES), f"an int in {LNC_SIZES} (or its digit string)", "NEURON_LOGICAL_NC_CONFIG"),
    "neuron_core": _Field(
        _optional(_small_int(None)),
        "an int >= 0 (a logical NeuronCore of those visible), or None",
        "NEURON_COMPILE_CORE",
    ),
    "input_residency": _Field(_choice(INPUT_RESIDENCY), f"one of {INPUT_RESIDENCY}", "NEURON_COMPILE_INPUT_RESIDENCY"),
    "eager_fallback": _Field(_choice(EAGER_FALLBACKS), f"one of {EAGER_FALLBACKS}", "NEURON_COMPILE_EAGER_FALLBACK"),
    "eager_mode": _Field(_choice(EAGER_MODES), f"one of {EAGER_MODES}", "NEURON_COMPILE_EAGER_MODE"),
    "device_memory_limit": _Field(
        _size,
        "an int > 0 (bytes) or a size string such as '24G' (K/M/G/T are powers of 1024), or None (the target's: "
        "24 GiB per logical core of a Trn2 at LNC=2)",
        "NEURON_COMPILE_DEVICE_MEMORY_LIMIT",
    ),
    "precompile_manifest": _Field(
        _path,
        "a str or os.PathLike path of a manifest file, without NUL bytes (or None)",
        "NEURON_COMPILE_PRECOMPILE_MANIFEST",
    ),
}


def _parse(name: str, value: Any, source: str) -> Any:
    row = _FIELDS[name]
    try:
        return row.parse(value)
    except _Rejected:
        shown = f"<a {type(value).__name__}, not shown>" if row.secret else repr(value)
        raise NeuronOptionsError(
            f"neuron backend: {source}={shown} is not valid for option {name!r}: expected {row.accepts}"
        ) from None


#: The runtime's other name for the logical core size (TorchNeuron's and NxD Inference's docs use it).
VIRTUAL_CORE_SIZE_ENV = "NEURON_RT_VIRTUAL_CORE_SIZE"


def _lnc_from_environment(lnc: int | None) -> dict[str, int]:
    """``lnc`` from NEURON_RT_VIRTUAL_CORE_SIZE when NEURON_LOGICAL_NC_CONFIG is unset; both set and different
    is an error (the runtime would run one size, the compiler the other)."""
    raw = os.environ.get(VIRTUAL_CORE_SIZE_ENV, "").strip()
    if not raw:
        return {}
    size = _parse("lnc", raw, VIRTUAL_CORE_SIZE_ENV)
    if lnc is not None and lnc != size:
        raise NeuronOptionsError(
            f"neuron backend: NEURON_LOGICAL_NC_CONFIG={lnc} and {VIRTUAL_CORE_SIZE_ENV}={size} disagree: both set the "
            "logical NeuronCore size; set one of them (or make them equal)"
        )
    return {"lnc": size}


def from_env(name: str) -> Any:
    """Option ``name`` from its environment variable alone (its default when unset or empty), parsed and
    checked as ``Options.from_user`` does: for code that has no ``Options`` at hand."""
    row = _FIELDS[name]
    if row.env and os.environ.get(row.env, "").strip():
        return _parse(name, os.environ[row.env], row.env)
    return getattr(Options(), name)


def neuron_toolchain() -> tuple[bool, str]:
    """Whether the Neuron compiler and runtime are both here, and a line saying what was found."""
    from .runtime.libnrt import library_path  # ctypes only: no jax, no runtime initialized

    compiler, library = shutil.which("neuronx-cc"), library_path()
    if library and os.sep in library and not os.path.exists(library):
        library = None  # NEURON_COMPILE_LIBNRT naming a file that is not there
    if compiler and library:
        return True, f"neuronx-cc at {compiler}, libnrt at {library}"
    missing = [what for what, found in (("neuronx-cc on PATH", compiler), ("libnrt.so.1", library)) if not found]
    return False, "no " + " and no ".join(missing)


_auto_target_said = False


def _auto_target() -> str:
    """The target "auto" stands for: neuron where the Neuron compiler and runtime are found, else cpu; said
    once per process on the ``neuron_compile`` logger."""
    global _auto_target_said
    available, found = neuron_toolchain()
    target = "neuron" if available else "cpu"
    if not _auto_target_said:
        _auto_target_said = True
        logging.getLogger("neuron_compile").info(
            "neuron_compile: target %s (%s); options={'target': 'cpu' | 'neuron'} or NEURON_COMPILE_TARGET chooses one",
            target,
            found,
        )
    return target


@dataclass(frozen=True)
class Options:
    """What the backend does with a graph. Every field is documented in docs/options.md."""

    #: "cpu" runs the StableHLO with XLA CPU; "neuron" compiles it with neuronx-cc to a NEFF run by libnrt.
    #: "auto" (the default) resolves to "neuron" where neuronx-cc and libnrt.so.1 are found, else "cpu", and
    #: says which once per process (INFO on the ``neuron_compile`` logger). Env: NEURON_COMPILE_TARGET.
    target: str = "cpu"
    #: Trainium generation that the legality rules and neuronx-cc --target follow. Env: NEURON_COMPILE_GENERATION.
    generation: str = "trn2"
    #: Refuse what neuronx-cc would refuse, on every target. False: warn and run on CPU anyway.
    #: Env: NEURON_COMPILE_STRICT (default on).
    strict: bool = True
    #: Use the on-disk compile cache. Env: NEURON_COMPILE_CACHE=0 disables.
    cache: bool = True
    #: Cache directory; None means NEURON_COMPILE_CACHE_DIR or the user cache dir.
    cache_dir: str | None = None
    #: Trust a cache directory owned or writable by other users. Env: NEURON_COMPILE_CACHE_TRUST.
    trust_cache_dir: bool = False
    #: Size cap of the cache directory in bytes (LRU eviction); None: 10 GiB.
    #: Env: NEURON_COMPILE_CACHE_MAX_BYTES (accepts suffixes K, M, G, T, e.g. "500M").
    cache_max_bytes: int | None = None
    #: A remote cache shared by many hosts, behind the local one (cache/remote.py): any fsspec URL, e.g.
    #: "s3://bucket/prefix" (needs s3fs). Not part of the cache key. Env: NEURON_COMPILE_CACHE_URL.
    cache_url: str | None = None
    #: The remote cache's deadline per call in seconds (grows with the bytes moved), 0 < t <= 3600.
    #: Not part of the cache key. Env: NEURON_COMPILE_CACHE_URL_TIMEOUT (default 10).
    cache_url_timeout: float = 10.0
    #: The remote cache's signing key (HMAC-SHA256 of each manifest), shared by writers and readers: bytes
    #: or text (UTF-8). Not part of the cache key, never shown. Env: NEURON_COMPILE_CACHE_HMAC_KEY.
    cache_hmac_key: bytes | None = field(default=None, repr=False)
    #: Write FX graphs, StableHLO, legality report and timings here. Env: NEURON_COMPILE_DEBUG_DIR.
    debug_dir: str | None = None
    #: Let Dynamo fall back to eager when its recompile limit is hit (default: raise instead).
    allow_eager_fallback: bool = False
    #: Extra flags for neuronx-cc (neuron target only). Env: NEURON_CC_FLAGS.
    neuron_cc_flags: tuple[str, ...] = field(default_factory=tuple)
    #: neuronx-cc optimization level, -O1..-O3 (neuron target only). Env: NEURON_COMPILER_OPT_LEVEL.
    opt_level: int = 2
    #: What neuronx-cc is given (neuron target): "mlir" a StableHLO module, "hlo" an HloModuleProto made from it
    #: by jaxlib, "auto" mlir until the compiler refuses it as unparsable, then hlo, remembered per compiler
    #: version beside the cache. Part of the cache key. Env: NEURON_COMPILE_COMPILER_INPUT.
    compiler_input: str = "auto"
    #: Seconds one neuronx-cc run may take before it is stopped with an error naming the graph (0: no limit).
    #: Not part of the cache key. Env: NEURON_COMPILE_TIMEOUT (default 7200: two hours).
    compile_timeout: float = 7200.0
    #: Seconds between the progress lines of a running neuronx-cc (0: none). Env: NEURON_COMPILE_PROGRESS_SECONDS.
    compile_progress_seconds: float = 60.0
    #: neuronx-cc runs at once (neuron target): a graph's compile starts in the background as soon as it is
    #: lowered, so a forward's and its backward's (and other graphs of a step) compile side by side; its first
    #: call waits for it. 0: compiled in the caller's thread when traced. None: the cores, at most one per 8 GiB
    #: of available memory (runtime/compile_pool.py). Not part of the cache key. Env: NEURON_COMPILE_JOBS.
    compile_jobs: int | None = None
    #: Peak HBM a graph may need (bytes) before it is refused, on the neuron target before neuronx-cc runs (a
    #: warning on the CPU target); None: one NeuronCore's (generation and lnc: 24 GiB on trn2 at LNC 2, hbm.py);
    #: 0: no check. Not part of the cache key. Env: NEURON_COMPILE_HBM_LIMIT.
    hbm_limit: int | None = None
    #: NKI kernel sites (lowering/kernel_routing.py): "reference" runs each site's StableHLO reference on
    #: the CPU target, "emulate" runs the NKI kernels themselves in the emulator (slow), "off" routes
    #: nothing to kernels. On the neuron target sites are NKI custom calls. Env: NEURON_COMPILE_KERNELS.
    kernels: str = "reference"
    #: Logical NeuronCore size (neuron target): neuronx-cc's --lnc, which must equal the runtime's.
    #: Env: NEURON_LOGICAL_NC_CONFIG (the runtime's own variable; default 2, as on trn2).
    lnc: int = 2
    #: The logical NeuronCore graphs run on (neuron target), counted from the first one the process owns
    #: (NEURON_RT_VISIBLE_CORES; under torchrun each rank owns core LOCAL_RANK); None: 0. Env: NEURON_COMPILE_CORE.
    neuron_core: int | None = None
    #: Host tensors given to a graph on the neuron target are written to the NeuronCore at every call ("off").
    #: "version_counter" skips an input that is the tensor written last time, at the same memory, with the same
    #: version counter: a user contract, because writes that torch does not count (``p.data.copy_``,
    #: ``p.data[:] =``, numpy views, ``fused=True`` optimizers on CPU) then go unseen and the graph runs on stale
    #: values. Not part of the cache key. Env: NEURON_COMPILE_INPUT_RESIDENCY. (Tensors on the ``neuron`` device
    #: stay on the core anyway.)
    input_residency: str = "off"
    #: An eager op on the ``neuron`` device that cannot be compiled: "off" raises the unsupported-op error (with
    #: the op, shapes and your line); "cpu" runs it on the host (inputs copied there and back, counted in
    #: ``STATS.eager_ops_fallback``, a warning once per op). Not part of the cache key. Env:
    #: NEURON_COMPILE_EAGER_FALLBACK.
    eager_fallback: str = "off"
    #: How eager ops on the ``neuron`` device run: "op" runs each as its own one-op graph when called; "lazy"
    #: records them and runs the recorded sequence as ONE graph (keyed by its structure, so a training step that
    #: repeats compiles nothing after its first runs) at the next synchronization: a read to the host
    #: (``.item()``, ``.cpu()``, print), a compiled graph taking a recorded value, ``torch.neuron.synchronize()``,
    #: or 512 recorded ops. Each op is still traced (and its refusal raised) when called. Not part of the cache
    #: key. Env: NEURON_COMPILE_EAGER_MODE.
    eager_mode: str = "op"
    #: Bytes of device memory per logical core that tensors of the ``neuron`` device may hold; None: the target's
    #: HBM (12 GiB per physical core on Trn2, 18 GiB on Trn3, times lnc). Not part of the cache key. Env:
    #: NEURON_COMPILE_DEVICE_MEMORY_LIMIT.
    device_memory_limit: int | None = None
    #: Collect for ``neuron-compile precompile`` (docs/precompile.md): run on the CPU target and record every
    #: graph, as the neuron target with these options would key and compile it, in this manifest file.
    #: Not part of the cache key. Env: NEURON_COMPILE_PRECOMPILE_MANIFEST.
    precompile_manifest: str | None = None

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | None) -> "Options":
        """Options from ``options`` over environment variables over defaults, each value parsed and checked.

        Raises ``NeuronOptionsError`` for an unknown option name or a value the option does not accept.
        """
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise NeuronOptionsError(
                f"neuron backend: options={options!r} is not valid: expected a dict of option name to value "
                f"(or None), e.g. options={{'target': 'cpu'}}; known options are {sorted(_FIELDS)}"
            )
        options = dict(options)
        unknown = sorted(set(options) - set(_FIELDS), key=repr)  # keys of any type
        if unknown:
            raise NeuronOptionsError(
                f"neuron backend: unknown option(s) {unknown}; known options are {sorted(_FIELDS)}"
            )
        values: dict[str, Any] = {}
        for name, row in _FIELDS.items():
            if name in options:
                values[name] = _parse(name, options[name], f"options[{name!r}]")
            elif row.env and os.environ.get(row.env, "").strip():  # an empty variable counts as unset
                values[name] = _parse(name, os.environ[row.env], row.env)
        if "lnc" not in options:
            values.update(_lnc_from_environment(values.get("lnc")))
        if values.get("precompile_manifest"):
            values["target"] = "cpu"  # collecting runs the script on the CPU target, recording neuron keys
        elif values.get("target", "auto") == "auto":
            values["target"] = _auto_target()
        return cls(**values)

    def cache_relevant(self) -> dict[str, Any]:
        """The options that change the compiled artifact (and so belong in the cache key)."""
        return {
            "target": self.target,
            "generation": self.generation,
            "strict": self.strict,
            "neuron_cc_flags": list(self.neuron_cc_flags),
            "opt_level": self.opt_level,
            "kernels": self.kernels,
            **({"lnc": self.lnc, "compiler_input": self.compiler_input} if self.target == "neuron" else {}),
        }
