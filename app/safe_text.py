"""Making untrusted or secret-bearing text safe to show: in error messages, ``/v1/status``, the
registry, ``rollout status`` and logs.

- ``redact_uri``: a URI or connection string without its secrets (userinfo passwords, query
  values such as presigned-URL signatures, ``password=`` in libpq key/value strings);
- ``redact_in``: any text (an exception's message) with every secret of a URI removed, so a
  driver that echoes part of a password never shows it;
- ``terminal_safe``: text with control, bidi and zero-width characters escaped, so a file name
  or message cannot move the cursor, recolour or reorder what a terminal shows.

Pure: no I/O, no third-party imports.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final
from urllib.parse import unquote

MASK: Final = "***"

# libpq key/value form: `host=db password=secret` or `password='se cret'`.
_KV_SECRET = re.compile(
    r"(?i)\b(password|passwd|pwd|sslpassword|secret|token)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)"
)
# Query keys whose values are credentials (presigned URLs, tokens, libpq `password=`).
_SECRET_KEY = re.compile(r"(?i)pass|pwd|secret|token|signature|credential|sig$|key")
# Characters that change what a terminal shows without being text: C0/C1 controls, DEL, bidi
# embeddings/overrides/isolates, zero-width and other invisible format characters.
_BIDI_AND_INVISIBLE: Final = frozenset(
    "\u061c\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
    "\u2060\u2061\u2062\u2063\u2064\u2066\u2067\u2068\u2069\ufeff"
)


def _split_authority(uri: str) -> tuple[str, str, str] | None:
    """``scheme://``, the authority, and the rest; None when ``uri`` has no authority.

    Userinfo ends at the *last* ``@`` before the query, so a password holding ``@`` or ``/``
    (invalid unescaped, but drivers accept it) is still masked. An ``@`` after a ``/`` is taken
    as userinfo only when a ``:`` comes before that ``/`` (``user:pa/ss@host``), so an object
    key such as ``s3://bucket/a@b`` stays readable; the rarer ``host:port/a@b`` is over-masked,
    the safe mistake.
    """
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*://)", uri)
    if match is None:
        return None
    head = match.group(1)
    rest = uri[len(head) :]
    at = re.split(r"[?#]", rest, maxsplit=1)[0].rfind("@")
    if at >= 0 and ("/" not in rest[:at] or ":" in rest[: rest.find("/")]):
        return head, rest[: at + 1], rest[at + 1 :]
    end = len(rest)
    for stop in "/?#":
        index = rest.find(stop)
        if index >= 0:
            end = min(end, index)
    return head, rest[:end], rest[end:]


def _mask_userinfo(authority: str) -> str:
    if not authority.endswith("@"):
        return authority
    userinfo = authority[:-1]
    user, colon, _password = userinfo.partition(":")
    if not colon:
        # A lone token (`https://TOKEN@host`) is a credential too.
        return f"{MASK}@" if userinfo else "@"
    if "/" in user or "?" in user or "#" in user:
        return f"{MASK}@"
    return f"{user}:{MASK}@"


def _mask_query(rest: str) -> str:
    path, question, query = rest.partition("?")
    if not question:
        return rest
    query, hash_, fragment = query.partition("#")
    masked = "&".join(
        f"{key}={MASK}" if eq else key
        for key, eq, _value in (part.partition("=") for part in query.split("&"))
    )
    return f"{path}?{masked}" + (f"#{MASK}" if hash_ and fragment else hash_)


def redact_uri(uri: str) -> str:
    """``uri`` with its userinfo password (or lone token) and every query value masked; libpq
    ``key=value`` strings get their password masked."""
    split = _split_authority(uri)
    if split is None:
        return _KV_SECRET.sub(lambda m: f"{m.group(1)}={MASK}", uri)
    head, authority, rest = split
    return head + _mask_userinfo(authority) + _mask_query(rest)


def secrets_of(uri: str) -> list[str]:
    """The secret substrings of ``uri`` (raw and percent-decoded), longest first."""
    found: list[str] = []
    split = _split_authority(uri)
    if split is not None:
        _head, authority, rest = split
        if authority.endswith("@"):
            user, colon, password = authority[:-1].partition(":")
            found.append(password if colon else user)
        _path, _q, query = rest.partition("?")
        query = query.partition("#")[0]
        found.extend(
            value
            for key, _eq, value in (p.partition("=") for p in query.split("&"))
            if _SECRET_KEY.search(key)
        )
    else:
        found.extend(m.group(2).strip("'") for m in _KV_SECRET.finditer(uri))
    whole = {s for s in found if s} | {unquote(s) for s in found if s}
    # A driver that cannot parse a URI splits it where the URI grammar does (``/``, ``@``,
    # ``:``, ``?``, ``#``) and quotes a piece: ``postgresql://:pw/x@h`` -> `invalid port "pw"`.
    pieces = {piece for s in whole for piece in re.split(r"[/@:?#]", s)}
    secrets = whole | pieces
    # Very short fragments would mask unrelated text; three characters are still a leak worth
    # stopping, two are not distinguishable from noise.
    return sorted((s for s in secrets if len(s) >= 3), key=len, reverse=True)


def redact_in(text: str, *uris: str) -> str:
    """``text`` with every occurrence of each URI replaced by its redacted form and any
    remaining fragment of their secrets masked."""
    for uri in uris:
        if uri:
            text = text.replace(uri, redact_uri(uri))
    for uri in uris:
        for secret in secrets_of(uri) if uri else ():
            text = text.replace(secret, MASK)
    return text


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal would act on instead of print escaped as
    ``\\xNN`` / ``\\uNNNN``; newlines and tabs included, so one value stays one line."""
    out: list[str] = []
    for char in text:
        code = ord(char)
        if char in _BIDI_AND_INVISIBLE or unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)
