"""`python -m relay.serving.haproxy_launch REAL_HAPROXY ARGS...`: start Ray Serve's HAProxy
with its admin listeners on loopback.

Ray 2.60 renders HAProxy's config from a fixed template (ray/serve/_private/
haproxy_templates.py) whose `frontend prometheus` (`bind :PORT`) and `listen stats`
(`bind *:PORT`) listen on every interface, whatever `http_options.host` says; the template has
no setting for it. Serve runs HAProxy as `RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG [...]`,
so relay points that variable at a script running this module (relay/serving/ingress.py writes
it): the two bind lines are rewritten to 127.0.0.1 in CONFIG, then the real binary replaces
this process with the very same arguments — Serve finds its HAProxy processes by the `-f` path
and signals them by PID, both unchanged. The user-facing `frontend http_frontend` keeps the
address Serve gave it (`relay serve --host`).
"""

from __future__ import annotations

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
        rewritten = loopback_admin_binds(original)
        if rewritten != original:
            # Next to the original, then renamed over it: HAProxy never reads half a file.
            with open(path + ".relay", "w") as file:
                file.write(rewritten)
            os.replace(path + ".relay", path)
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
