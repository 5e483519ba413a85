"""Which defences run where: the launcher's plan (`ops.workarounds`) for both image lines, on a
bare host and in a container, from each line's real `--help` text (tests/fixtures); the builders
honour the plan's booleans; the capabilities are read from the real 2.51 binary; and the table
in docs/upstream-issues.md is the registry's."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from triton_sampling_mask.ops import capabilities, proxy, server_process, workarounds
from triton_sampling_mask.ops.capabilities import ServerCapabilities
from triton_sampling_mask.ops.door_commands import door_children
from triton_sampling_mask.ops.proxy import FrontDoor
from triton_sampling_mask.ops.workarounds import BY_NAME, WORKAROUNDS, Workaround

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
UPSTREAM_ISSUES = REPO_ROOT / "docs" / "upstream-issues.md"
VERSIONS = {"2.51": "2.51.0", "2.73": "2.73.0"}
needs_haproxy = pytest.mark.skipif(proxy.find_haproxy() is None, reason="haproxy is not installed")


def line_capabilities(line: str, container: bool) -> ServerCapabilities:
    """A line's server (its fixture's flags), on a bare host or in a container with its own
    IPC and cgroup namespaces (Docker's and Kubernetes' default)."""
    flags = capabilities.help_flags((FIXTURES / f"tritonserver-help-{line}.txt").read_text())
    return ServerCapabilities(
        VERSIONS[line], flags, container=container, private_ipc=container, private_cgroup=container
    )


COLUMNS = {
    f"{line} {'container' if container else 'bare host'}": line_capabilities(line, container)
    for line in VERSIONS
    for container in (False, True)
}
ALWAYS = {"stream_gate", "json_checks", "dead_stub_sweeps"}
HOST_ONLY = {"private_shm", "memory_limit"}
NEWER_FLAGS = {"http_max_input_size", "allow_client_shm"}


@pytest.mark.parametrize(
    ("column", "expected"),
    [
        ("2.51 bare host", ALWAYS | HOST_ONLY),
        ("2.51 container", ALWAYS),
        ("2.73 bare host", ALWAYS | HOST_ONLY | NEWER_FLAGS),
        ("2.73 container", ALWAYS | NEWER_FLAGS),
    ],
)
def test_the_plan_of_each_line_and_place(column, expected):
    assert workarounds.plan(COLUMNS[column]).on == expected


def test_the_fixtures_differ_by_the_flags_the_plan_reads():
    old, new = COLUMNS["2.51 bare host"].flags, COLUMNS["2.73 bare host"].flags
    assert len(old) > 80 and old < new
    assert new - old == {
        "--http-max-input-size",
        "--grpc-infer-thread-count",
        "--grpc-max-response-pool-size",
        "--allow-client-shm",
    }


def test_no_defence_on_the_2_73_plan_is_one_the_server_does_natively():
    """Each defence names its upstream fix (`fixed_in`) once one exists; none runs on a server
    that has it. 2.73's one candidate, --grpc-max-response-pool-size, bounds another thing (the
    responses queued per request, by blocking the model's response thread): the gate stays, and
    its row says why."""
    for column in ("2.73 bare host", "2.73 container"):
        caps = COLUMNS[column]
        for name in workarounds.plan(caps).on:
            fixed_in = BY_NAME[name].fixed_in
            assert fixed_in is None or caps.version_tuple < fixed_in, (column, name)
    assert "--grpc-max-response-pool-size" in COLUMNS["2.73 bare host"].flags
    assert "--grpc-max-response-pool-size" in BY_NAME["stream_gate"].native


def test_a_defence_stops_at_the_version_that_fixes_it_upstream():
    fixed = dataclasses.replace(BY_NAME["stream_gate"], fixed_in=(2, 73))
    assert fixed.runs(COLUMNS["2.51 bare host"]) and not fixed.runs(COLUMNS["2.73 bare host"])
    unknown = dataclasses.replace(COLUMNS["2.73 bare host"], version="")
    assert fixed.runs(unknown)  # an unknown version is treated as the oldest


def test_every_flag_the_launcher_passes_exists_on_the_line_it_is_passed_to(monkeypatch):
    """The servers refuse an unknown flag at start: each flag `make serve` adds must be in the
    line's --help (the compatibility flags only where the plan says)."""
    for column, caps in COLUMNS.items():
        monkeypatch.setattr(server_process, "server_flags", lambda binary, caps=caps: caps.flags)
        args = [
            *server_process.hardening_args([], 8000, "k" * 40),
            *server_process.resource_args(),
            *server_process.loopback_args(),
            *server_process.compatibility_args("tritonserver"),
        ]
        given = {arg.split("=", 1)[0] for arg in args}
        assert given <= caps.flags, (column, sorted(given - caps.flags))
        on = workarounds.plan(caps)
        assert ("--http-max-input-size" in given) == on.runs("http_max_input_size"), column
        assert ("--allow-client-shm" in given) == on.runs("allow_client_shm"), column


