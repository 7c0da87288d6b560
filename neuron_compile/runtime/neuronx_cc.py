"""Driving ``neuronx-cc``: which flags it takes (its own ``compile --help``), which input it parses (a StableHLO
module or an HLO proto), and one compile run: bounded by a timeout, reporting progress, ended with its parent.

NOT RUN ON HARDWARE: the real compiler's help text and refusal messages are not public; this follows the CLI
reference (``compiler/neuronx-cc/api-reference-guide``, Neuron 2.32) and reads the help as argparse prints it.
What the compiler said is kept, per compiler version, on disk beside the compile cache (``<cache>/compiler/``):
its help text and the input format it parses, so that a process asks once per compiler, not per graph.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import NeuronCompileError, NeuronCompileTimeoutError

log = logging.getLogger("neuron_compile.neuronx_cc")

#: The two input formats neuronx-cc is known to take: a StableHLO module (TorchNeuron's native path runs
#: ``neuronx-cc compile module.mlir``) and a serialized HloModuleProto (the CLI reference's ``hlo.pb``,
#: torch-neuronx's XLA path and most other drivers).
INPUT_FORMATS = ("mlir", "hlo")
#: The module's file name per format (the compiler may pick its frontend by the name, as drivers name them).
MODULE_FILES = {"mlir": "module.mlir", "hlo": "module.hlo.pb"}
#: What neuronx-cc writes into its working directory (CLI reference: ``--logfile``'s default).
LOG_FILE = "log-neuron-cc.txt"
#: The compile's keeper (``compile_guard.py``), run by this interpreter without the site packages.
GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_guard.py")

#: A refusal that says the input did not parse: the parsers' own words (MLIR's "unexpected character" /
#: "Unable to parse module assembly", protobuf's "Error parsing message", XLA's "Failed to deserialize
#: HloModuleProto", "failed to parse"). The real compiler's exact text is not public.
_UNPARSED = re.compile(
    r"(?i)(cannot|could not|failed to|unable to) (parse|deserialize|read)\b[^\n]*\b(module|hlo|proto|mlir|assembly|"
    r"input|stablehlo)|error parsing message|unexpected character|decodeerror"
)


def refused_as_unparsable(output: str) -> bool:
    """Whether a failed compile's output says the input did not parse (the other format may)."""
    return _UNPARSED.search(output) is not None


# ------------------------------------------------------------------------------------------- --help
@dataclass(frozen=True)
class Flag:
    """One option as ``compile --help`` lists it: its spellings, the value's name (None: takes no value) and its
    choices when listed as ``{a,b}``; ``optional``: the value may be left out (``[<mode>]``)."""

    names: tuple[str, ...]
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False

    @property
    def takes_value(self) -> bool:
        return self.metavar is not None

    def shown(self) -> str:
        value = "" if self.metavar is None else f" [{self.metavar}]" if self.optional else f" {self.metavar}"
        return ", ".join(f"{n}{value}" for n in self.names)


_OPTION = re.compile(r"^(-{1,2}[A-Za-z0-9][\w-]*)(?:[ =](\S.*))?$")


