"""Run the loopback Hub on its own, to try a push (or a download) with no network:

    PYTHONPATH=tests python -m hub_server --port 8090

then, in another shell, the variables it prints and any command that talks to the Hub. Repos live in memory until
the server stops (Ctrl-C); file contents go to --storage (a temporary folder, removed at exit, by default).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading

from .server import DEFAULT_TOKEN, HubServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hub_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8090, help="port on 127.0.0.1 (0: any free one); default 8090")
    parser.add_argument("--storage", help="folder for the uploaded files (default: a temporary one, removed at exit)")
    parser.add_argument("--user", default="user", help=f"the user {DEFAULT_TOKEN} writes as (default: user)")
    options = parser.parse_args(argv)
    storage = options.storage or tempfile.mkdtemp(prefix="loopback-hub-")
    server = HubServer(storage, tokens={DEFAULT_TOKEN: options.user}, port=options.port).start()
    print(f"loopback Hub on {server.url}; push to {options.user}/<name> with:\n"
          f"  export HF_ENDPOINT={server.url} HF_TOKEN={DEFAULT_TOKEN} HF_HUB_DISABLE_XET=1\n"
          "(it speaks no Xet); Ctrl-C stops it and forgets every repo", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if not options.storage:
            shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":
    main()