def test_the_2_51_fixture_is_what_the_local_binary_prints():
    binary = str(server_process.pytriton_root() / "tritonserver" / "bin" / "tritonserver")
    text = capabilities.run_help(binary, server_process.server_environment(private_shm=False))
    assert text == (FIXTURES / "tritonserver-help-2.51.txt").read_text()


def test_the_local_binary_reports_its_version():
    binary = str(server_process.pytriton_root() / "tritonserver" / "bin" / "tritonserver")
    assert capabilities.run_version(binary, server_process.server_environment(private_shm=False)) == "2.51.0"


def test_version_and_flags_are_read_from_tritonservers_own_words():
    table = "| server_id | triton |\n| server_version                   | 2.73.0        |\n"
    assert capabilities.version_from_log(table) == "2.73.0"
    assert capabilities.version_from_log("no table") == ""
    assert ServerCapabilities("2.73.0", frozenset()).version_tuple == (2, 73, 0)
    assert ServerCapabilities("", frozenset()).version_tuple == (0,)
    assert capabilities.help_flags("Usage: x\n  --a-b <integer>\n\tsee --not-this\n  --c\n") == {"--a-b", "--c"}


def test_a_missing_binary_reports_nothing(tmp_path):
    missing = str(tmp_path / "tritonserver")
    assert capabilities.run_help(missing, {}) == ""
    assert capabilities.run_version(missing, {}) == ""
    assert capabilities.run_version(missing, {"TRITON_SERVER_VERSION": "2.73.0"}) == "2.73.0"  # NGC's variable


def test_container_markers(tmp_path):
    assert not capabilities.container_marker({}, tmp_path)
    assert capabilities.container_marker({"container": "podman"}, tmp_path)
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "cgroup").write_text("0::/init.scope\n")
    assert not capabilities.container_marker({}, tmp_path)
    (tmp_path / "proc" / "1" / "cgroup").write_text("12:memory:/kubepods/burstable/pod1/abc\n")
    assert capabilities.container_marker({}, tmp_path)
    (tmp_path / "proc" / "1" / "cgroup").unlink()
    (tmp_path / ".dockerenv").touch()
    assert capabilities.container_marker({}, tmp_path)


def test_a_namespace_is_told_from_the_kernels_initial_one(tmp_path):
    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "ipc").touch()  # any other inode: a namespace of its own
    assert capabilities.own_namespace("ipc", tmp_path)
    assert not capabilities.own_namespace("cgroup", tmp_path)  # unreadable: the host's
    here = capabilities.own_namespace("ipc")
    inode = Path("/proc/self/ns/ipc").stat().st_ino
    assert here == (inode != 0xEFFFFFFF)


