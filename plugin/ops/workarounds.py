"""Every defence against a Triton 2.51 limit or a bare host, in one table (workarounds.toml, beside
this module): where it lives, when it runs, what the server offers natively, and its row in
docs/upstream-issues.md.

The launcher reads the server's capabilities once (`ops.capabilities`), asks `plan(caps)` which
defences run, and passes the answers as booleans to the builders (`FrontDoor(stream_gate=...,
json_checks=...)`, `SupervisorConfig(private_shm=..., dead_stub_sweeps=...)`, the memory cage).
A defence whose upstream fix lands gets `fixed_in` and stops running on that server version;
where a newer line has a native equivalent that covers the same attack, its predicate says so.
docs/upstream-issues.md, "Which defences run where", is this table for the image's lines (a test
keeps them equal, and prints the table to paste when they differ).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .capabilities import ServerCapabilities

if sys.version_info >= (3, 11):
    import tomllib
else:  # the 24.10 image line's Python
    import tomli as tomllib


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


TABLE = Path(__file__).with_name("workarounds.toml")
# What a row's `applies` may say, as a condition on the server's capabilities.
CONDITIONS: dict[str, Callable[[ServerCapabilities], bool]] = {
    "always": lambda caps: True,
    "host-ipc": lambda caps: not (caps.container and caps.private_ipc),
    "host-cgroup": lambda caps: not (caps.container and caps.private_cgroup),
}


def condition(text: str) -> Callable[[ServerCapabilities], bool]:
    """A row's `applies` as a predicate: a name of CONDITIONS, or `flag --name` (the server lists it)."""
    if text.startswith("flag "):
        flag = text.removeprefix("flag ").strip()
        return lambda caps: caps.has_flag(flag)
    if text not in CONDITIONS:
        raise ValueError(f"{TABLE.name}: unknown condition {text!r} (known: {', '.join(CONDITIONS)}, flag --name)")
    return CONDITIONS[text]


def read_table(path: Path = TABLE) -> tuple[Workaround, ...]:
    """The defences of workarounds.toml, in its order."""
    rows = tomllib.loads(path.read_text())["defence"]
    return tuple(
        Workaround(
            name=row["name"],
            title=row["title"],
            modules=tuple(row["modules"]),
            anchor=row["anchor"],
            on_when=row["on_when"],
            applies=condition(row["applies"]),
            native=row["native"],
            files=tuple(row.get("files", ())),
            fixed_in=tuple(int(part) for part in row["fixed_in"].split(".")) if "fixed_in" in row else None,
        )
        for row in rows
    )


WORKAROUNDS: tuple[Workaround, ...] = read_table()
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
