"""The GPU image can be built, checked without Docker, for each image line of docker/Dockerfile
(docker/image_lines.py reads them from its `line-<name>` stages): the Dockerfile's `pip install`
resolves for that line's Python and platform, the package parses with that Python's grammar, and
the image's server flags hold the largest request the README promises.

The resolver test needs PyPI (as `docker build` does). torch's wheels on PyPI carry no separate
metadata file (PEP 658), so a plain `pip install --dry-run` downloads the ~900 MB torch wheel to
read its dependencies; `--use-feature=fast-deps` makes pip read just the wheel's METADATA member
through HTTP range requests instead, so the whole check fetches a few MB per line.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
PIP_TIMEOUT_S = 300
# pip options in the Dockerfile's `pip install` that change what gets installed are not expected.
HARMLESS_PIP_FLAGS = {"--no-cache-dir", "--upgrade", "-U", "--quiet", "-q", "--progress-bar=off"}


def _image_lines_module():
    spec = importlib.util.spec_from_file_location("image_lines", REPO_ROOT / "docker" / "image_lines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("image_lines", module)  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


image_lines = _image_lines_module()
DEFAULT_LINE, LINES = image_lines.read(DOCKERFILE)


def line_target(line) -> tuple[str, str]:
    """(Python, platform) of an image line, checked for form."""
    assert re.fullmatch(r"3\.\d+", line.python), line.python
    assert re.fullmatch(r"manylinux_2_\d+_(x86_64|aarch64)", line.platform), line.platform
    return line.python, line.platform


def final_stage(text: str) -> list:
    """The instructions after the last FROM: the image every line builds."""
    found = image_lines.instructions(text)
    last_from = max(index for index, instruction in enumerate(found) if instruction.keyword == "FROM")
    return found[last_from + 1 :]


def run_commands(text: str) -> list[str]:
    """The shell commands of the final stage's RUNs (a here-document's body appended)."""
    return [i.arguments + ("\n" + i.heredoc if i.heredoc else "") for i in final_stage(text) if i.keyword == "RUN"]


def shell_commands(command: str) -> list[list[str]]:
    """A RUN line split into its commands (at &&, ||, ; and |), each as shell words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in [*lexer, ";"]:
        if token in ("&&", "||", ";", "|"):
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [words for words in commands if words]


def copied_to(text: str, source: str) -> PurePosixPath:
    """Where the final stage's COPY puts `source`, relative to its WORKDIR."""
    workdir = PurePosixPath("/")
    for instruction in final_stage(text):
        if instruction.keyword == "WORKDIR":
            workdir = workdir / instruction.arguments
        elif instruction.keyword == "COPY":
            *sources, dest = [word for word in instruction.arguments.split() if not word.startswith("--")]
            if source in sources:
                return workdir / dest
    raise AssertionError(f"docker/Dockerfile copies no {source}")


def pip_install_targets(text: str, line) -> list[str]:
    """What the Dockerfile's `pip install` installs on `line`: its ENV substituted, the folder the
    project was copied to taken as the repository."""
    project_dir = copied_to(text, "pyproject.toml")
    substitute = lambda word: re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: line.env[m.group(1) or m.group(2)], word)  # noqa: E731
    targets, workdir = [], PurePosixPath("/")
    for instruction in final_stage(text):
        if instruction.keyword == "WORKDIR":
            workdir = workdir / instruction.arguments
        if instruction.keyword != "RUN":
            continue
        for words in shell_commands(instruction.arguments):
            if "pip" not in words or "install" not in words:
                continue
            for word in words[words.index("install") + 1 :]:
                if word.startswith("-"):
                    assert word in HARMLESS_PIP_FLAGS, (
                        f"pip option {word!r} in docker/Dockerfile: teach this test about it"
                    )
                    continue
                word = substitute(word)
                if word.startswith((".", "/")):
                    path, extras = re.fullmatch(r"(.+?)(\[[\w,-]+\])?", word).groups()
                    assert workdir / path == project_dir, f"pip installs {word}, pyproject.toml is in {project_dir}"
                    word = str(REPO_ROOT) + (extras or "")
                targets.append(word)
    assert targets, "docker/Dockerfile installs nothing with pip"
    return targets


