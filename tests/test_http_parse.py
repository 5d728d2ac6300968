"""Request heads as other HTTP servers read them: cases ported from two outside test suites and
from the RFCs, run against :func:`maintd.request_head.parse_head` and, for a few, against a
listening server.

Sources (each case names its own):
* h11, ``h11/tests/test_io.py`` (``test_readers_simple``, ``test_readers_unusual``,
  ``test_reject_garbage_*``, ``test_reject_non_vchar_in_path``, ``test_allow_some_garbage_in_cookies``),
  ``h11/tests/test_headers.py`` (``test_normalize_and_validate``) and ``h11/_events.py`` (the
  Host rule of ``Request``);
* Go, ``src/net/http/serve_test.go`` (``TestServerValidatesHostHeader``,
  ``TestServerValidatesHeaders``, ``TestTolerateCRLFBeforeRequestLine``);
* RFC 9112 sections 2.2, 3, 3.2, 3.2.2, 5.1, 5.2 and RFC 9110 sections 5.3, 5.5, 8.6.

Where maintd differs from a source on purpose, the case says so: an obsolete line fold is
refused (h11 unfolds it; RFC 9112 5.2 allows either), and a DEL byte in a value is kept (Go
refuses it; RFC 9110 5.5 only requires refusing CR, LF and NUL, and h11 keeps such bytes
because browsers send them in cookies).
"""

from __future__ import annotations

import socket
import time

import pytest

from maintd.http import HttpServer, text
from maintd.request_head import BadRequest, keep_alive, parse_head

MAX_HEADERS = 100


def parsed(head: bytes) -> tuple[str, str, str, dict]:
    method, target, version, headers = parse_head(head, MAX_HEADERS)
    return method, target, version, dict(headers)


def refused(head: bytes) -> int:
    with pytest.raises(BadRequest) as exc:
        parse_head(head, MAX_HEADERS)
    return exc.value.status


@pytest.mark.parametrize("head,want", [
    # h11 test_io.py SIMPLE_CASES
    (b"GET /a HTTP/1.1\r\nHost: foo\r\nConnection: close",
     ("GET", "/a", "HTTP/1.1", {"host": "foo", "connection": "close"})),
    # h11 test_readers_unusual: HTTP/1.0, with and without headers (no Host needed in 1.0)
    (b"HEAD /foo HTTP/1.0\r\nSome: header", ("HEAD", "/foo", "HTTP/1.0", {"some": "header"})),
    (b"HEAD /foo HTTP/1.0", ("HEAD", "/foo", "HTTP/1.0", {})),
    # h11 test_readers_unusual: whitespace around a value is not part of it; empty values are legal
    (b"GET / HTTP/1.1\r\nHost: x\r\nFoo: a a a a a ", ("GET", "/", "HTTP/1.1", {"host": "x", "foo": "a a a a a"})),
    (b"GET / HTTP/1.1\r\nHost: x\r\nFoo:", ("GET", "/", "HTTP/1.1", {"host": "x", "foo": ""})),
    (b"GET / HTTP/1.1\r\nHost: x\r\nFoo: \t \t ", ("GET", "/", "HTTP/1.1", {"host": "x", "foo": ""})),
    # h11 test_allow_some_garbage_in_cookies (h11 issue 57): control bytes other than CR, LF, NUL stay
    (b"HEAD /foo HTTP/1.1\r\nHost: foo\r\nSet-Cookie: ___utmvafIumyLc=kUd\x01UpAt; path=/; Max-Age=900",
     ("HEAD", "/foo", "HTTP/1.1", {"host": "foo", "set-cookie": "___utmvafIumyLc=kUd\x01UpAt; path=/; Max-Age=900"})),
    # h11 test_headers.py: the same Content-Length twice is one Content-Length
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1",
     ("GET", "/", "HTTP/1.1", {"host": "x", "content-length": "1"})),
    # Go TestServerValidatesHeaders: spaces and tabs inside a value, high octets in a value
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo: foo foo", ("GET", "/", "HTTP/1.1", {"host": "foo", "foo": "foo foo"})),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo: foo\tfoo", ("GET", "/", "HTTP/1.1", {"host": "foo", "foo": "foo\tfoo"})),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo: foo\xfffoo", ("GET", "/", "HTTP/1.1", {"host": "foo", "foo": "foo\xfffoo"})),
    # Go refuses a DEL (0x7f) in a value; maintd keeps it (RFC 9110 5.5, as h11 keeps 0x01 above)
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo: foo\x7ffoo", ("GET", "/", "HTTP/1.1", {"host": "foo", "foo": "foo\x7ffoo"})),
    # RFC 9110 5.3: a field sent twice is one list
    (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\nconnection: close",
     ("GET", "/", "HTTP/1.1", {"host": "x", "connection": "keep-alive, close"})),
    # RFC 9112 3.2.2: a server MUST accept the absolute form; it is read as its path and query
    (b"GET http://example.com/metrics?x=1 HTTP/1.1\r\nHost: example.com",
     ("GET", "/metrics?x=1", "HTTP/1.1", {"host": "example.com"})),
    (b"GET HTTP://example.com HTTP/1.1\r\nHost: example.com", ("GET", "/", "HTTP/1.1", {"host": "example.com"})),
    (b"GET http://example.com?x=1 HTTP/1.1\r\nHost: example.com", ("GET", "/?x=1", "HTTP/1.1", {"host": "example.com"})),
    # RFC 9112 3.2.4 and 3.2.3: the asterisk form, and CONNECT's authority form (both then 405).
    # Go also takes a CONNECT without Host; RFC 9112 3.2 asks one of every HTTP/1.1 request.
    (b"OPTIONS * HTTP/1.1\r\nHost: x", ("OPTIONS", "*", "HTTP/1.1", {"host": "x"})),
    (b"CONNECT golang.org:443 HTTP/1.1\r\nHost: golang.org:443",
     ("CONNECT", "golang.org:443", "HTTP/1.1", {"host": "golang.org:443"})),
])
def test_heads_the_sources_accept_are_read_as_they_read_them(head, want):
    assert parsed(head) == want


