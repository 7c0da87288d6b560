"""Where the cache lives, and what a key may look like before it becomes part of a path.

A key reaches the store from outside the process in three ways: a mega-cache artifact
(``torch.compiler.load_cache_artifacts``), a CLI argument, and a directory listing. Each is checked here,
against the exact form ``key.cache_key`` produces (40 lowercase hex digits), before any path is built.
"""

from __future__ import annotations

import os
import re

#: ``key.cache_key`` returns the first 40 hex digits of a sha256.
KEY_LENGTH = 40
_KEY = re.compile(r"[0-9a-f]{%d}" % KEY_LENGTH)
_PREFIX = re.compile(r"[0-9a-f]{1,%d}" % KEY_LENGTH)
ENV_DIR = "NEURON_COMPILE_CACHE_DIR"


class InvalidKey(ValueError):
    """A string that is not a cache key (it could name a path outside the cache)."""


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def check_key(key: object) -> str:
    """``key`` if it has the exact form of a cache key; raises ``InvalidKey`` otherwise."""
    if not is_key(key):
        raise InvalidKey(f"not a cache key (expected {KEY_LENGTH} lowercase hex digits): {str(key)[:80]!r}")
    return key


def check_key_prefix(prefix: str) -> str:
    """A key prefix as typed on the command line (1-40 hex digits, any case)."""
    lowered = prefix.strip().lower()
    if _PREFIX.fullmatch(lowered) is None:
        raise InvalidKey(f"not a cache key or key prefix (1-{KEY_LENGTH} hex digits): {prefix[:80]!r}")
    return lowered


def resolve_cache_dir(explicit: str | None = None, flags: tuple[str, ...] | None = None) -> str:
    """THE cache directory: ``explicit`` (option ``cache_dir`` / ``--dir``) > NEURON_COMPILE_CACHE_DIR >
    ``--cache_dir`` of torch-neuronx's wrapper in ``flags`` (option ``neuron_cc_flags``; None: NEURON_CC_FLAGS,
    as users of torch-neuronx have it; a URL there is not a directory: ``runtime.neuronx_cc.wrapper_flags``) >
    the user cache dir (platformdirs). Absolute, ``~`` expanded; symlinks are not resolved (a root that is
    a symlink is the user's choice; nothing *below* the root is ever followed)."""
    from ..runtime import neuronx_cc

    chosen = (
        explicit
        or os.environ.get(ENV_DIR)
        or neuronx_cc.cache_dir_from_flags(neuronx_cc.env_flags() if flags is None else tuple(flags))
        or _user_cache_dir()
    )
    return os.path.abspath(os.path.expanduser(chosen))


def _user_cache_dir() -> str:
    import platformdirs

    return platformdirs.user_cache_dir("neuron_compile")


def is_within(path: str, root: str) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)
