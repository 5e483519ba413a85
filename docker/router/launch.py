"""Start the router in front of the replicas: smg (the SGLang model gateway, the default) or
sglang-router, with its API key read from a file, never from its command line.

    python launch.py [--router smg|sglang-router] [--api-key-file FILE] [router flags...]

Every other flag is the router's own (`python -m smg.launch_router --help`). The key in FILE
(first line; a Docker or Kubernetes secret) becomes the router's `--api-key` inside this process:
the router then requires `Authorization: Bearer <key>` from its clients and sends it to the
replicas, whose front door counts the router as one keyed client (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROUTERS = ("smg", "sglang-router")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", choices=ROUTERS, default="smg")
    parser.add_argument("--api-key-file", type=Path, help="a file holding the router's API key (first line)")
    ours, rest = parser.parse_known_args(argv)
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in rest):
        sys.exit("launch.py: give the key as --api-key-file, not --api-key (a command line is readable by others)")
    if ours.api_key_file is not None:
        try:
            lines = ours.api_key_file.read_text().splitlines()
        except OSError as error:
            sys.exit(f"launch.py: cannot read --api-key-file: {error.strerror}")
        key = lines[0].strip() if lines else ""
        if not key:
            sys.exit("launch.py: --api-key-file holds no key")
        rest = [*rest, "--api-key", key]  # parsed in this process, never exec'd
    if ours.router == "smg":
        from smg.launch_router import launch_router, parse_router_args
    else:
        from sglang_router.launch_router import launch_router, parse_router_args
    launch_router(parse_router_args(rest))


if __name__ == "__main__":
    main()