def compatible_platforms(platform: str) -> list[str]:
    """Every manylinux tag the image's pip accepts: manylinux_2_N down to 2_5, with the legacy
    aliases. pip's --platform takes a tag literally (manylinux_2_28 would miss torch's manylinux1
    wheel), so the test passes them all, as the image's own pip would accept them."""
    glibc_minor, arch = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform).groups()
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(int(glibc_minor), 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= int(glibc_minor)]


def target_environment(python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker values of the image (pip evaluates markers for its own interpreter, not for
    --python-version, so the test re-checks them; patch level unknown, taken as .0)."""
    machine = platform.split("_", 3)[3]
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "implementation_version": f"{python}.0",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def pip_resolve(targets: list[str], python: str, platform: str, report: Path) -> dict:
    """`pip install --dry-run` for the image's Python and platform; the --report as a dict."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        *[flag for tag in compatible_platforms(platform) for flag in ("--platform", tag)],
        "--use-feature=fast-deps",
        "--progress-bar=off",
        "--disable-pip-version-check",
        "--report",
        str(report),
        *targets,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=REPO_ROOT)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        if "fast-deps" in tail and "invalid choice" in tail:
            tail += "\n(this pip dropped --use-feature=fast-deps: resolve torch's pins from its wheel's METADATA another way)"
        pytest.fail(
            f"docker/Dockerfile's pip install cannot resolve for Python {python} on {platform}:\n{tail}", pytrace=False
        )
    return json.loads(report.read_text())


def unmet_requirements(report: dict, environment: dict[str, str]) -> list[str]:
    """Requirements the image's Python needs that pip's report lacks (markers such as
    `python_version < "3.11"`, false for the interpreter running pip); raises on version conflicts."""
    installed = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    extras = {name: set(item.get("requested_extras") or ()) for name, item in installed.items()}
    missing, changed = {}, True
    while changed:  # extras requested by a dependency turn on more requirements
        changed = False
        for name, item in installed.items():
            for line in item["metadata"].get("requires_dist") or ():
                requirement = Requirement(line)
                if requirement.marker and not any(
                    requirement.marker.evaluate({**environment, "extra": extra}) for extra in {"", *extras[name]}
                ):
                    continue
                dependency = canonicalize_name(requirement.name)
                if dependency not in installed:
                    requirement.marker = None
                    missing[str(requirement)] = None
                    continue
                version = installed[dependency]["metadata"]["version"]
                assert requirement.specifier.contains(version, prereleases=True), (
                    f"{name} needs {requirement}, resolved {version}"
                )
                if not requirement.extras <= extras[dependency]:
                    extras[dependency] |= requirement.extras
                    changed = True
    return list(missing)


def resolve_line(line_name: str, directory: Path) -> tuple[dict, str]:
    """(pip's report, the line's Python) for the Dockerfile's `pip install` on that line: pip
    evaluates markers for the Python running it, so what the line's Python needs beyond that is
    added and resolved again."""
    text, line = DOCKERFILE.read_text(), LINES[line_name]
    python, platform = line_target(line)
    targets = pip_install_targets(text, line)
    environment = target_environment(python, platform)
    for attempt in range(4):
        report = pip_resolve(targets, python, platform, directory / f"report{attempt}.json")
        missing = unmet_requirements(report, environment)
        if not missing:
            return report, python
        targets = targets + missing
    pytest.fail(f"dependencies for Python {python} still unresolved: {missing}")


@pytest.fixture(scope="module")
def resolutions(request, tmp_path_factory):
    """{line name: the future of resolve_line}, for every line a selected test checks; the lines
    resolve side by side (pip mostly waits on the index), each test waits for its own."""
    wanted = [
        item.callspec.params["line_name"]
        for item in request.session.items
        if item.originalname == "test_dockerfile_pins_install_on_the_line_python_and_platform"
    ]
    with ThreadPoolExecutor(max_workers=len(wanted)) as pool:
        yield {name: pool.submit(resolve_line, name, tmp_path_factory.mktemp(f"pip-{name}")) for name in wanted}


@pytest.mark.parametrize("line_name", list(LINES))
def test_dockerfile_pins_install_on_the_line_python_and_platform(line_name, resolutions):
    report, python = resolutions[line_name].result()  # a failed resolution fails here, with pip's tail
    line = LINES[line_name]
    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in report["install"]}
    assert "triton-sampling-mask" in resolved, "the project itself was not resolved"
    for name, metadata in resolved.items():
        requires_python = metadata.get("requires_python")
        if requires_python:
            assert Version(f"{python}.0") in SpecifierSet(requires_python), (name, requires_python)
    for name in ("torch", "transformers", "numpy"):
        assert resolved[name]["version"] == getattr(line, name), (line_name, name, resolved[name]["version"])
    # what the front door's own processes import (the stream gate: grpc) is installed too
    assert "hpack" in resolved, "the image lacks hpack, which ops/stream_gate.py imports"