def parse_help(text: str) -> dict[str, Flag]:
    """Every option of an argparse-style help text, by each of its spellings. An option line starts (after
    indentation) with a dash; its spellings are separated by ", ", and its description follows two spaces or on
    the next lines. Its choices: a ``{a,b}`` value, else "Valid values: a, b" in its description (the CLI
    reference's wording)."""
    entries: list[tuple[list[str], str | None, bool, list[str]]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("-") or stripped.startswith("--- "):
            if entries and stripped and line[:1].isspace():
                entries[-1][3].append(stripped)  # the description's next line
            elif not line[:1].isspace():
                entries.append(([], None, False, []))  # a heading ends the option before it
            continue
        spec, _, description = (re.split(r"(\s{2,})", stripped, maxsplit=1) + ["", ""])[:3]
        names, metavar, optional = [], None, False
        for part in spec.split(", "):
            m = _OPTION.match(part.strip())
            if m is None:
                break
            names.append(m.group(1))
            if m.group(2):
                value = m.group(2).strip()
                optional = value.startswith("[") and value.endswith("]")
                metavar = value[1:-1] if optional else value
        entries.append((names, metavar, optional, [description] if description else []))
    flags: dict[str, Flag] = {}
    for names, metavar, optional, description in entries:
        if not names:
            continue
        choices = None
        if metavar and metavar.startswith("{") and metavar.endswith("}"):
            choices = tuple(c.strip() for c in metavar[1:-1].split(",") if c.strip())
        elif metavar:
            m = re.search(r"Valid values:\s*([\w.-]+(?:\s*,\s*[\w.-]+)*)", " ".join(description))
            if m:
                choices = tuple(c.strip().rstrip(".") for c in m.group(1).split(","))
        flag = Flag(tuple(names), metavar, choices, optional)
        for name in names:
            flags[name] = flag
    return flags


#: ``neuronx-cc compile``'s options as the CLI reference lists them (Neuron 2.32): what the command line is
#: built from when no compiler is here to ask (a command shown or checked on a machine without the SDK).
#: TorchNeuron passes ``--lnc``, so the compiler takes that spelling too.
DOCUMENTED_FLAGS: dict[str, Flag] = {
    name: flag
    for flag in (
        Flag(("--framework",), "<framework_name>", ("XLA",)),
        Flag(("--target",), "<instance_family>", ("inf2", "trn1", "trn1n", "trn2", "trn3")),
        Flag(("--model-type",), "<model>", ("generic", "transformer", "unet-inference")),
        Flag(("--auto-cast",), "<cast_mode>", ("none", "matmult", "all")),
        Flag(("--auto-cast-type",), "<data_type>", ("bf16", "fp16", "tf32", "fp8_e4m3")),
        Flag(("--native-int64",), "<mode>", ("default", "enabled", "disabled")),
        Flag(("--implicit-integer-downcast",), "<mode>"),
        Flag(("--distribution-strategy",), "<distribution_type>"),
        Flag(("--logical-nc-config", "--lnc", "-lnc"), "<shard_degree>", ("1", "2")),
        Flag(("--optlevel", "-O"), "<opt_level>", ("1", "2", "3")),
        Flag(("--enable-mixed-precision-accumulation",)),
        Flag(("--disable-mixed-precision-accumulation",)),
        Flag(("--enable-saturate-infinity",)),
        Flag(("--enable-fast-context-switch",)),
        Flag(("--enable-fast-loading-neuron-binaries",)),
        Flag(("--logfile",), "<filename>"),
        Flag(("--output",), "<filename>"),
        Flag(("--verbose",), "<level>"),
    )
    for name in flag.names
}


@dataclass(frozen=True)
class CompilerHelp:
    """What one compiler version lists under ``compile --help`` (``documented``: no compiler was asked; the CLI
    reference's list stands in)."""

    version: str
    text: str
    flags: dict[str, Flag]
    documented: bool = False

    def first(self, *names: str) -> str | None:
        """The first of ``names`` this compiler lists."""
        return next((n for n in names if n in self.flags), None)

    def check_forced(self, tokens: tuple[str, ...]) -> None:
        """The user's flags (option ``neuron_cc_flags``, the wrapper's flags already taken out), checked against
        this compiler's help. A flag it does not list is passed on as given, with a warning once per process
        (neuronx-cc hides its internal flags from ``--help``: ``--internal-*``, ``--tensorizer-options``); a flag
        it lists as taking a value but given none is a NeuronCompileError (the compiler would refuse it)."""
        i = 0
        while i < len(tokens):
            token = tokens[i]
            i += 1
            if not token.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", token):
                continue
            name, has_value = token.split("=", 1)[0], "=" in token
            flag = self.flags.get(name)
            if flag is None:  # a short option with its value attached: -O1
                short = next((n for n in self.flags if len(n) == 2 and n[0] == "-" and token.startswith(n)), None)
                if short is not None and self.flags[short].takes_value:
                    continue
                _warn_once(
                    ("unlisted", self.version, name),
                    f"neuron_compile: {token!r} (option neuron_cc_flags / NEURON_CC_FLAGS) is passed on to neuronx-cc "
                    f"as given, although {self.version}'s `compile --help` does not list {name} (the compiler hides "
                    "its internal flags from --help). If the compiler refuses it, remove it or spell it as this "
                    f"compiler does; it lists: {', '.join(sorted({f.names[0] for f in self.flags.values()}))}",
                )
                continue
            if flag.takes_value and not has_value and not flag.optional:
                if i >= len(tokens) or tokens[i].startswith("-"):
                    raise NeuronCompileError(
                        f"neuron target: {name} (option neuron_cc_flags / NEURON_CC_FLAGS) takes a value on "
                        f"{self.version} ({flag.shown()}"
                        + (f"; one of {', '.join(flag.choices)}" if flag.choices else "")
                        + f"), e.g. {name}={flag.choices[-1] if flag.choices else '...'}"
                    )
                i += 1


def documented_help() -> CompilerHelp:
    return CompilerHelp("the CLI reference's neuronx-cc (no compiler on PATH)", "", DOCUMENTED_FLAGS, documented=True)


# ------------------------------------------------------------------------------------------- the wrapper's flags
# torch-neuronx's compile cache (``neuron_cc_wrapper``, libneuronxla) reads flags of its own from NEURON_CC_FLAGS
# and does not pass them to neuronx-cc: "all flags demonstrated above will be parsed by a tool called
# neuron_cc_wrapper, which is a wrapper over Neuron Compiler CLI to provide caching mechanism. All these flags will
# not be passed into Neuron Compiler CLI." (Neuron Persistent Cache,
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/neuron-caching.html):
# ``--cache_dir=<cache URL>`` (a directory, or s3://), ``--no_cache``, ``--log_level=WARNING|INFO|ERROR`` and
# ``--retry_failed_compilation`` (compile again the graphs whose compile failed before). Who followed the
# torch-neuronx or NxD guides has some of them set; neuronx-cc itself would refuse them.
#: The wrapper's flags taken here, each with our meaning (``WrapperFlags``); True: it takes a value.
WRAPPER_FLAGS = {"--cache_dir": True, "--no_cache": False, "--log_level": True, "--retry_failed_compilation": False}
#: Wrapper-only flags without a meaning here, dropped with one warning: ``--compile_workdir=DIR`` (the wrapper's
#: work directory, seen in public NEURON_CC_FLAGS beside --cache_dir; ours is a private temporary directory).
WRAPPER_DROPPED = {"--compile_workdir": True}
#: The levels ``--log_level`` takes (the caching page names WARNING, INFO and ERROR).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class WrapperFlags:
    """NEURON_CC_FLAGS (option ``neuron_cc_flags``) split into what neuronx-cc gets (``compiler``) and the
    wrapper's flags, with their meaning here: ``cache_dir`` the compile cache's directory (below option
    ``cache_dir`` and NEURON_COMPILE_CACHE_DIR: ``cache.paths.resolve_cache_dir``), ``no_cache`` these graphs
    neither read nor write the compile cache, ``log_level`` the ``neuron_compile`` logger's level,
    ``retry_failed_compilation`` a failed compile is run once more. ``dropped``: wrapper flags without a meaning
    here (the tokens as given)."""

    compiler: tuple[str, ...] = ()
    cache_dir: str | None = None
    no_cache: bool = False
    log_level: str | None = None
    retry_failed_compilation: bool = False
    dropped: tuple[str, ...] = ()


