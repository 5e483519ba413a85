"""Start a real tritonserver (2.51, shipped in the `nvidia-pytriton` wheel) on a model repository.

    python -m triton_sampling_mask.ops.launcher [--model-repository DIR] [--no-supervise]
        [--no-proxy] [--probe-port N] [--watchdog-interval S] [--exit-timeout S]
        [--open-admin-apis] [--show-defences] [--check-door] [-- extra tritonserver flags]

By default tritonserver runs hardened (`hardening_args`: explicit model control, a bounded exit
timeout, the admin APIs locked behind TRITON_ADMIN_KEY, generated when unset) under a memory
limit, as the child of a supervisor (`ops.supervisor`: restarts, a model watchdog, /ready on
TRITON_PROBE_PORT), behind HAProxy (`ops.proxy`), which owns the public ports; without haproxy it
refuses to start unless `--no-proxy`. `--no-supervise` execs tritonserver instead. The defences
that run follow the server's capabilities (`ops.workarounds`; `--show-defences` prints the plan);
`--check-door` checks the front door's values with `haproxy -c`, prints them and exits. What each
part does: docs/operations.md; the environment variables: `ops.settings` (docs/settings.md).

The wheel's stub embeds the system libpython, ignores PYTHONPATH and finds packages through the
`python3` first on PATH, so the server runs with this virtual environment's bin/ first on PATH.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from . import capabilities, settings
from .memory_limit import MemoryCage, make_cage
from .proxy import FrontDoor, ProxyError, find_haproxy, internal_ports
from .secret_files import check_chosen_path, process_directory, read_client_keys, remove_secret_file, write_secret_file
from .server_process import (
    ADMIN_APIS,
    ADMIN_HEADER,
    GRPC_ADMIN_HEADER,
    SERVER_UMASK,
    check_caller_flags,
    check_user_admin_key,
    hardening_args,
    redact,
    server_binary,
    server_command,
    server_environment,
    server_flags,
)
from .supervisor import Supervisor, SupervisorConfig
from .trace_flags import trace_args
from .workarounds import WorkaroundPlan
from .workarounds import plan as workaround_plan


def resolve_admin_key(http_port: int) -> tuple[str, str, Path | None]:
    """(key, where it comes from, the file it was written to): TRITON_ADMIN_KEY, else a fresh
    random key written, readable by this user only, to a file created for it (`secret_files`):
    TRITON_ADMIN_KEY_FILE, or `admin-key` in a new private directory. The key is never printed."""
    key = settings.TRITON_ADMIN_KEY.value()
    if key:
        try:  # refused before anything starts
            check_user_admin_key(key)
        except ValueError as error:
            raise SystemExit(f"[launcher] TRITON_ADMIN_KEY: {error}; unset it to have a random one generated") from None
        return key, "from TRITON_ADMIN_KEY", None
    chosen = settings.TRITON_ADMIN_KEY_FILE.value()
    key = secrets.token_urlsafe(32)
    try:
        if chosen:
            path = Path(chosen)
            check_chosen_path(path)
        else:
            path = process_directory(f"admin-key-{http_port}") / "admin-key"
        write_secret_file(path, key + "\n")
    except (ValueError, OSError) as error:
        where = f"TRITON_ADMIN_KEY_FILE={chosen}" if chosen else "the admin key file"
        raise SystemExit(f"[launcher] {where}: {error}") from None
    return key, f"generated and written to {path} (mode 0600; set TRITON_ADMIN_KEY to choose it)", path


def client_keys() -> dict[str, str]:
    """The front door's client keys (TRITON_CLIENT_KEYS_FILE, TRITON_API_KEY), their names logged;
    a file that cannot be used stops the start, saying why."""
    chosen = settings.TRITON_CLIENT_KEYS_FILE.value()
    try:
        keys = read_client_keys(Path(chosen) if chosen else None, settings.TRITON_API_KEY.value())
    except (ValueError, OSError) as error:
        raise SystemExit(f"[launcher] TRITON_CLIENT_KEYS_FILE: {error}") from None
    if keys:
        print(f"[launcher] keyed clients (Authorization: Bearer <key>): {', '.join(keys)}", flush=True)
    return keys


def ports_from_environment() -> dict[str, int]:
    """tritonserver's ports: TRITON_HTTP_PORT, TRITON_GRPC_PORT and TRITON_METRICS_PORT."""
    return {
        "http": settings.TRITON_HTTP_PORT.value(),
        "grpc": settings.TRITON_GRPC_PORT.value(),
        "metrics": settings.TRITON_METRICS_PORT.value(),
    }


