"""Every defence against a Triton 2.51 limit or a bare host, in one table: where it lives, when it
runs, what the server offers natively, and its row in docs/upstream-issues.md.

The launcher reads the server's capabilities once (`ops.capabilities`), asks `plan(caps)` which
defences run, and passes the answers as booleans to the builders (`FrontDoor(stream_gate=...,
json_checks=...)`, `SupervisorConfig(private_shm=..., dead_stub_sweeps=...)`, the memory cage).
A defence whose upstream fix lands gets `fixed_in` and stops running on that server version;
where a newer line has a native equivalent that covers the same attack, its predicate says so.
docs/upstream-issues.md, "Which defences run where", is this table for the image's lines (a test
keeps them equal, and prints the table to paste when they differ).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .capabilities import ServerCapabilities


@dataclass(frozen=True)
class Workaround:
    """One defence. `applies` is the condition in code, `on_when` the same in words; `native` says
    what the server itself offers and why it does or does not replace this. `modules` are the
    Python modules the defence runs (their imports must be in the image), `files` the others."""

    name: str
    title: str
    modules: tuple[str, ...]
    anchor: str  # the row's anchor in docs/upstream-issues.md
    on_when: str
    applies: Callable[[ServerCapabilities], bool]
    native: str
    files: tuple[str, ...] = ()
    fixed_in: tuple[int, ...] | None = None  # the first server version that makes it unneeded

    def runs(self, caps: ServerCapabilities) -> bool:
        """Whether the defence runs for a server with `caps`."""
        if self.fixed_in is not None and caps.version_tuple >= self.fixed_in:
            return False
        return self.applies(caps)


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        name="stream_gate",
        title="gRPC stream gate",
        modules=("triton_sampling_mask.ops.stream_gate",),
        anchor="grpc-streams-read-without-bound",
        on_when="always (behind the proxy)",
        applies=lambda caps: True,
        native=(
            "none that covers it: 2.56+ `--grpc-max-response-pool-size` bounds the responses queued per request, "
            "not the requests a stream has open, and blocks the thread delivering the model's responses when full"
        ),
    ),
    Workaround(
        name="json_checks",
        title="JSON checks at the proxy",
        modules=("triton_sampling_mask.ops.proxy_config",),
        files=("plugin/ops/haproxy/json_checks.lua",),
        anchor="json-bodies-checked-at-the-proxy",
        on_when="always (behind the proxy)",
        applies=lambda caps: True,
        native=(
            "partly: nesting limit (2.58), sizes checked against the body (2.60 to 2.68); still open at 2.73: "
            "malformed JSON is a 500, integers wrap, NaN is accepted"
        ),
    ),
    Workaround(
        name="dead_stub_sweeps",
        title="dead stubs' /dev/shm regions swept",
        modules=("triton_sampling_mask.ops.shm_cleanup",),
        anchor="dead-stub-regions-kept",
        on_when="always (under the supervisor)",
        applies=lambda caps: True,
        native="none: a dead stub's instance is never released (python_backend PR #431, open)",
    ),
    Workaround(
        name="private_shm",
        title="stub regions 0600 (preloaded library)",
        modules=("triton_sampling_mask.ops.private_shm",),
        files=("plugin/ops/private_shm.c",),
        anchor="stub-regions-readable-by-every-user",
        on_when="bare host, or a container sharing the host's IPC namespace",
        applies=lambda caps: not (caps.container and caps.private_ipc),
        native="none: the Python backend creates each region 0644",
    ),
    Workaround(
        name="memory_limit",
        title="memory limit on tritonserver",
        modules=("triton_sampling_mask.ops.memory_limit",),
        anchor="memory-blow-up-reaches-the-host",
        on_when="bare host, or a container sharing the host's cgroup namespace",
        applies=lambda caps: not (caps.container and caps.private_cgroup),
        native="none; in a container, the container's own memory limit",
    ),
    Workaround(
        name="http_max_input_size",
        title="`--http-max-input-size` raised to the largest request",
        modules=("triton_sampling_mask.ops.server_process",),
        anchor="flags-of-newer-lines",
        on_when="the server lists `--http-max-input-size` (2.59+)",
        applies=lambda caps: caps.has_flag("--http-max-input-size"),
        native="the flag itself: its 64 MiB default refuses the largest request the sampler admits",
    ),
    Workaround(
        name="allow_client_shm",
        title="`--allow-client-shm=true`",
        modules=("triton_sampling_mask.ops.server_process",),
        anchor="flags-of-newer-lines",
        on_when="the server lists `--allow-client-shm` (2.69+)",
        applies=lambda caps: caps.has_flag("--allow-client-shm"),
        native="the flag itself: client shared memory is off by default (the admin key still locks it)",
    ),
)
BY_NAME: dict[str, Workaround] = {workaround.name: workaround for workaround in WORKAROUNDS}


@dataclass(frozen=True)
class WorkaroundPlan:
    """Which defences run for one server: `plan.runs("stream_gate")`."""

    on: frozenset[str]

    def runs(self, name: str) -> bool:
        """Whether the defence `name` (a key of BY_NAME) runs."""
        if name not in BY_NAME:
            raise KeyError(f"no defence {name!r} in ops.workarounds (known: {', '.join(BY_NAME)})")
        return name in self.on

    def describe(self) -> str:
        """One line for the log."""
        off = [name for name in BY_NAME if name not in self.on]
        on = [name for name in BY_NAME if name in self.on]
        return f"defences on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"


def plan(caps: ServerCapabilities) -> WorkaroundPlan:
    """The defences that run for a server with `caps`."""
    return WorkaroundPlan(frozenset(workaround.name for workaround in WORKAROUNDS if workaround.runs(caps)))


def markdown(columns: Mapping[str, ServerCapabilities]) -> str:
    """The table of docs/upstream-issues.md, "Which defences run where": one row per defence, one
    column per named set of capabilities (a line on a bare host or in a container)."""
    header = ["Defence", "Module", "Runs when", *columns, "Native equivalent"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workaround in WORKAROUNDS:
        names = [module.rsplit(".", 1)[-1] for module in workaround.modules]
        names += [file.removeprefix("plugin/ops/") for file in workaround.files]
        where = ", ".join(f"`{name}`" for name in names)
        cells = [
            f"[{workaround.title}](#{workaround.anchor})",
            where,
            workaround.on_when,
            *("on" if workaround.runs(caps) else "off" for caps in columns.values()),
            workaround.native,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
