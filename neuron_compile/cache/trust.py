"""Trust policy: whether executables (native code) may be loaded from a directory.

A directory another user owns or can write could hand us their code; so could an ancestor that others can
write without the sticky bit (they could swap our directory). Such a directory is not used unless the user
trusts it explicitly (option ``trust_cache_dir`` / NEURON_COMPILE_CACHE_TRUST=1).
"""

from __future__ import annotations

import os
import stat


def path_untrusted_reason(path: str, st: os.stat_result) -> str | None:
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def dir_untrusted_reason(root: str) -> str | None:
    """Why ``root`` must not be used (None: it is safe)."""
    try:
        reason = path_untrusted_reason(root, os.stat(root))
        if reason:
            return reason
    except OSError:
        pass  # not created yet: its ancestors decide
    parent = os.path.dirname(root)
    while True:
        try:
            pst = os.stat(parent)
            if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
                return f"its parent {parent} is writable by everyone without the sticky bit"
        except OSError:
            pass
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up


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