@functools.lru_cache(maxsize=64)
def wrapper_flags(tokens: tuple[str, ...]) -> WrapperFlags:
    """``tokens`` split (``WrapperFlags``): a wrapper flag as ``--flag=value`` or ``--flag value``. The first
    time a set is seen in this process, ``--log_level`` sets the ``neuron_compile`` logger's level and one warning
    names the dropped flags."""
    compiler: list[str] = []
    taken: dict[str, str | None] = {}
    dropped: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        name, eq, value = token.partition("=")
        takes = WRAPPER_FLAGS.get(name, WRAPPER_DROPPED.get(name))
        if takes is None:
            compiler.append(token)
            continue
        shown = token
        if takes and not eq and i < len(tokens) and not tokens[i].startswith("-"):
            value = tokens[i]
            shown = f"{token} {value}"
            i += 1
        if name in WRAPPER_DROPPED:
            dropped.append(shown)
        else:
            taken[name] = value if takes else None
    level = (taken.get("--log_level") or "").strip().upper() or None
    found = WrapperFlags(
        compiler=tuple(compiler),
        cache_dir=(taken.get("--cache_dir") or "").strip() or None,
        no_cache="--no_cache" in taken,
        log_level=level if level in LOG_LEVELS else None,
        retry_failed_compilation="--retry_failed_compilation" in taken,
        dropped=tuple(dropped),
    )
    _announce(found, taken.get("--log_level"))
    return found


