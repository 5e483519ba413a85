"""Hostile clients against the full stack (`make hostile`): what one unauthenticated client, or a
client holding the admin key, can still do to `make serve`.

    python -m bench.hostile [--no-proxy] [--only NAME ...] [--stream-seconds 30]
    HOSTILE_LAUNCHER="/work/main/.venv/bin/python -m triton_sampling_mask.ops.launcher" \\
        HOSTILE_LAUNCHER_CWD=/work/main python -m bench.hostile      # another checkout's launcher

Starts the launcher (supervisor and proxy on, a client key file set: the door's keyed rules on, as a
trainer's deployment has them) on free ports with the shipped models, inside a
memory-limited cgroup of its own where this host has one (the destructive attacks run only
there), runs each attack and prints whether the service held, what was measured and how long it
took to answer again, with what a well-behaved client on 127.0.0.1 got meanwhile (sampler calls
over HTTP and gRPC, health checks) and tritonserver's memory before, at its peak during and after
the attack. Exit status 1 when an attack got through.

The stack and the attacks live in testbed/ (`testbed.stack`, `testbed.hostile`), which
client_tests/test_front_door.py runs too. Attacks (docs/operations.md, "Threat model"):
- idle-flood: thousands of idle TCP connections from one address (127.0.0.2) while a client on
  127.0.0.1 keeps inferring and health checks keep answering;
- unread-stream: one gRPC ModelStreamInfer stream of tiny sampler requests that name no outputs
  (every response is the full [256, W] set) and never reads: tritonserver's RSS and whether other
  sampler clients are shed;
- json-shape: the ~100-byte JSON body that declares a [1, 2**40] tensor;
- admin-surface: logging and trace settings without the key (HTTP and gRPC), and registering the
  server's own stub region as shared memory with it;
- secrets: the admin key on any command line, the key files' modes;
- the front door's third round (testbed/door_attacks.py): route-share, trickled-bodies,
  header-only-calls, header-spellings, abandoned-streams, probe-flood, admin-key-guessing,
  short-admin-key;
- the HTTP API's round (testbed/api_attacks.py, through the proxy's API port): api-prompt-list,
  api-long-prompt, api-many-messages, api-many-texts (refused before any tokenizing, the API's
  memory and another API client watched), api-request-template (a chat bringing its own
  template), api-big-request (n 256 x 500 tokens, then another client's chat), api-abandoned-streams
  and api-abandoned-requests (clients that reset their sockets: cancelled in the engine),
  api-gone-mid-body, api-schema, api-silent-body (70 s: a body that stops half-way);
- memory-blowup (destructive, in a memory-limited cgroup only): the JSON shape body straight to
  tritonserver's loopback port, past the proxy: the memory limit must kill the server, not the
  host, and the supervisor bring it back.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from testbed import api_attacks, door_attacks, hostile
from testbed.hostile import MemoryWatch, Prober, wait_until_answering
from testbed.stack import launch, shipped_repository, write_client_keys

# The front door's own attacks first, then the HTTP API's; the destructive memory-blowup last.
ATTACKS = {**door_attacks.ATTACKS, **api_attacks.ATTACKS, **hostile.ATTACKS}


def main(argv: list[str] | None = None) -> int:
    """Run the attacks against a fresh stack and print a table; 1 if any got through."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-proxy", action="store_true", help="the launcher without its proxy (--no-proxy)")
    parser.add_argument(
        "--legacy", action="store_true", help="HOSTILE_LAUNCHER predates the front door (no --no-proxy flag)"
    )
    parser.add_argument("--only", nargs="+", choices=list(ATTACKS), help="these attacks only")
    parser.add_argument("--stream-seconds", type=float, default=30.0, help="how long the unread stream runs")
    parser.add_argument("--connections", type=int, default=1500, help="idle connections of the flood")
    parser.add_argument(
        "--nofile", type=int, default=1024, help="soft descriptor limit of the launcher (a container default)"
    )
    args = parser.parse_args(argv)
    launcher = shlex.split(os.environ.get("HOSTILE_LAUNCHER", "")) or None
    cwd = Path(os.environ["HOSTILE_LAUNCHER_CWD"]) if os.environ.get("HOSTILE_LAUNCHER_CWD") else None
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    stack = launch(
        shipped_repository(work / "model_repository"),
        work / "launcher.log",
        proxied=not args.no_proxy,
        launcher=launcher,
        cwd=cwd,
        nofile=args.nofile,
        legacy=args.legacy,
        env={} if args.legacy else {"TRITON_CLIENT_KEYS_FILE": write_client_keys(work)},
    )
    print(
        f"stack up: public {stack.ports}, tritonserver HTTP {stack.server_http_port}, log {stack.log_path}", flush=True
    )
    outcomes = []
    try:
        for name, attack in ATTACKS.items():
            if args.only and name not in args.only:
                continue
            kwargs = {
                "unread-stream": {"seconds": args.stream_seconds},
                "idle-flood": {"connections": args.connections},
            }
            print(f"-- {name}", flush=True)
            with Prober(stack) as prober, MemoryWatch(stack) as memory:  # a well-behaved client meanwhile
                outcome = attack(stack, **kwargs.get(name, {}))
            outcome.detail += f"; meanwhile: {prober.summary()}; {memory.summary()}"
            print(outcome.row(), flush=True)
            outcomes.append(outcome)
            if not stack.sampler_answers():  # let a struck server come back before the next attack
                outcome.recovery_s = outcome.recovery_s or wait_until_answering(stack)
    finally:
        seconds = stack.stop()
        print(f"stack stopped in {seconds:.1f} s")
    print("\n| attack | outcome | measured | back after |\n|---|---|---|---|")
    for outcome in outcomes:
        print(outcome.row())
    return 0 if all(outcome.held for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
