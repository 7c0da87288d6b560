"""Secrets out of every URL this package prints or logs: THE redaction, used by the remote cache's warnings
and errors, ``neuron-compile cache --url``, ``precompile`` and ``doctor`` (its report and its bundle).

A URL may carry a secret in two places: its user-info (``s3://user:password@bucket/x``) and its query
(presigned S3 ``X-Amz-Signature``/``X-Amz-Credential``/``X-Amz-Security-Token``, Azure SAS ``sig=``, a bearer
``token=``...). ``redact_url`` replaces both with ``<redacted>``. Libraries do not quote a URL back whole:
botocore, given ``s3://u:pw@bucket/x``, says ``Invalid bucket name "u:pw@bucket"``. So ``redact`` also takes
the URLs a text may be about and removes their secret parts wherever they appear in it, besides redacting
every URL and every ``name=value`` of a secret-looking query parameter it finds.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Iterable

REDACTED = "<redacted>"

#: Words of a query parameter's name (split at ``-`` and ``_``, any case) that make its value a secret.
SECRET_PARAM_WORDS = frozenset(
    {"token", "sig", "signature", "credential", "credentials", "secret", "password", "passwd", "key", "auth",
     "authorization"}
)  # fmt: skip
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
#: ``name=value`` in free text (a query quoted without its URL, a repr of params).
_PARAM = re.compile(r"(?<![\w-])([A-Za-z][\w-]*)=([^&\s'\"<>;,)\]}]+)")
#: ``user:password@host`` without a scheme (a URL missing its ``s3://``, or quoted by a library without it).
_USERINFO = re.compile(r"(?<![\w.%+-])[\w.%+-]+:[^\s/@'\"<>]+@(?=[\w\[])")


def is_secret_param(name: str) -> bool:
    return any(word in SECRET_PARAM_WORDS for word in re.split(r"[-_]", name.lower()))


def redact_url(url: str) -> str:
    """``url`` with its user-info and the values of secret query parameters replaced by ``<redacted>``
    (``s3://u:pw@b/x?X-Amz-Signature=abc&v=1`` -> ``s3://<redacted>@b/x?X-Amz-Signature=<redacted>&v=1``)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unbalanced "[" in the host: redact the whole authority
        return re.sub(r"(//)[^/?#]*", rf"\1{REDACTED}", url, count=1)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = REDACTED + "@" + netloc.rsplit("@", 1)[1]
    query = _redact_params(parts.query)
    fragment = _redact_params(parts.fragment)
    if (netloc, query, fragment) == (parts.netloc, parts.query, parts.fragment):
        return url  # nothing secret: the text as given (urlunsplit may normalize it)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def _redact_params(text: str) -> str:
    return _PARAM.sub(lambda m: f"{m.group(1)}={REDACTED}" if is_secret_param(m.group(1)) else m.group(0), text)


#: A password, user name or query value shorter than this is not looked for alone in a message (replacing
#: every "u" of a text would garble it, and its user-info as a whole still is): the drill's user "u".
MIN_SECRET_CHARS = 4


def url_secrets(url: str) -> list[str]:
    """The secret pieces of ``url`` as they may appear in a message about it: the user-info, its password
    and user name, and secret query values, each as written and percent-decoded; longest first."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        authority = url.split("//", 1)[-1].split("/", 1)[0]
        return [authority] if "@" in authority else []
    found: set[str] = set()
    whole: set[str] = set()
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else None
    if userinfo is None and "@" in url and not parts.netloc:  # not a URL ("u:pw@bucket/x"): as if after "//"
        userinfo = url.split("@", 1)[0].rsplit("/", 1)[-1]
    if userinfo:
        whole |= {userinfo, urllib.parse.unquote(userinfo)}
        found.update(userinfo.split(":", 1))
    for name, value in urllib.parse.parse_qsl(parts.query + "&" + parts.fragment, keep_blank_values=False):
        if is_secret_param(name):
            found.add(value)
    for name, value in _PARAM.findall(parts.query + "&" + parts.fragment):
        if is_secret_param(name):
            found.add(value)
    found |= {urllib.parse.unquote(s) for s in found}
    pieces = {s for s in found if len(s) >= MIN_SECRET_CHARS} | {s for s in whole if s}
    return sorted(pieces, key=len, reverse=True)


def redact(text: object, urls: Iterable[str | None] = ()) -> str:
    """``str(text)`` with every URL in it redacted (``redact_url``), every ``user:password@`` and every
    secret-looking ``name=value`` redacted, and the secret pieces of each of ``urls`` (the URLs the text may be about, e.g. the cache URL
    an error came from) removed wherever they appear, quoted or not."""
    out = str(text)
    for url in urls:
        if url:
            for secret in url_secrets(url):
                out = out.replace(secret, REDACTED)
    out = _URL.sub(lambda m: redact_url(m.group(0)), out)
    out = _USERINFO.sub(f"{REDACTED}@", out)
    return _redact_params(out)