def _announce(found: WrapperFlags, level_given: str | None) -> None:
    if found.log_level is not None:
        logging.getLogger("neuron_compile").setLevel(found.log_level)
    elif level_given is not None:
        _warn_once(
            ("log_level", level_given),
            f"neuron_compile: --log_level={level_given} (NEURON_CC_FLAGS) is not a level; it takes one of "
            f"{', '.join(LOG_LEVELS)}: ignored",
        )
    if found.dropped:
        _warn_once(
            ("dropped", found.dropped),
            f"neuron_compile: {', '.join(found.dropped)} (NEURON_CC_FLAGS) "
            + ("is a flag" if len(found.dropped) == 1 else "are flags")
            + " of torch-neuronx's compile-cache wrapper, not of neuronx-cc, without a meaning here: ignored "
            "(the compile runs in a private temporary directory; the wrapper's --cache_dir, --no_cache, "
            "--log_level and --retry_failed_compilation are taken)",
        )
    if found.cache_dir and "://" in found.cache_dir:
        _warn_once(
            ("cache_url", found.cache_dir),
            f"neuron_compile: --cache_dir={found.cache_dir} (NEURON_CC_FLAGS) is a URL, not a directory: ignored. "
            "A remote cache shared by hosts is option cache_url (NEURON_COMPILE_CACHE_URL)",
        )


def cache_dir_from_flags(tokens: tuple[str, ...]) -> str | None:
    """The local directory ``--cache_dir`` names in ``tokens`` (None: none, or a URL such as s3://)."""
    found = wrapper_flags(tuple(tokens)).cache_dir
    return found if found and "://" not in found else None


def env_flags() -> tuple[str, ...]:
    """NEURON_CC_FLAGS split as a shell would (as option ``neuron_cc_flags`` splits it); () if it does not split."""
    import shlex

    try:
        return tuple(shlex.split(os.environ.get("NEURON_CC_FLAGS", "")))
    except ValueError:
        return ()


_WARNED: set[Any] = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(key: Any, text: str) -> None:
    """``text`` as a warning of the ``neuron_compile.neuronx_cc`` logger, once per ``key`` and process."""
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    log.warning("%s", text)


# ------------------------------------------------------------------------------------------- version
@functools.lru_cache(maxsize=None)
def _compiler_version(path: str | None) -> str:
    if path is None:
        return "neuronx-cc-unavailable"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=300).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "neuronx-cc-unavailable"
    # "NeuronX Compiler version 2.x.y+hash", then a blank line and the Python/NumPy versions it runs on
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    named = [line for line in lines if "compiler version" in line.lower()]
    return (named or lines or ["neuronx-cc-unknown"])[0]


