"""Run the fake API server by hand: ``python -m tests.apiserver [--data DIR] [--port N] [--kubeconfig PATH]``."""

from __future__ import annotations

import argparse
import time

from .server import FakeApiServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", action="append", default=[], help="directory of *.json objects to load")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", help="write a kubeconfig for the server here")
    parser.add_argument("--bookmark-interval", type=float, default=None)
    parser.add_argument("--no-token", action="store_true", help="accept requests without a bearer token")
    args = parser.parse_args()
    server = FakeApiServer(
        port=args.port, bookmark_interval=args.bookmark_interval, token=None if args.no_token else "test-token"
    )
    for directory in args.data:
        server.load_dir(directory)
    server.start()
    if args.kubeconfig:
        server.write_kubeconfig(args.kubeconfig)
    print(f"serving {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
