"""Backend options: ``torch.compile(..., backend="neuron", options={...})`` and environment variables.

Precedence: explicit ``options`` > environment variable > default.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import NeuronOptionsError

TARGETS = ("cpu", "neuron")
GENERATIONS = ("trn2", "trn3")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def parse_size(text: str) -> int:
    """Bytes from "123", "500K", "500M", "10G", "10GiB"... Raises ValueError."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}.get(raw[-1:], 1)
    return int(float(raw[:-1] if scale > 1 else raw) * scale)


def _env_size(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return parse_size(raw)
    except ValueError:
        raise NeuronOptionsError(f"{name}={raw!r} is not a size (e.g. 500M, 10G)") from None


def neuron_toolchain_available() -> bool:
    """True when the Neuron compiler (neuronx-cc) is on PATH."""
    return shutil.which("neuronx-cc") is not None


@dataclass(frozen=True)
class Options:
    """What the backend does with a graph. Every field is documented in the README."""

    #: "cpu" runs the StableHLO with XLA CPU; "neuron" compiles it with neuronx-cc to a NEFF.
    #: Default: "neuron" where neuronx-cc is installed, else "cpu". Env: NEURON_COMPILE_TARGET.
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
    #: Env: NEURON_COMPILE_CACHE_MAX_BYTES (accepts suffixes K, M, G, e.g. "500M").
    cache_max_bytes: int | None = None
    #: Write FX graphs, StableHLO, legality report and timings here. Env: NEURON_COMPILE_DEBUG_DIR.
    debug_dir: str | None = None
    #: Let Dynamo fall back to eager when its recompile limit is hit (default: raise instead).
    allow_eager_fallback: bool = False
    #: Extra flags for neuronx-cc (neuron target only). Env: NEURON_CC_FLAGS.
    neuron_cc_flags: tuple[str, ...] = field(default_factory=tuple)
    #: neuronx-cc optimization level, -O1..-O3 (neuron target only). Env: NEURON_COMPILER_OPT_LEVEL.
    opt_level: int = 2

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | None) -> "Options":
        defaults = cls(
            target=os.environ.get(
                "NEURON_COMPILE_TARGET", "neuron" if neuron_toolchain_available() else "cpu"
            ),
            generation=os.environ.get("NEURON_COMPILE_GENERATION", "trn2"),
            strict=_env_bool("NEURON_COMPILE_STRICT", True),
            cache=_env_bool("NEURON_COMPILE_CACHE", True),
            cache_dir=os.environ.get("NEURON_COMPILE_CACHE_DIR") or None,
            trust_cache_dir=_env_bool("NEURON_COMPILE_CACHE_TRUST", False),
            cache_max_bytes=_env_size("NEURON_COMPILE_CACHE_MAX_BYTES"),
            debug_dir=os.environ.get("NEURON_COMPILE_DEBUG_DIR") or None,
            neuron_cc_flags=tuple(os.environ.get("NEURON_CC_FLAGS", "").split()),
            opt_level=int(os.environ.get("NEURON_COMPILER_OPT_LEVEL", "2") or 2),
        )
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise NeuronOptionsError(
                f"neuron backend: unknown option(s) {unknown}; known options are {sorted(known)}"
            )
        if "neuron_cc_flags" in options and isinstance(options["neuron_cc_flags"], str):
            options["neuron_cc_flags"] = tuple(options["neuron_cc_flags"].split())
        opts = dataclasses.replace(defaults, **options)
        if opts.target not in TARGETS:
            raise NeuronOptionsError(f"neuron backend: target must be one of {TARGETS}, got {opts.target!r}")
        if opts.generation not in GENERATIONS:
            raise NeuronOptionsError(
                f"neuron backend: generation must be one of {GENERATIONS}, got {opts.generation!r}"
            )
        return opts

    def cache_relevant(self) -> dict[str, Any]:
        """The options that change the compiled artifact (and so belong in the cache key)."""
        return {
            "target": self.target,
            "generation": self.generation,
            "strict": self.strict,
            "neuron_cc_flags": list(self.neuron_cc_flags),
            "opt_level": self.opt_level,
        }