def compiler_version() -> str:
    """neuronx-cc's version line (asked once per compiler path and process)."""
    return _compiler_version(shutil.which("neuronx-cc"))


# ------------------------------------------------------------------------------------------- facts on disk
def facts_dir(cache_dir: str | None = None, flags: tuple[str, ...] | None = None) -> str:
    """``<cache>/compiler``: the compile cache's directory as ``cache.paths.resolve_cache_dir`` finds it (option
    ``cache_dir`` > NEURON_COMPILE_CACHE_DIR > ``--cache_dir`` of ``flags``, NEURON_CC_FLAGS when None > the user
    cache dir; the runtime may not import the cache, a test holds the two to the same answer)."""
    root = (
        cache_dir
        or os.environ.get("NEURON_COMPILE_CACHE_DIR")
        or cache_dir_from_flags(env_flags() if flags is None else flags)
    )
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("neuron_compile")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "compiler")


_FACTS: dict[tuple[str, str], dict[str, Any]] = {}
_FACTS_LOCK = threading.Lock()


def _facts_path(directory: str, version: str) -> str:
    return os.path.join(directory, hashlib.sha256(version.encode()).hexdigest()[:24] + ".json")


def _read_facts(path: str, version: str) -> dict[str, Any]:
    """The facts file of ``version``, if it is ours: a regular file of this user, writable by no one else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022 or st.st_size > 1 << 20:
            return {}
        try:
            doc = json.loads(f.read())
        except ValueError:
            return {}
    if not isinstance(doc, dict) or doc.get("version") != version:
        return {}
    facts: dict[str, Any] = {}
    if isinstance(doc.get("help"), str):
        facts["help"] = doc["help"]
    if doc.get("input_format") in INPUT_FORMATS:
        facts["input_format"] = doc["input_format"]
    return facts


def compiler_facts(directory: str, version: str) -> dict[str, Any]:
    """What is known of compiler ``version``: ``help`` (its compile --help) and ``input_format``."""
    with _FACTS_LOCK:
        key = (directory, version)
        if key not in _FACTS:
            _FACTS[key] = _read_facts(_facts_path(directory, version), version)
        return dict(_FACTS[key])


def remember(directory: str, version: str, **facts: Any) -> None:
    """Add ``facts`` to what is known of ``version``, in this process and on disk (best effort: a read-only
    cache directory only loses the memory)."""
    with _FACTS_LOCK:
        key = (directory, version)
        merged = {**_FACTS.get(key, {}), **facts}
        _FACTS[key] = merged
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".facts.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": version, **merged}, f, indent=1)
            os.replace(tmp, _facts_path(directory, version))
        except OSError as e:
            log.info("neuron_compile: cannot keep what neuronx-cc said in %s (%s)", directory, e)


def forget() -> None:
    """Forget, in this process, the compiler's version, help and input format (a test that swaps compilers)."""
    with _FACTS_LOCK:
        _FACTS.clear()
    with _WARNED_LOCK:
        _WARNED.clear()
    _compiler_version.cache_clear()
    wrapper_flags.cache_clear()


def compiler_help(directory: str) -> CompilerHelp:
    """The installed compiler's ``compile --help`` (asked once per compiler version, kept on disk); without a
    compiler, or when its help lists no ``--target`` (a text this parser does not understand), the CLI reference's
    options stand in (said once, in the log)."""
    path = shutil.which("neuronx-cc")
    if path is None:
        return documented_help()
    version = compiler_version()
    text = compiler_facts(directory, version).get("help")
    if text is None:
        try:
            proc = subprocess.run([path, "compile", "--help"], capture_output=True, text=True, timeout=300)
            text = proc.stdout or proc.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("neuron_compile: `neuronx-cc compile --help` failed (%s): using the CLI reference's flags", e)
            return documented_help()
        remember(directory, version, help=text)
    flags = parse_help(text)
    if "--target" not in flags:
        log.warning("neuron_compile: %s's `compile --help` lists no --target: using the CLI reference's flags", version)
        return dataclasses.replace(documented_help(), version=version, text=text)
    return CompilerHelp(version, text, flags)


