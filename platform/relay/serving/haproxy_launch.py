"""`python -m relay.serving.haproxy_launch REAL_HAPROXY ARGS...`: start Ray Serve's HAProxy
with its admin listeners on loopback and relay's JSON error bodies.

Ray 2.60 renders HAProxy's config from a fixed template (ray/serve/_private/
haproxy_templates.py) whose `frontend prometheus` (`bind :PORT`) and `listen stats`
(`bind *:PORT`) listen on every interface, whatever `http_options.host` says; the template has
no setting for it. Serve runs HAProxy as `RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG [...]`,
so relay points that variable at a script running this module (relay/serving/ingress.py writes
it): the two bind lines are rewritten to 127.0.0.1 in CONFIG, then the real binary replaces
this process with the very same arguments — Serve finds its HAProxy processes by the `-f` path
and signals them by PID, both unchanged. The user-facing `frontend http_frontend` keeps the
address Serve gave it (`relay serve --host`).

The same rewrite points the config's `errorfile 502/503/504` lines (Serve's text/plain "Internal
Server Error") at files written here, next to CONFIG, in relay's error shape `{"error": ...}`:
what a client gets when no replica can take its request (all down, one restarting, a timeout)
is JSON like every other error of the API.

It adds a `timeout http-request` (RELAY_HAPROXY_REQUEST_TIMEOUT_S, default 10 s) that, with
`option http-buffer-request`, covers the body too, and JSON bodies for HAProxy's own 400 (bad
framing, where its parser lets it) and 408 (a request too slow to arrive).

And the backends' `http-reuse always` becomes `http-reuse safe` (HAProxy's default): with
`always`, the first request of a new client connection may go out on an idle connection to a
replica that has just died, and HAProxy then closes the client's connection unanswered and
unlogged, so that the client may retry (measured here: the request right after SIGKILL of the
only replica). With `safe`, a client connection's first request gets a connection of its own,
whose failure HAProxy answers (a JSON 502 above) or retries, and the requests after it go to
Serve's fallback proxy once the replica is marked down. Later requests on a kept-alive client
connection still share idle connections.
"""

from __future__ import annotations

import json
import os
import re
import sys
from itertools import pairwise

# The sections of Ray's template that only operators read: metrics and the stats page.
ADMIN_SECTIONS = ("frontend prometheus", "listen stats")
SECTION = re.compile(r"^(global|defaults|frontend|backend|listen)\b")
BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)\b")


def loopback_admin_binds(text: str) -> str:
    """The config with every bind line of an admin section moved to 127.0.0.1."""
    lines, section = [], ""
    for line in text.splitlines(keepends=True):
        if SECTION.match(line):
            section = " ".join(line.split()[:2])
        elif section in ADMIN_SECTIONS:
            line = BIND.sub(r"\g<1>127.0.0.1:\g<2>", line)
        lines.append(line)
    return "".join(lines)


ERRORFILE = re.compile(r"^(\s*errorfile\s+)(502|503|504)\s+\S+", re.M)
GATEWAY_ERRORS = {
    502: ("Bad Gateway", "bad gateway: the replica failed to answer"),
    503: ("Service Unavailable", "service unavailable: no replica is ready; retry shortly"),
    504: ("Gateway Timeout", "gateway timeout: the replica did not answer in time"),
}


def write_error_files(directory: str) -> dict[int, str]:
    """A raw HTTP response per error HAProxy answers itself, as its `errorfile` wants it."""
    paths = {}
    for code, (reason, message) in {**GATEWAY_ERRORS, **CLIENT_ERRORS}.items():
        body = json.dumps({"error": message}).encode()
        head = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"
        )
        paths[code] = os.path.join(directory, f"relay-{code}.http")
        with open(paths[code], "wb") as file:
            file.write(head.encode() + body)
    return paths


# How long a client has to send its request line, headers and (through
# `option http-buffer-request`) the body up to HAProxy's buffer, before a 408: Serve's template
# sets no `timeout http-request`, so a client trickling bytes held a connection (and, once the
# headers were in, a replica's in-flight slot) for `timeout client`, an hour.
REQUEST_TIMEOUT_ENV = "RELAY_HAPROXY_REQUEST_TIMEOUT_S"
DEFAULT_REQUEST_TIMEOUT_S = "10"
# HAProxy's own refusals of a request, in relay's error shape too.
CLIENT_ERRORS = {
    400: ("Bad Request", "bad request: not a valid HTTP request"),
    408: ("Request Time-out", "request timeout: the request did not arrive in time"),
}
DEFAULTS = re.compile(r"^defaults\b.*\n", re.M)
USER_FRONTEND = re.compile(r"^frontend\s+http_frontend\b.*\n", re.M)
HTTP_REQUEST_TIMEOUT = re.compile(r"^\s*timeout\s+http-request\b", re.M)


def request_timeout(text: str, seconds: str) -> str:
    """The config with a `timeout http-request` in its `defaults` (unless it has one) that
    covers the body as well as the headers."""
    match = DEFAULTS.search(text)
    if match is None or HTTP_REQUEST_TIMEOUT.search(text):
        return text
    lines = f"    timeout http-request {seconds}s\n    option http-buffer-request\n"
    return text[: match.end()] + lines + text[match.end() :]


def json_client_errors(text: str, paths: dict[int, str]) -> str:
    """JSON bodies for the 400 and 408 HAProxy answers itself on the user-facing frontend (in
    its own section: HAProxy 2.8 did not apply these from `defaults`). A request line or
    headers its parser refuses (two different Content-Lengths) still get HAProxy's built-in
    400 page: 2.8 sends that one before any errorfile applies."""
    lines = "".join(f"    errorfile {code} {paths[code]}\n" for code in sorted(CLIENT_ERRORS))
    return USER_FRONTEND.sub(lambda m: m.group(0) + lines, text, count=1)


REUSE_ALWAYS = re.compile(r"^(\s*http-reuse\s+)always\b", re.M)


def safe_reuse(text: str) -> str:
    return REUSE_ALWAYS.sub(r"\g<1>safe", text)


def json_error_files(text: str, paths: dict[int, str]) -> str:
    return ERRORFILE.sub(lambda m: f"{m.group(1)}{m.group(2)} {paths[int(m.group(2))]}", text)


def rewrite(text: str, error_files: dict[int, str], request_timeout_s: str) -> str:
    """Serve's rendered config as relay runs it (each change: see the module's docstring)."""
    text = json_error_files(loopback_admin_binds(text), error_files)
    text = json_client_errors(safe_reuse(text), error_files)
    return request_timeout(text, request_timeout_s)


def config_path(args: list[str]) -> str | None:
    for flag, value in pairwise(args):
        if flag == "-f":
            return value
    return None


def main(argv: list[str]) -> None:
    binary, args = argv[0], argv[1:]
    if (path := config_path(args)) is not None and os.path.isfile(path):
        with open(path) as file:
            original = file.read()
        timeout = os.environ.get(REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT_S)
        rewritten = rewrite(original, write_error_files(os.path.dirname(path)), timeout)
        if rewritten != original:
            # Next to the original, then renamed over it: HAProxy never reads half a file.
            with open(path + ".relay", "w") as file:
                file.write(rewritten)
            os.replace(path + ".relay", path)
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