def defence_plan() -> WorkaroundPlan:
    """The defences to run (`ops.workarounds`) for this host's tritonserver: its capabilities are
    read once here (its --help stays cached in `server_flags` for the command line), and logged."""
    try:
        binary = server_binary()
    except RuntimeError as error:
        sys.exit(f"[launcher] {error}")
    caps = capabilities.read(binary, server_environment(private_shm=False), flags=server_flags(binary))
    defences = workaround_plan(caps)
    print(f"[launcher] {caps.describe()}; {defences.describe()}", flush=True)
    return defences


def print_door(door: FrontDoor) -> None:
    """The values and model maps HAProxy accepted (`--check-door`), secrets redacted."""
    for name, value in sorted(door.environment().items()):
        print(f"{name}={'<secret>' if name in ('DOOR_INTERNAL_KEY', 'DOOR_API_AUTHORIZATION') else value}")
    for path in sorted(set(door.directory.glob("*.map")) - {door.directory / "client_keys.map"}):
        print(f"\n{path.name}:\n{path.read_text()}", end="")
    print(f"[launcher] haproxy accepts the front door's values for {door.repository}", file=sys.stderr)


def leave_nothing(door: FrontDoor, cage: MemoryCage, key_file: Path | None) -> None:
    """Remove what a start made before exiting without a supervisor to own it: the door's private
    directory, the memory cgroup and a generated admin key."""
    door.clean_up()
    cage.remove()
    if key_file:
        remove_secret_file(key_file)


# Command-line flags that override a setting: flag, setting, meaning.
SETTING_FLAGS = (
    ("--probe-port", settings.TRITON_PROBE_PORT, "port of the supervisor's /ready and /live (0: none)"),
    ("--watchdog-interval", settings.TRITON_WATCHDOG_INTERVAL_S, "seconds between watchdog rounds"),
    ("--exit-timeout", settings.TRITON_EXIT_TIMEOUT_S, "tritonserver's --exit-timeout-secs"),
)