def test_the_lines_and_the_default():
    """`current` is the default line (compose and the chart build and run it); each line's stage
    names its base image by a fixed tag, and the default line is the newest Triton."""
    assert DEFAULT_LINE == "current"
    assert set(LINES) == {"current", "2.51"}
    for line in LINES.values():
        assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", line.base), line.base
        assert re.fullmatch(r"\d+\.\d+\.\d+", line.triton), line.triton
    assert LINES["2.51"].triton.startswith("2.51.")
    newest = max(LINES.values(), key=lambda line: Version(line.triton))
    assert newest.name == DEFAULT_LINE


def test_the_image_checks_its_own_line():
    """The build fails early if a line's Python, platform or Triton stop describing its base image."""
    text = DOCKERFILE.read_text()
    first = run_commands(text)[0]
    for key in ("SAMPLER_PYTHON", "SAMPLER_PLATFORM", "SAMPLER_TRITON", "TRITON_SERVER_VERSION"):
        assert key in first, key
    assert "assert" in first
    found = image_lines.instructions(text)
    froms = [i.arguments for i in found if i.keyword == "FROM"]
    assert froms[-1] == "line-${LINE}", froms
    assert [i.arguments for i in found if i.keyword == "ARG"] == [f"LINE={DEFAULT_LINE}"]


def test_the_image_runs_unprivileged_with_a_healthcheck():
    stage = final_stage(DOCKERFILE.read_text())
    users = [i.arguments for i in stage if i.keyword == "USER"]
    assert users and users[-1] == "1000:1000", users
    assert [i.keyword for i in stage][-3:] == ["EXPOSE", "HEALTHCHECK", "CMD"]
    (healthcheck,) = [i.arguments for i in stage if i.keyword == "HEALTHCHECK"]
    assert "http://localhost:8003/ready" in healthcheck
    env = {k: v for i in stage if i.keyword == "ENV" for k, v in image_lines.env_pairs(i.arguments).items()}
    for name in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert env[name].startswith("/tmp"), name
    for command in run_commands(DOCKERFILE.read_text()):
        if "apt-get" in command:  # HAProxy, the front door; a compiler only for the build step that removes it
            # (NGC ships jemalloc and curl)
            haproxy = re.search(r"apt-get install -y --no-install-recommends haproxy\s*&&", command)
            compiler = "apt-get install -y --no-install-recommends gcc libc6-dev" in command
            assert haproxy or (compiler and "apt-get purge -y --auto-remove gcc libc6-dev" in command), command
            assert "rm -rf /var/lib/apt/lists/*" in command, command
        if "pip" in command and "install" in command:
            assert "--no-cache-dir" in command, command


def test_compose_builds_the_default_line():
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    service = compose["services"]["sampler"]
    line = re.fullmatch(r"\$\{(\w+):-([\w.]+)\}", service["build"]["args"]["LINE"])
    assert line and line.group(2) == DEFAULT_LINE, service["build"]["args"]
    assert service["image"].endswith(f"${{{line.group(1)}:-{DEFAULT_LINE}}}"), service["image"]


def test_deploy_doc_table_matches_the_lines():
    """docs/deploy.md's table of lines says what the Dockerfile says (Triton, Python, torch)."""
    text = (REPO_ROOT / "docs" / "deploy.md").read_text()
    rows = {
        cells[0].split("`")[1]: cells
        for cells in (
            [cell.strip() for cell in row.strip().strip("|").split("|")]
            for row in text.splitlines()
            if row.startswith("| `")
        )
    }
    for name, line in LINES.items():
        assert name in rows, f"docs/deploy.md has no row for line {name}"
        row = " | ".join(rows[name])
        for value in (line.triton, line.python, line.torch, line.base.rsplit(":", 1)[1]):
            assert value in row, (name, value, row)


def package_sources() -> list[Path]:
    """Every Python file the image runs: the package and the models' model.py."""
    return sorted(REPO_ROOT.glob("plugin/**/*.py")) + sorted(REPO_ROOT.glob("model_repository/*/*/*.py"))


