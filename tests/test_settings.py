"""One settings module (plugin/ops/settings.py): every variable the server, the image's script and
the chart read is declared there, docs/settings.md is its generated table, and nothing in ops/ reads
the environment around it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_sampling_mask.ops import settings

REPO_ROOT = Path(__file__).resolve().parent.parent
OPS = REPO_ROOT / "plugin" / "ops"
VALUES = REPO_ROOT / "docker" / "helm" / "triton-sampling-mask" / "values.yaml"
DEPLOYMENT = REPO_ROOT / "docker" / "helm" / "triton-sampling-mask" / "templates" / "deployment.yaml"
SERVE_SH = REPO_ROOT / "docker" / "serve.sh"
# Variables the chart sets that belong to the platform, not to this package.
PLATFORM_VARIABLES = {"HOME", "TMPDIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "PYTHONDONTWRITEBYTECODE"}


def test_docs_settings_md_is_the_generated_table():
    committed = (REPO_ROOT / "docs" / "settings.md").read_text()
    assert committed == settings.markdown(), (
        "docs/settings.md is stale: python -m triton_sampling_mask.ops.settings --markdown > docs/settings.md"
    )
    for name in settings.SETTINGS:
        assert f"| `{name}` |" in committed


def test_every_setting_has_a_name_a_doc_and_a_shown_default():
    assert len(settings.SETTINGS) >= 15
    for name, setting in settings.SETTINGS.items():
        assert setting.name == name and re.fullmatch(r"[A-Z][A-Z0-9_]+", name)
        assert setting.doc and "\n" not in setting.doc and "|" not in setting.doc, name
        assert setting.default_text(), name
        assert setting.scope in settings.SCOPES, name


def test_a_value_is_parsed_and_an_unset_or_empty_one_is_the_default(monkeypatch):
    monkeypatch.delenv("TRITON_EXIT_TIMEOUT_S", raising=False)
    assert settings.TRITON_EXIT_TIMEOUT_S.value() == 5
    monkeypatch.setenv("TRITON_EXIT_TIMEOUT_S", "  ")
    assert settings.TRITON_EXIT_TIMEOUT_S.value() == 5
    monkeypatch.setenv("TRITON_EXIT_TIMEOUT_S", " 12 ")
    assert settings.TRITON_EXIT_TIMEOUT_S.value() == 12
    assert settings.TRITON_WATCHDOG_INTERVAL_S.value({"TRITON_WATCHDOG_INTERVAL_S": "0.5"}) == 0.5
    assert settings.TRITON_HTTP_THREAD_COUNT.value({}) is None  # computed by its reader
    assert settings.GPU_COUNT.value({"GPU_COUNT": "3"}) == 3


@pytest.mark.parametrize("name, text", [("TRITON_HTTP_PORT", "http"), ("TRITON_PROBE_PORT", "70000")])
def test_a_bad_value_names_its_variable(name, text):
    with pytest.raises(ValueError, match=name):
        settings.SETTINGS[name].value({name: text})


def test_shell_lines_survive_eval_whatever_the_value():
    hostile = "1; touch /tmp/tsm-settings-pwned $(id)"
    env = {**os.environ, "MODEL_REPOSITORY": hostile, "GPU_COUNT": "2"}
    script = (
        f'eval "$({sys.executable} -m triton_sampling_mask.ops.settings --shell MODEL_REPOSITORY GPU_COUNT)"; '
        'printf "%s\\n" "$MODEL_REPOSITORY" "$GPU_COUNT"'
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.splitlines() == [hostile, "2"]


def test_an_unknown_or_unparsable_setting_fails_the_shell_output():
    for env, names in (({}, ["NO_SUCH_SETTING"]), ({"GPU_COUNT": "two"}, ["GPU_COUNT"])):
        done = subprocess.run(
            [sys.executable, "-m", "triton_sampling_mask.ops.settings", "--shell", *names],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        assert done.returncode != 0 and names[0] in done.stderr and not done.stdout


def test_ops_reads_the_environment_only_through_settings():
    """Outside settings.py, ops/ may copy os.environ for tritonserver's environment, nothing else."""
    found = []
    for path in sorted(OPS.glob("*.py")):
        if path.name == "settings.py":
            continue
        tree = ast.parse(path.read_text())
        copies = {
            id(node.args[0])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and node.args
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "environb", "getenv", "getenvb")
                and id(node) not in copies
            ):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: os.{node.attr}")
    assert not found, "read these through ops.settings:\n" + "\n".join(found)


def test_the_charts_env_comment_lists_every_setting():
    lines = VALUES.read_text().splitlines()
    end = lines.index("  env: []")
    start = end
    while lines[start - 1].lstrip().startswith("#"):
        start -= 1
    comment = " ".join(lines[start:end])
    named = set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", comment))
    assert named == set(settings.SETTINGS), (
        f"values.yaml's server.env comment: missing {sorted(set(settings.SETTINGS) - named)}, "
        f"unknown {sorted(named - set(settings.SETTINGS))}"
    )


def test_the_chart_and_serve_sh_set_and_read_only_settings():
    chart = set(re.findall(r"- name: ([A-Z][A-Z0-9_]+)", DEPLOYMENT.read_text()))
    assert chart - PLATFORM_VARIABLES <= set(settings.SETTINGS), chart - PLATFORM_VARIABLES
    assert {"MODEL_REPOSITORY", "TRITON_PROBE_PORT", "TRITON_ADMIN_KEY"} <= chart
    text = SERVE_SH.read_text()
    asked = re.search(r"settings --shell ([A-Z_ ]+)\)", text).group(1).split()
    read = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", text)) | set(asked)
    assert "MODEL_REPOSITORY" in read and read <= set(settings.SETTINGS), read - set(settings.SETTINGS)
    assert all(len(re.findall(rf"\b{name}\b", text)) >= 2 for name in asked), "a setting asked for and never used"