def build_command(
    help: CompilerHelp,
    module_path: str,
    neff_path: str,
    *,
    generation: str,
    lnc: int,
    opt_level: int,
    forced: tuple[str, ...],
) -> list[str]:
    """``neuronx-cc compile MODULE ...``: TorchNeuron's command line, with only the flags ``help`` lists, in the
    form it lists them; then the user's ``forced`` flags without torch-neuronx's wrapper flags (``wrapper_flags``),
    checked against ``help`` (an unlisted one is passed on with a warning)."""
    forced = wrapper_flags(tuple(forced)).compiler
    help.check_forced(forced)
    command = ["neuronx-cc", "compile", module_path]

    def option(names: tuple[str, ...], value: str | None, required: bool = False) -> None:
        name = help.first(*names)
        if name is None:
            if required:
                raise NeuronCompileError(
                    f"neuron target: {help.version}'s `compile --help` lists none of {', '.join(names)}, which "
                    "every compile needs: this compiler is not one neuron_compile can drive"
                )
            return
        flag = help.flags[name]
        if flag.choices and value is not None and value not in flag.choices:
            return
        command.extend([name] if value is None else [name, value])

    option(("--framework",), "XLA", required=True)
    option(("--target",), generation, required=True)
    # must equal the runtime's logical-core setting (NEURON_LOGICAL_NC_CONFIG), or the NEFF is refused
    option(("--lnc", "--logical-nc-config", "-lnc"), str(lnc))
    if "-O" in help.flags:  # TorchNeuron's spelling, e.g. -O2
        command.append(f"-O{opt_level}")
    else:
        option(("--optlevel",), str(opt_level))
    option(("--model-type",), "transformer")
    option(("--auto-cast",), "none")
    # torch's int64 (indices, argmax, embeddings) stays 64-bit, as on the CPU target (trn2+): with a mode where
    # the compiler lists one (SDK 2.32: --native-int64 <mode>), bare where it lists a switch, not at all otherwise
    int64 = help.flags.get("--native-int64")
    if int64 is not None:
        if not int64.takes_value:
            command.append("--native-int64")
        elif int64.choices is None or "enabled" in int64.choices:
            command.extend(["--native-int64", "enabled"])
    command.extend(forced)
    option(("--output", "-o"), neff_path, required=True)
    return command


# ------------------------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    returncode: int  # the compiler's: < 0 when a signal killed it
    stdout: str
    stderr: str
    seconds: float
    log: str  # the end of its log-neuron-cc.txt


_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.Lock()


def stop_all() -> int:
    """Stop every compile of this process (their keepers kill the compilers and remove the work directories);
    the number stopped. ``neuron-compile precompile compile`` calls it on Ctrl-C."""
    with _LIVE_LOCK:
        running = list(_LIVE.values())
    for proc in running:
        _stop(proc)
    return len(running)


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.send_signal(signal.SIGTERM)  # the keeper kills the compiler's group and removes its directory
    except ProcessLookupError:
        pass


def _end(proc: subprocess.Popen) -> None:
    """Stop a compile and wait for its keeper (which kills the compiler and removes the work directory); a keeper
    that does not end within a minute is killed, and its compiler with it (the kernel's death signal)."""
    if proc.poll() is None:
        _stop(proc)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def log_tail(workdir: str, lines: int = 40) -> str:
    try:
        with open(os.path.join(workdir, LOG_FILE), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200_000))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_PASS = re.compile(r"(?i)\bpass\b[:\s]+(\S.*)$")


