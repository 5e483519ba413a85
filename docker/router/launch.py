"""Start the router in front of the replicas: smg (the SGLang model gateway, the default) or
sglang-router, with its API key read from a file, never from its command line.

    python launch.py [--router smg|sglang-router] [--api-key-file FILE] [router flags...]

Every other flag is the router's own (`python -m smg.launch_router --help`), given after this
deployment's (`deployment_flags`), so a flag given here wins. The key in FILE (first line; a
Docker or Kubernetes secret) becomes the router's `--api-key` inside this process: the router
then requires `Authorization: Bearer <key>` from its clients and sends it to the replicas, whose
front door counts the router as one keyed client (docs/deploy.md).

The deployment's flags, and why (docs/deploy.md, "Scale-out: the router"):
- `--policy least_load`: the generate engine keeps no prefix cache (a request's KV cache is its
  own and freed when it ends), so cache-aware routing would gain nothing and would pile a group's
  samples, which share their prompt, onto one replica; least_load sends each request to the
  replica with the least work (the replicas' `/v1/loads`, read every 2 s, and the router's own
  count of requests sent since). sglang-router 0.3.2 has no least_load: power_of_two there.
- Health checks every 5 s on `/health`, which answers 200 only while the replica's readiness
  probe does (the supervisor's /ready: a real inference of every model); 2 failures take a
  replica out, 1 success brings it back.

smg's own launcher turns on its multi-model gateway mode (IGW) whenever service discovery is on
(Kubernetes, in the Helm chart), and in that mode smg 1.13 refuses a `/generate` that names no
`model`, which is what slime and Miles send. One model is served here, so this launcher starts
smg in its regular mode, discovery or not, unless `--enable-igw` is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROUTERS = ("smg", "sglang-router")
POLICIES = {"smg": "least_load", "sglang-router": "power_of_two"}
HEALTH_FLAGS = [
    *("--health-check-endpoint", "/health", "--health-check-interval-secs", "5", "--health-check-timeout-secs", "3"),
    *("--health-failure-threshold", "2", "--health-success-threshold", "1"),
]
# smg reads each replica's /v1/loads this often (its default, 10 s, is longer than a rollout burst).
LOAD_FLAGS = {"smg": ["--load-monitor-interval", "2"], "sglang-router": []}


def deployment_flags(router: str) -> list[str]:
    """The flags this deployment gives `router` before the caller's own."""
    return ["--policy", POLICIES[router], *HEALTH_FLAGS, *LOAD_FLAGS[router]]


def read_key(path: Path) -> str:
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        sys.exit(f"launch.py: cannot read --api-key-file: {error.strerror}")
    key = lines[0].strip() if lines else ""
    if not key:
        sys.exit("launch.py: --api-key-file holds no key")
    return key


def router_args(argv: list[str] | None = None):
    """(router name, its parsed arguments) for a command line of this launcher."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", choices=ROUTERS, default="smg")
    parser.add_argument("--api-key-file", type=Path, help="a file holding the router's API key (first line)")
    ours, rest = parser.parse_known_args(argv)
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in rest):
        sys.exit("launch.py: give the key as --api-key-file, not --api-key (a command line is readable by others)")
    if ours.api_key_file is not None:
        rest = [*rest, "--api-key", read_key(ours.api_key_file)]  # parsed in this process, never exec'd
    if ours.router == "smg":
        from smg.launch_router import parse_router_args
    else:
        from sglang_router.launch_router import parse_router_args
    return ours.router, parse_router_args([*deployment_flags(ours.router), *rest])


def main(argv: list[str] | None = None) -> None:
    router, args = router_args(argv)
    if router == "sglang-router":
        from sglang_router.launch_router import launch_router

        launch_router(args)
        return
    import setproctitle
    from smg.router import Router

    setproctitle.setproctitle("smg::router")
    args._validate_router_args()  # what smg's launch_router checks, without its switch to IGW
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
