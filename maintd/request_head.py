"""An HTTP/1.x request head, parsed and checked (RFC 9112 sections 2-3 and 5, RFC 9110 section 5).

What is refused is what RFC 9112 says a server must refuse, or what two parsers could read two
ways (the ground of request smuggling): a request line that is not three fields, a target with
a byte that is not visible ASCII, a field name that is not a token (whitespace before the colon,
an obsolete line fold), a value holding CR, LF or NUL, an HTTP/1.1 request without exactly one
``Host``, a ``Host`` that is not ``host[:port]``, a ``Content-Length`` that is not one number.
Every refusal is a :class:`BadRequest` (400, or 505 for another HTTP version); the listener
answers it and closes the connection.

A field sent several times is kept as one value joined by ", " (RFC 9110 section 5.3), so
``Connection: keep-alive`` and ``Connection: close`` on two lines read as both. An
absolute-form target (``http://host/path``), which RFC 9112 section 3.2.2 says a server must
accept, is read as its path and query.
"""

from __future__ import annotations

import re
import string

__all__ = ["BadRequest", "Headers", "keep_alive", "parse_head"]

# RFC 9110 section 5.6.2: token = 1*tchar
TCHAR = frozenset("!#$%&'*+-.^_`|~" + string.digits + string.ascii_letters)
VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
DIGITS = re.compile(r"[0-9]+")
ABSOLUTE = re.compile(r"https?://[^/?#]*", re.IGNORECASE)
NOT_IN_VALUES = ("\r", "\n", "\0")  # RFC 9110 section 5.5: reject (or replace) these
# RFC 9110 section 7.2, RFC 3986 section 3.2.2: uri-host [ ":" port ], possibly empty
HOST = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=%:\[\]]*")


class Headers(dict):
    """Request headers by lower-case name (``get`` takes any case)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return super().__contains__(str(name).lower())


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def parse_head(head: bytes, max_headers: int) -> tuple[str, str, str, Headers]:
    """(method, target, version, headers) of a request head (without its final empty line); the
    target in origin form (``/path?query``), or ``*``."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= TCHAR or not VERSION.fullmatch(parts[2]):
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(505, "HTTP/1.0 or HTTP/1.1 only")
    if not target or any(not "!" <= c <= "~" for c in target):
        raise BadRequest(400, "the request target holds a byte that is not visible ASCII")
    if absolute := ABSOLUTE.match(target):
        target = target[absolute.end():] or "/"
        target = target if target.startswith("/") else "/" + target
    if not target.startswith("/") and target != "*" and method != "CONNECT":  # CONNECT: authority-form
        raise BadRequest(400, "the request target must be a path")
    if len(lines) - 1 > max_headers:
        raise BadRequest(431, f"more than {max_headers} header fields")
    headers = _fields(lines[1:])
    if version == "HTTP/1.1" and "host" not in headers:
        raise BadRequest(400, "an HTTP/1.1 request needs a Host header")
    return method, target, version, headers


def _fields(lines: list[str]) -> Headers:
    headers = Headers()
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= TCHAR:
            raise BadRequest(400, "malformed header field (a name that is not a token, or a folded line)")
        value, name = value.strip(" \t"), name.lower()
        if any(c in value for c in NOT_IN_VALUES):
            raise BadRequest(400, f"the {name} header's value holds CR, LF or NUL")
        if name == "host" and (name in headers or not HOST.fullmatch(value)):
            raise BadRequest(400, "more than one Host header, or one that is not a host[:port]")
        if name == "content-length" and (not DIGITS.fullmatch(value) or headers.get(name, value) != value):
            raise BadRequest(400, "Content-Length is not one number")
        if name in headers and name != "content-length":
            value = f"{headers[name]}, {value}"
        headers[name] = value
    return headers


def keep_alive(version: str, headers: Headers) -> bool:
    tokens = {t.strip().lower() for t in (headers.get("connection") or "").split(",")}
    if headers.get("content-length", "0").lstrip("0") or "transfer-encoding" in headers:
        return False  # a body we do not read: the connection cannot carry another request
    return "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