def last_pass(workdir: str) -> str:
    """The last pass the compiler's log names (else its last line), for a progress line."""
    tail = [line for line in log_tail(workdir, 200).splitlines() if line.strip()]
    for line in reversed(tail):
        m = _PASS.search(line)
        if m:
            return m.group(1).strip()[:120]
    return tail[-1].strip()[-120:] if tail else "(nothing logged yet)"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def describe_duration(seconds: float) -> str:
    return _clock(seconds)


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(
    command: list[str],
    workdir: str,
    *,
    graph: str,
    timeout: float,
    progress_every: float,
    progress: Callable[[str], None] = print_progress,
    largest_op: Callable[[], str] | None = None,
) -> RunResult:
    """Run ``command`` (a neuronx-cc compile) in ``workdir`` under its keeper (``compile_guard.py``): a progress
    line every ``progress_every`` seconds, NeuronCompileTimeoutError after ``timeout`` seconds (0: none), the
    compiler stopped and ``workdir`` removed when this process dies or is interrupted (KeyboardInterrupt)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", GUARD, str(os.getpid()), workdir, "--", *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        # its own session: a Ctrl-C in the terminal reaches this process only, which stops the compile itself
        start_new_session=True,
    )
    with _LIVE_LOCK:
        _LIVE[proc.pid] = proc
    deadline = t0 + timeout if timeout and timeout > 0 else None
    next_line = t0 + progress_every if progress_every and progress_every > 0 else None
    try:
        while True:
            now = time.monotonic()
            wake = min(t for t in (deadline, next_line) if t is not None) if (deadline or next_line) else None
            try:
                out, err = proc.communicate(timeout=None if wake is None else max(wake - now, 0.01))
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    tail = log_tail(workdir)
                    _end(proc)
                    where = largest_op() if largest_op is not None else "not known"
                    raise NeuronCompileTimeoutError(
                        f"neuronx-cc did not finish graph '{graph}' within {_clock(timeout)} (option compile_timeout, "
                        f"NEURON_COMPILE_TIMEOUT): stopped after {_clock(now - t0)}. Its largest op: {where}. "
                        "Published runs show neuronx-cc taking hours on some gathers and scatters. Give it longer "
                        "(compile_timeout=0: no limit), or cut the graph there (torch.compiler.nested_compile_region, "
                        "a smaller batch or sequence); NEURON_COMPILE_DEBUG_DIR=DIR writes the module for a bug "
                        "report.\nThe end of its log (" + LOG_FILE + "):\n" + (tail or "(no log written)")
                    )
                if next_line is not None and now >= next_line:
                    limit = f" of {_clock(timeout)}" if deadline is not None else ""
                    progress(
                        f"neuron_compile: neuronx-cc is compiling graph '{graph}': {_clock(now - t0)}{limit}; "
                        f"last pass: {last_pass(workdir)}"
                    )
                    next_line += progress_every
    except BaseException:
        _end(proc)
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(proc.pid, None)
    return RunResult(proc.returncode, out, err, time.monotonic() - t0, log_tail(workdir, 2000))


def failure_message(result: RunResult, command: list[str], graph: str) -> str:
    """The error of a compile that did not produce a NEFF."""
    if result.returncode < 0:
        name = signal_name(-result.returncode)
        why = (
            " SIGKILL is what the kernel's out-of-memory killer sends (see `dmesg`); a job scheduler or a user "
            "may have sent it too."
            if name == "SIGKILL"
            else ""
        )
        return (
            f"neuronx-cc was killed by {name} (signal {-result.returncode}) while compiling graph '{graph}', after "
            f"{_clock(result.seconds)}: it did not refuse the graph, something ended it.{why} Compile again; "
            f"with less memory in use if it was the OOM killer.\ncommand: {' '.join(command)}"
            + (f"\nThe end of its log:\n{result.log[-3000:]}" if result.log else "")
        )
    said = result.stderr[-4000:] or result.stdout[-4000:]
    return (
        f"neuronx-cc failed (exit {result.returncode}) on graph '{graph}':\n{said}\ncommand: {' '.join(command)}\n"
        "The module it was given: NEURON_COMPILE_DEBUG_DIR=DIR writes it."
    )
