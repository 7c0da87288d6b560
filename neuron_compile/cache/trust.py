"""Trust policy: whether executables (native code) may be loaded from a directory.

A directory another user owns or can write could hand us their code; so could an ancestor that others can
write without the sticky bit (they could swap our directory). Such a directory is not used unless the user
trusts it explicitly (option ``trust_cache_dir`` / NEURON_COMPILE_CACHE_TRUST=1).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator


def path_untrusted_reason(path: str, st: os.stat_result) -> str | None:
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _upwards(path: str) -> Iterator[str]:
    """``path``, then each of its ancestors up to the filesystem root."""
    while True:
        yield path
        up = os.path.dirname(path)
        if up == path:
            return
        path = up


def _parents_reason(path: str) -> str | None:
    """Why an ancestor of ``path`` lets others swap it: writable by everyone without the sticky bit."""
    for parent in _upwards(os.path.dirname(path)):
        try:
            pst = os.stat(parent)
        except OSError:
            continue
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by everyone without the sticky bit"
    return None


def _links_reason(path: str) -> str | None:
    """Why a symlink on ``path`` (the path itself or a directory on the way) is not ours: its owner can
    point it elsewhere (in a sticky directory too)."""
    for current in _upwards(os.path.abspath(path)):
        try:
            st = os.lstat(current)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.getuid(), 0):
            return f"{current} is a symbolic link owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    return None


def dir_untrusted_reason(root: str) -> str | None:
    """Why ``root`` must not be used (None: it is safe).

    Judged are the directory (symlinks followed), the ancestors of the path as given (a symlink on it could
    be swapped), the symlinks on it, and the ancestors of the directory it resolves to (realpath)."""
    try:
        reason = path_untrusted_reason(root, os.stat(root))
        if reason:
            return reason
    except OSError:
        pass  # not created yet: its ancestors decide
    reason = _parents_reason(root) or _links_reason(root)
    if reason:
        return reason
    real = os.path.realpath(root)
    if real != os.path.abspath(root):
        reason = _parents_reason(real)
        if reason:
            return f"{reason} ({root} resolves to {real})"
    return None


def paths_untrusted_reason(paths: list[str]) -> str | None:
    """The first of ``paths`` (an entry's directory and files) that is not ours alone. Symlinks are not
    followed nor judged here (their mode is always 0777): the store refuses them as damaged entries."""
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        reason = path_untrusted_reason(path, st)
        if reason:
            return reason
    return None