def main(argv: list[str] | None = None) -> None:
    """Serve a model repository in the foreground (`make serve`, the container's command): under
    the supervisor by default, or exec'd with --no-supervise."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-repository", default=settings.MODEL_REPOSITORY.value())
    parser.add_argument(
        "--no-supervise",
        action="store_true",
        help="exec tritonserver: no restarts, no watchdog, no probe endpoint, no /dev/shm cleanup",
    )
    for flag, setting, meaning in SETTING_FLAGS:  # a flag beats its variable, which beats the default
        help_text = f"{meaning} ({setting.name}; default %(default)s)"
        parser.add_argument(flag, type=setting.parse, default=setting.value(), help=help_text)
    parser.add_argument(
        "--probe-timeout", type=float, default=5.0, help="seconds a watchdog inference may take (default %(default)s)"
    )
    parser.add_argument(
        "--open-admin-apis",
        action="store_true",
        help="leave the shared-memory, model-repository, logging and trace APIs open to anyone (not recommended)",
    )
    parser.add_argument(
        "--no-proxy",
        action="store_true",
        default=settings.TRITON_PROXY.value() == "none",
        help="no HAProxy in front: tritonserver owns the public ports (TRITON_PROXY=none)",
    )
    parser.add_argument(
        "--show-defences",
        action="store_true",
        help="print the server's capabilities and the defences that would run here (ops.workarounds), and exit",
    )
    parser.add_argument(
        "--check-door",
        action="store_true",
        help="prepare the front door as a start would, check it with haproxy -c, print its values and maps, and exit",
    )
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to tritonserver after --")
    args = parser.parse_args(argv)
    if args.show_defences:
        defence_plan()
        return
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    # OpenTelemetry tracing when TRITON_TRACE_ENDPOINT is set; the caller's own --trace-config flags come after
    extra = trace_args(settings.TRITON_TRACE_ENDPOINT.value(), settings.TRITON_TRACE_RATE.value()) + extra
    for arg in extra:  # tritonserver's own flag, if given, is the exit timeout the supervisor honours
        if arg.startswith("--exit-timeout-secs="):
            args.exit_timeout = int(arg.split("=", 1)[1])

    ports = ports_from_environment()
    proxied = args.check_door or not (args.no_proxy or args.no_supervise)
    try:  # refused before anything starts
        check_caller_flags(extra, proxied, admin_locked=not args.open_admin_apis)
    except ValueError as error:
        raise SystemExit(f"[launcher] a flag after --: {error}") from None
    if proxied and find_haproxy() is None:
        sys.exit(
            "[launcher] haproxy is not installed, and without it tritonserver would face clients itself: install it "
            "(`apt-get install haproxy`; `make serve` does as root) or pass --no-proxy (TRITON_PROXY=none)"
        )
    keys = client_keys() if proxied else {}  # a bad key file stops the start before any secret is written
    admin_key, key_file = None, None
    if args.open_admin_apis:
        print(
            f"[launcher] WARNING: the {', '.join(ADMIN_APIS)} APIs are open to anyone (--open-admin-apis)",
            flush=True,
        )
    else:
        admin_key, where, key_file = resolve_admin_key(ports["http"])
        print(
            f"[launcher] the {', '.join(ADMIN_APIS)} APIs need the header '{ADMIN_HEADER}' "
            f"(gRPC: '{GRPC_ADMIN_HEADER}'); key {where}",
            flush=True,
        )
    defences = defence_plan()
    runs_private_shm = defences.runs("private_shm")
    if defences.runs("memory_limit"):
        cage = make_cage(f"triton-server-{ports['http']}-{os.getpid()}")
    else:
        cage = MemoryCage("none", 0)  # a container's own limit bounds it
    if args.no_supervise and not proxied:
        command = server_command(
            Path(args.model_repository),
            ports,
            hardening_args(extra, ports["http"], admin_key, args.exit_timeout) + extra,
        )
        print(f"[launcher] {cage.describe()}", flush=True)
        print("+ " + " ".join(redact(command, admin_key)), flush=True)
        os.umask(SERVER_UMASK)
        cage.enter()
        os.execve(command[0], command, server_environment(admin_key, private_shm=runs_private_shm))
    front_door = None
    if proxied:
        public = {**ports, "probe": args.probe_port, "api": settings.TRITON_API_PORT.value()}
        front_door = FrontDoor(
            Path(args.model_repository),
            public,
            admin_key,
            internal_ports(settings.TRITON_INTERNAL_PORT_BASE.value()),
            stream_gate=defences.runs("stream_gate"),
            json_checks=defences.runs("json_checks"),
            client_keys=keys,
        )
        try:
            front_door.prepare()
        except ProxyError as error:
            leave_nothing(front_door, cage, key_file)
            sys.exit(f"[launcher] {error}")
        if args.check_door:
            print_door(front_door)
            leave_nothing(front_door, cage, key_file)
            return
        internal = front_door.internal
        print(
            f"[launcher] HAProxy owns the public ports (HTTP {ports['http']}, gRPC {ports['grpc']}, metrics "
            f"{ports['metrics']}, probe {args.probe_port}); tritonserver listens on 127.0.0.1 (HTTP {internal['http']}, "
            f"gRPC {internal['grpc']}, metrics {internal['metrics']}) with an internal key of its own",
            flush=True,
        )
        ports = {name: internal[name] for name in ports}
        admin_key = front_door.internal_key if admin_key is not None else None
    elif not args.no_supervise:
        print("[launcher] WARNING: no proxy (--no-proxy): tritonserver faces clients itself", flush=True)
    config = SupervisorConfig(
        model_repository=Path(args.model_repository),
        ports=ports,
        extra_args=extra,
        admin_key=admin_key,
        probe_port=args.probe_port,
        watchdog_interval_s=args.watchdog_interval,
        probe_timeout_s=args.probe_timeout,
        exit_timeout_s=args.exit_timeout,
        admin_key_file=key_file,
        front_door=front_door,
        memory_cage=cage,
        private_shm=runs_private_shm,
        dead_stub_sweeps=defences.runs("dead_stub_sweeps"),
    )
    sys.exit(Supervisor(config).run())


if __name__ == "__main__":
    main()