@pytest.mark.parametrize("line_name", list(LINES))
def test_package_parses_with_the_line_python(line_name):
    """The grammar of the line's Python (ast's feature_version: this interpreter's grammar when the
    line's Python is newer, which accepts everything the older grammars do)."""
    python, _ = line_target(LINES[line_name])
    version = tuple(int(part) for part in python.split("."))
    sources = package_sources()
    assert len(sources) > 10, sources
    errors = []
    for path in sources:
        try:
            ast.parse(path.read_text(), filename=str(path), feature_version=version)
        except SyntaxError as error:
            errors.append(f"{path.relative_to(REPO_ROOT)}:{error.lineno}: {error.msg}")
    assert not errors, f"not valid Python {python}:\n" + "\n".join(errors)


# The image's settings (docs/settings.md): serve.sh and the launcher read them, the defaults must do.
SIZE_SETTINGS = ("SHM_DEFAULT_BYTES", "SHM_GROWTH_BYTES", "CUDA_POOL_BYTES", "PINNED_POOL_BYTES", "GPU_COUNT")


def serve_command(gpu_count: int) -> list[str]:
    """docker/serve.sh's command (--dry-run) with the default sizes, run by this venv's python3 as
    the image runs it by its own."""
    env = {name: value for name, value in os.environ.items() if name not in SIZE_SETTINGS}
    env.update(GPU_COUNT=str(gpu_count), PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]))
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "docker" / "serve.sh"), "--dry-run", "--model-control-mode=explicit"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return done.stdout.splitlines()


def test_server_flags_hold_the_largest_request_of_the_config(monkeypatch):
    from triton_sampling_mask.model_config import read_config_file
    from triton_sampling_mask.ops import settings
    from triton_sampling_mask.ops.server_process import resource_args

    config = read_config_file(REPO_ROOT / "model_repository" / "sampler" / "config.pbtxt")
    largest_request = 4 * config["max_batch_size"] * int(config["parameters"]["max_vocab_size"]["string_value"])
    assert largest_request == settings.LARGEST_REQUEST_BYTES
    command = serve_command(gpu_count=3)
    # The supervisor runs tritonserver (README "Failure modes"); its flags follow the "--", and the
    # launcher adds its sizing flags (the /dev/shm pools) to those.
    assert command[:3] == ["python3", "-m", "triton_sampling_mask.ops.launcher"], command
    assert command[-1] == "--model-control-mode=explicit"
    for name in SIZE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    command = command[command.index("--") :]
    command += resource_args(command[1:])
    flags = dict(
        arg.split("=", 1) for arg in command[1:] if arg.startswith("--") and "=" in arg and "cuda-memory" not in arg
    )
    backend = dict(
        arg.split("=", 1)[1].split(",", 1)[1].split("=")
        for arg in command
        if arg.startswith("--backend-config=python,")
    )
    default, growth = int(backend["shm-default-byte-size"]), int(backend["shm-growth-byte-size"])
    assert default >= 1 << 20 and growth >= 1 << 20
    # At most 4 growth steps for the largest batch (the backend asks 1.1 x what it needs).
    assert default + 4 * growth >= 1.1 * largest_request, (default, growth, largest_request)
    assert int(flags["--pinned-memory-pool-byte-size"]) >= largest_request
    pools = [arg.split("=", 1)[1] for arg in command if arg.startswith("--cuda-memory-pool-byte-size=")]
    assert [pool.split(":")[0] for pool in pools] == ["0", "1", "2"], pools
    assert all(int(pool.split(":")[1]) >= largest_request for pool in pools), pools
    assert not any(arg.startswith("--cuda-memory-pool") for arg in serve_command(gpu_count=0))


def test_the_image_runs_the_front_door():
    """HAProxy is installed, and the build checks that it accepts the config the launcher generates
    for the image's repository (the launcher runs it by default: serve.sh passes no --no-proxy)."""
    commands = run_commands(DOCKERFILE.read_text())
    assert any("--no-install-recommends haproxy" in command for command in commands), commands
    assert any(
        "-m triton_sampling_mask.ops.launcher --model-repository /models --check-door" in command
        for command in commands
    )
    assert "--no-proxy" not in (REPO_ROOT / "docker" / "serve.sh").read_text()


