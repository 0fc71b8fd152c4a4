"""Serve the trajectory viewer over a posttrain home::

    python -m viewer --home posttrain-data --port 3001

then open http://127.0.0.1:3001. ``posttrain ui`` starts it this way beside the Dagster UI. It
serves 127.0.0.1 unless ``--host`` says otherwise; it only reads the home's files. It answers only
requests addressed to one of its own names (127.0.0.1, localhost, [::1], the ``--host`` and each
``--allow-host``), whatever the port, so that a web page cannot read it through DNS rebinding.
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from sandboxes.home import default_home
from viewer.app import LOOPBACK_NAMES, create_app, host_name
from viewer.links import DEFAULT_PORT, record_viewer_url


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (`posttrain ui` stopping, a supervisor) stops it even where it inherited SIGTERM ignored
    # or blocked from whatever started it: uvicorn's own handler comes only once it serves, and a
    # signal ignored before then is lost, leaving a viewer that never ends.
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    parser = argparse.ArgumentParser(prog="python -m viewer", description=__doc__.split("::")[0].strip())
    parser.add_argument("--home", help="the posttrain home (default: $POSTTRAIN_HOME, else ./posttrain-data)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="another name the viewer may be addressed by, e.g. this machine's name when --host "
                             "is 0.0.0.0 (repeatable; requests naming any other host are refused)")
    parser.add_argument("--tensorboard-url", default="", help="where TensorBoard is served, for /tensorboard")
    args = parser.parse_args(argv)
    for name in [args.host, *args.allow_host]:
        if not re.fullmatch(r"[A-Za-z0-9.:\-]+|\[[0-9A-Fa-f.:]+\]", name):
            print(f"python -m viewer: host {name!r}: expected a host name or an IP address", file=sys.stderr)
            return 2
    home = Path(args.home).expanduser().resolve() if args.home else default_home()
    if not home.is_dir():
        print(f"python -m viewer: --home {home}: not a folder", file=sys.stderr)
        return 2
    try:
        # Bound before the line below is printed: whoever reads it (posttrain ui, a test) can connect at
        # once; a port in use is this error, not a line announcing a viewer that never serves.
        host = args.host.strip("[]")
        family = socket.getaddrinfo(host, args.port, type=socket.SOCK_STREAM)[0][0]  # IPv4 or IPv6, as the name is
        listener = socket.create_server((host, args.port), family=family, backlog=128)
    except OSError as exc:
        print(f"python -m viewer: cannot serve on {host_name(args.host)}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    url = f"http://{host_name(args.host) if args.host not in ('0.0.0.0', '::') else '127.0.0.1'}:{args.port}"
    record_viewer_url(home, url)  # links written from now on, by any process of this home, point here
    print(f"trajectory viewer on http://{host_name(args.host)}:{args.port} (home {home})", flush=True)
    allowed = list(dict.fromkeys([*LOOPBACK_NAMES, args.host, *args.allow_host]))
    app = create_app(home, tensorboard_url=args.tensorboard_url, allowed_hosts=allowed)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main())