@pytest.mark.parametrize("host", [
    # Go TestServerValidatesHostHeader, the 200 rows
    b"", b"1.2.3.4", b"foo.com", b"foo-bar_baz.com", b"foo.com:80", b"::1", b"[::1]", b"[::1]:80", b"[::1%25en0]:80",
])
def test_hosts_go_accepts_are_accepted(host):
    assert parsed(b"GET / HTTP/1.1\r\nHost: " + host)[3] == {"host": host.decode()}


@pytest.mark.parametrize("head,status", [
    # Go TestServerValidatesHostHeader, the 400 and 505 rows; h11 _events.py (Request): 1.1 needs one Host
    (b"GET / HTTP/1.1", 400),
    (b"GET / HTTP/1.1\r\nHost: \x06", 400),
    (b"GET / HTTP/1.1\r\nHost: \xff", 400),
    (b"GET / HTTP/1.1\r\nHost: {", 400),
    (b"GET / HTTP/1.1\r\nHost: }", 400),
    (b"GET / HTTP/1.1\r\nHost: first\r\nHost: second", 400),
    (b"GET / HTTP/1.0\r\nHost: first\r\nHost: second", 400),
    (b"GET / HTTP/1.0\r\nHost: \xff", 400),
    (b"GET / HTTP/0.9", 505),
    (b"PRI / HTTP/2.0", 505),
    (b"GET / HTTP/2.0", 505),
    (b"GET / HTTP/3.0", 505),
    # Go TestServerValidatesHeaders, the 400 rows
    (b"GET / HTTP/1.1\r\nHost: foo\r\nA space: foo", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo\xffbar: foo", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo\x00bar: foo", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nFoo : bar", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nFoo\t: bar", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\n: empty key", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nContent-Length: notdigits", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nContent-Length: notdigits\r\nTransfer-Encoding: chunked", 400),
    (b"GET / HTTP/1.1\r\nHost: foo\r\nfoo: foo\x00foo", 400),
    # h11 test_readers_unusual: a fold with no field before it, whitespace before the colon, no name
    (b"HEAD /foo HTTP/1.1\r\n  folded: line", 400),
    (b"HEAD /foo HTTP/1.1\r\nfoo  : line", 400),
    (b"HEAD /foo HTTP/1.1\r\nfoo\t: line", 400),
    (b"HEAD /foo HTTP/1.1\r\n: line", 400),
    # h11 unfolds an obsolete line fold; RFC 9112 5.2 lets a server refuse it instead, as maintd does
    (b"HEAD /foo HTTP/1.1\r\nHost: example.com\r\nSome: multi-line\r\n header", 400),
    (b"HEAD /foo HTTP/1.1\r\nHost: example.com\r\nSome: multi-line\r\n\tnonsense", 400),
    # h11 test_reject_garbage_in_header_line, test_reject_garbage_after_response_line
    (b"HEAD /foo HTTP/1.1\r\nHost: foo\x00bar", 400),
    (b"HEAD /foo HTTP/1.1 xxxxxx\r\nHost: a", 400),
    # h11 test_reject_non_vchar_in_path (a space splits the line into four fields: also 400)
    (b"HEAD /\x00 HTTP/1.1\r\nHost: foobar", 400),
    (b"HEAD /\x20 HTTP/1.1\r\nHost: foobar", 400),
    (b"HEAD /\x7f HTTP/1.1\r\nHost: foobar", 400),
    (b"HEAD /\xee HTTP/1.1\r\nHost: foobar", 400),
    # h11 test_headers.py test_normalize_and_validate: names and values
    (b"GET / HTTP/1.1\r\nHost: x\r\n foo: bar", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nfoo bar: baz", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nfoo\x01bar: baz", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nfoo: bar\rbaz", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nfoo: bar\nbaz", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: asdf", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1x", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\nContent-Length: 2", 400),
    # RFC 9110 8.6: Content-Length = 1*DIGIT (not other scripts' digits, which str.isdigit takes)
    ("GET / HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2".encode("latin-1"), 400),
    # RFC 9112 3: method SP target SP version, exactly; 3.2: a target in one of the four forms
    (b"GET  / HTTP/1.1\r\nHost: x", 400),
    (b"GET / http/1.1\r\nHost: x", 400),
    (b"G(T / HTTP/1.1\r\nHost: x", 400),
    (b"GET evil/ HTTP/1.1\r\nHost: x", 400),
    (b"GET * HTTP/1.1x\r\nHost: x", 400),
])
def test_heads_the_sources_refuse_are_refused(head, status):
    assert refused(head) == status


@pytest.mark.parametrize("head,kept", [
    # RFC 9112 9.3: HTTP/1.1 persists unless "close" is sent; HTTP/1.0 only with "keep-alive"
    (b"GET / HTTP/1.1\r\nHost: x", True),
    (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Close", False),
    (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: upgrade, close", False),
    (b"GET / HTTP/1.0", False),
    (b"GET / HTTP/1.0\r\nConnection: Keep-Alive", True),
    # RFC 9112 6.3: a body is framed by Content-Length or Transfer-Encoding; maintd reads none, so
    # a connection whose request has one cannot carry another (RFC 9112 9.3 and 6.1: close it)
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0", True),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 00", True),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5", False),
    (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked", False),
])
def test_a_connection_is_kept_only_when_the_request_allows_and_has_no_body(head, kept):
    _, _, version, headers = parse_head(head, MAX_HEADERS)
    assert keep_alive(version, headers) is kept


def test_blank_lines_before_the_request_line_are_ignored():
    """Go TestTolerateCRLFBeforeRequestLine; RFC 9112 2.2: a server SHOULD ignore at least one
    empty line before the request line."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n")})
    server.start()
    try:
        assert exchange(server.port, b"\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") \
            .startswith(b"HTTP/1.1 200 ")
    finally:
        server.stop()


def exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


LISTENING = [
    (b"GET /healthz HTTP/1.1\r\n\r\n", b"400"),  # no Host
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", b"400"),  # a lone CR in a value
    (b"GET http://x/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"200"),  # absolute form
    (b"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n", b"405"),
    (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
    # RFC 9110 5.3: "close" on a second Connection line still closes
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n", b"200"),
    # RFC 9112 2.2: a server MAY take a bare LF as a line's end (Go's serve_test.go sends
    # "GET / HTTP/1.1\nHost: foo" in TestHandlerSetTransferEncodingChunked; h11 reads them too)
    (b"GET /healthz HTTP/1.0\n\n", b"200"),
    (b"\nGET /healthz HTTP/1.1\nHost: x\nConnection: close\n\n", b"200"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\nConnection: close\n\r\n", b"200"),
    # ... but a CR alone ends nothing: it stays in the value, which is refused
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\r\r\n\r\n", b"400"),
    # the listener's one-read path (maintd.listener.Listener._quick) must read these as the rest
    # does: a bare LF amid CRLFs (RFC 9112 2.2), one empty line before the request line (RFC 9112
    # 2.2; Go's TestTolerateCRLFBeforeRequestLine sends two), a method refused with 405 and Allow
    # (RFC 9110 15.5.6), HEAD answered without content (RFC 9110 9.3.2)
    (b"GET /healthz HTTP/1.1\nHost: x\r\nConnection: close\r\n\r\n", b"200"),
    (b"\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"200"),
    (b"DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
    (b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"200"),
]


@pytest.mark.parametrize("raw,status", LISTENING)
def test_a_listening_server_answers_as_the_parser_reads_and_closes(raw, status):
    """Each exchange ends with the server closing the connection (``exchange`` reads to EOF)."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n")})
    server.start()
    try:
        reply = exchange(server.port, raw)
    finally:
        server.stop()
    assert reply.startswith(b"HTTP/1.1 " + status + b" "), reply[:80]
    assert b"Connection: close" in reply


def without_date(reply: bytes) -> bytes:
    return b"\r\n".join(line for line in reply.split(b"\r\n") if not line.startswith(b"Date: "))


@pytest.mark.parametrize("raw,status", LISTENING)
def test_a_request_is_answered_alike_in_one_read_or_in_pieces(raw, status):
    """A new connection's first read, when it holds one whole head, is answered without the
    streams (maintd.listener.Listener._first_read); a head that comes in pieces is read line by
    line. Both must give the same answer, byte for byte but the date."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n")})
    server.start()
    try:
        whole = exchange(server.port, raw)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(raw[:5])
            time.sleep(0.05)  # the first read gets the first five bytes only
            s.sendall(raw[5:])
            pieces = b""
            while chunk := s.recv(65536):
                pieces += chunk
    finally:
        server.stop()
    assert whole.startswith(b"HTTP/1.1 " + status + b" "), whole[:80]
    assert without_date(whole) == without_date(pieces)


def test_a_head_of_many_short_lines_is_bounded_as_a_whole():
    """16 KiB for the whole head, not for each line: 3,000 six-byte lines get 431 for their size
    while they are read (before the header count is looked at)."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n")})
    server.start()
    try:
        reply = exchange(server.port, b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 3000 + b"\r\n")
    finally:
        server.stop()
    assert reply.startswith(b"HTTP/1.1 431 ") and b"the request head is over 16384 bytes" in reply, reply[:200]


def test_at_most_max_headers_fields_are_read_and_one_more_is_431():
    """``Limits.max_headers`` (64) bounds the field count apart from the head's size: 64 fields
    are read, a 65th gets 431 (each field costs an entry, and 16 KiB hold thousands)."""
    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: text(200, "ok\n")})
    server.start()

    def head(fields: int) -> bytes:
        extra = b"".join(b"X-%d: y\r\n" % i for i in range(fields - 2))
        return b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra + b"\r\n"

    try:
        assert exchange(server.port, head(64)).startswith(b"HTTP/1.1 200 ")
        reply = exchange(server.port, head(65))
    finally:
        server.stop()
    assert reply.startswith(b"HTTP/1.1 431 ") and b"more than 64 header fields" in reply, reply[:200]