def _package_module_path(module: str) -> Path | None:
    """plugin/... of a `triton_sampling_mask.` module (a module file or a package's __init__)."""
    relative = module.removeprefix("triton_sampling_mask").lstrip(".").replace(".", "/")
    for path in (REPO_ROOT / "plugin" / f"{relative}.py", REPO_ROOT / "plugin" / relative / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_distributions(modules: list[str]) -> dict[str, str]:
    """{top-level module: importer} of every third-party module `modules` import, following the
    package's own imports (relative and absolute) to the modules they reach; lazy imports count."""
    third_party, seen, todo = {}, set(), list(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _package_module_path(module)
        assert path is not None, f"no file for {module}"
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("triton_sampling_mask"):
                    if _package_module_path(name) is not None:
                        todo.append(name)
                elif name.split(".")[0] not in sys.stdlib_module_names and name != "__future__":
                    third_party.setdefault(name.split(".")[0], module)
    return third_party


def image_requirements(line) -> set[str]:
    """The distributions the image's pip line names: its pins, the project's dependencies and
    those of the extras it installs (canonical names)."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for target in pip_install_targets(DOCKERFILE.read_text(), line):
        if target.startswith(str(REPO_ROOT)):
            extras = re.findall(r"[\w-]+", target[len(str(REPO_ROOT)) :])
            requirements = project["dependencies"] + [
                r for extra in extras for r in project["optional-dependencies"][extra]
            ]
            names |= {canonicalize_name(Requirement(requirement).name) for requirement in requirements}
            names.add("triton-sampling-mask")
        else:
            names.add(canonicalize_name(Requirement(target).name))
    return names


def test_the_image_installs_what_the_defences_on_its_plan_import():
    """Every defence the launcher runs in the image (the default line's server, in a container)
    has its imports declared in the image's pip line: a defence whose library is missing would
    fail only when it first runs."""
    from importlib.metadata import packages_distributions

    from triton_sampling_mask.ops import capabilities, workarounds

    line = LINES[DEFAULT_LINE]
    version = ".".join(line.triton.split(".")[:2])
    help_text = (REPO_ROOT / "tests" / "fixtures" / f"tritonserver-help-{version}.txt").read_text()
    caps = capabilities.ServerCapabilities(
        line.triton, capabilities.help_flags(help_text), container=True, private_ipc=True, private_cgroup=True
    )
    on = [workaround for workaround in workarounds.WORKAROUNDS if workaround.runs(caps)]
    assert {"stream_gate", "json_checks"} <= {workaround.name for workaround in on}
    modules = [module for workaround in on for module in workaround.modules]
    installed = image_requirements(line)
    distributions = packages_distributions()
    for top_level, importer in imported_distributions(modules).items():
        providers = {canonicalize_name(name) for name in distributions.get(top_level, [top_level])}
        assert providers & installed, (
            f"{importer} imports {top_level} ({', '.join(sorted(providers))}), which docker/Dockerfile's pip line "
            f"does not install: add it to an extra the image installs"
        )
    # files a defence runs that are not Python ship as package data
    package_data = tomllib_package_data()
    for workaround in on:
        for file in workaround.files:
            relative = PurePosixPath(file).relative_to("plugin/ops")
            assert any(relative.match(pattern) for pattern in package_data["triton_sampling_mask.ops"]), file


def tomllib_package_data() -> dict[str, list[str]]:
    """pyproject's [tool.setuptools.package-data]."""
    import tomllib

    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]


# The router in front of the replicas (docs/deploy.md, "Scale-out: the router").
ROUTER_DIR = REPO_ROOT / "docker" / "router"


def compose_file() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())


def router_flags(command: list[str]) -> dict[str, list[str]]:
    """A router command line as {flag: its values} (`--flag=value` and `--flag v1 v2` alike)."""
    flags: dict[str, list[str]] = {}
    current = None
    for word in command:
        if word.startswith("--"):
            current, _, value = word.partition("=")
            flags[current] = [value] if value else []
        elif current is not None:
            flags[current].append(word)
    return flags


def test_compose_runs_every_replica_behind_the_router():
    """Each `sampler*` service is the same image on a GPU of its own; the router lists each one's
    HTTP API port, reads its key from the secret the replicas' TRITON_API_KEY fills, and
    Prometheus scrapes every replica and the router."""
    from triton_sampling_mask.ops import settings

    services = compose_file()["services"]
    replicas = {name: s for name, s in services.items() if name.startswith("sampler")}
    assert len(replicas) >= 2, sorted(services)
    gpus = set()
    for service in replicas.values():
        assert service["image"] == replicas["sampler"]["image"] and service["build"] == replicas["sampler"]["build"]
        assert service["environment"]["TRITON_API_KEY"].startswith("${TRITON_API_KEY:?"), service["environment"]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        gpus.add(device["device_ids"][0])
    assert len(gpus) == len(replicas), gpus
    router = services["router"]
    assert (REPO_ROOT / "docker" / router["build"]["context"] / "Dockerfile").is_file()
    flags = router_flags(router["command"])
    assert sorted(flags["--worker-urls"]) == sorted(f"http://{n}:{settings.TRITON_API_PORT.default}" for n in replicas)
    (secret,) = router["secrets"]
    assert compose_file()["secrets"][secret] == {"environment": "TRITON_API_KEY"}
    assert flags["--api-key-file"] == [f"/run/secrets/{secret}"] and "--api-key" not in flags
    assert {p.split(":")[1] for p in router["ports"]} == set(flags["--port"])
    prometheus = yaml.safe_load((REPO_ROOT / "docker/prometheus/prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    for name in replicas:
        assert {
            f"{name}:{settings.TRITON_METRICS_PORT.default}",
            f"{name}:{settings.TRITON_PROBE_PORT.default}",
        } <= targets
    assert f"router:{flags['--prometheus-port'][0]}" in targets


def test_the_router_image_runs_the_launcher_unprivileged_with_smg_pinned():
    text = (ROUTER_DIR / "Dockerfile").read_text()
    found = image_lines.instructions(text)
    version = re.search(r"^ARG SMG_VERSION=(\d+\.\d+\.\d+)$", text, flags=re.MULTILINE).group(1)
    installs = [i.arguments for i in found if i.keyword == "RUN" and "pip" in i.arguments]
    assert installs == ['python3 -m pip install --no-cache-dir "smg==${SMG_VERSION}"'], installs
    assert [i.arguments for i in found if i.keyword == "USER"] == ["1000:1000"]
    (entrypoint,) = [json.loads(i.arguments) for i in found if i.keyword == "ENTRYPOINT"]
    assert entrypoint == ["python3", "/opt/router/launch.py"]
    (copy,) = [i.arguments for i in found if i.keyword == "COPY"]
    assert copy == "launch.py /opt/router/launch.py"
    (healthcheck,) = [i.arguments for i in found if i.keyword == "HEALTHCHECK"]
    assert "/readiness" in healthcheck
    makefile = subprocess.run(  # the version `make setup` installs for the tests
        ["make", "-s", "--eval", "print-smg: ; @echo $(SMG_VERSION)", "print-smg"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    )
    assert makefile.stdout.strip() == version
    python = Path(sys.prefix) / "routers" / "smg" / "bin" / "python"
    if python.exists():
        installed = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('smg'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert installed == version, "the tests' smg differs from the image's: run `make setup`"


def test_the_router_image_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), "--no-color", str(ROUTER_DIR / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("router", ["smg", "sglang-router"])
def test_the_launchers_flags_are_the_installed_routers_own(router, tmp_path):
    """launch.py's deployment flags parse with the router's own parser (the version `make setup`
    installs), the key from its file becomes --api-key, smg stays in its regular (one-model) mode
    with Kubernetes discovery on, and a key on the command line is refused."""
    python = Path(sys.prefix) / "routers" / router / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{router} is not installed (.venv/routers/{router}): run `make setup`")
    key_file = tmp_path / "key"
    key_file.write_text("router-key-0123456789abcdefghijklmnopq\n")
    script = f"""
import sys
sys.path.insert(0, {str(ROUTER_DIR)!r})
import launch
name, args = launch.router_args(["--router", {router!r}, "--api-key-file", {str(key_file)!r}, "--service-discovery",
                                 "--selector", "app=x", "--service-discovery-port", "9000"])
print(name, args.policy, args.health_check_endpoint, args.health_check_interval_secs, args.api_key,
      args.service_discovery, bool(getattr(args, "enable_igw", False)))
"""
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    policy = "least_load" if router == "smg" else "power_of_two"
    key = "router-key-0123456789abcdefghijklmnopq"
    assert done.stdout.split() == [router, policy, "/health", "5", key, "True", "False"]
    refused = subprocess.run(
        [str(python), str(ROUTER_DIR / "launch.py"), "--api-key", "visible-to-ps"], capture_output=True, text=True
    )
    assert refused.returncode != 0 and "--api-key-file" in refused.stderr