@needs_haproxy
@pytest.mark.parametrize("switches", [{}, {"stream_gate": False, "json_checks": False}])
def test_the_proxy_values_follow_the_plan_and_stay_valid(tmp_path, switches):
    internal = {"http": 19000, "grpc": 19001, "metrics": 19002, "probe": 19003, "stream_gate": 19004}
    door = FrontDoor(REPO_ROOT / "model_repository", {"http": 18000, "grpc": 18001}, "user-key", internal, **switches)
    door.directory = tmp_path
    door.write_files()
    done = door.check()
    assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    gated, checked = switches.get("stream_gate", True), switches.get("json_checks", True)
    environment = door.environment()
    assert ("DOOR_STREAM_GATE" in environment) == gated  # be_grpc_stream's server: the gate or tritonserver
    assert environment.get("DOOR_JSON_CHECKS") == (str(proxy.LUA_CHECKS) if checked else None)
    # the template turns them on and off by these switches only (the gate: each stream route's server)
    template = proxy.TEMPLATE.read_text()
    assert template.count(".if defined(DOOR_STREAM_GATE)") == 2 and template.count("lua-load") == 1


def test_the_front_door_starts_the_gate_only_when_the_plan_runs_it(tmp_path):
    door = FrontDoor(REPO_ROOT / "model_repository", {"http": 1, "grpc": 2, "metrics": 3, "probe": 0}, None)
    door.directory = tmp_path
    assert [child.name for child in door_children(door)] == ["haproxy", "stream gate"]
    door = dataclasses.replace(door, stream_gate=False, json_checks=False)
    assert [child.name for child in door_children(door)] == ["haproxy"]
    assert {"DOOR_STREAM_GATE", "DOOR_JSON_CHECKS"}.isdisjoint(door.environment())


def test_the_environment_preloads_the_private_shm_library_only_when_asked(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("TRITON_MALLOC", "system")
    assert "LD_PRELOAD" not in server_process.server_environment(private_shm=False)
    with_library = server_process.server_environment().get("LD_PRELOAD", "")
    assert with_library == "" or "libprivate_shm.so" in with_library  # "": no compiler here


def test_the_registry_names_real_modules_files_and_rows():
    headings = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in UPSTREAM_ISSUES.read_text().splitlines()
        if line.startswith("## ")
    }
    assert len({workaround.name for workaround in WORKAROUNDS}) == len(WORKAROUNDS)
    for workaround in WORKAROUNDS:
        assert workaround.anchor in headings, (workaround.name, workaround.anchor)
        for module in workaround.modules:
            path = REPO_ROOT / "plugin" / (module.removeprefix("triton_sampling_mask.").replace(".", "/") + ".py")
            assert path.exists(), (workaround.name, module)
        for file in workaround.files:
            assert (REPO_ROOT / file).exists(), (workaround.name, file)


def markdown(columns: dict[str, ServerCapabilities]) -> str:
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


def doc_table() -> str:
    """The table between the markers of docs/upstream-issues.md."""
    text = UPSTREAM_ISSUES.read_text()
    begin, end = "<!-- defences: generated from plugin/ops/workarounds.py -->\n", "<!-- defences: end -->"
    assert begin in text and end in text, "docs/upstream-issues.md lost its 'Which defences run where' markers"
    return text[text.index(begin) + len(begin) : text.index(end)]


def test_the_doc_table_is_the_registrys():
    expected = markdown(COLUMNS)
    assert doc_table() == expected, "docs/upstream-issues.md, 'Which defences run where', should read:\n" + expected


def test_a_plan_names_only_defences_of_the_registry():
    on = workarounds.plan(COLUMNS["2.51 bare host"])
    with pytest.raises(KeyError, match="no defence 'stream_relay'"):
        on.runs("stream_relay")
    assert isinstance(WORKAROUNDS[0], Workaround)
    assert "defences on: stream_gate" in on.describe() and "off: http_max_input_size, allow_client_shm" in on.describe()


def test_the_launcher_shows_the_plan_it_would_run(capsys):
    from triton_sampling_mask.ops import launcher

    launcher.main(["--show-defences"])
    out = capsys.readouterr().out
    assert "[launcher] tritonserver 2.51.0 (87 flags)" in out, out
    assert "defences on: stream_gate, json_checks, dead_stub_sweeps" in out, out
    assert out.rstrip().endswith("off: http_max_input_size, allow_client_shm") == (
        not (
            capabilities.container_marker(os.environ)
            and (capabilities.own_namespace("ipc") or capabilities.own_namespace("cgroup"))
        )
    ), out  # on a bare host everything but the newer lines' flags
