"""bench/gpu-check.sh --quick runs end to end here, without CUDA: it unpacks the carried wheels onto
PYTHONPATH, imports the package from plugin/, runs the selected unit tests (a missing third-party
package skips, naming it), skips the CUDA-only steps saying so, and writes summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

PROBE_TESTS = """
import pytest


def test_the_carried_wheel_and_the_package_from_plugin_are_importable():
    import gpucheck_probe
    import gpucheck_probe_data  # from the wheel's .data/purelib
    import triton_sampling_mask

    assert gpucheck_probe.VALUE == gpucheck_probe_data.VALUE == 7
    assert "shim" in triton_sampling_mask.__file__  # plugin/ through the check's shim, first on PYTHONPATH


def test_a_missing_third_party_package_is_a_skip():
    import not_a_real_package  # noqa: F401
"""


def write_wheel(folder: Path) -> None:
    """A tiny wheel: a module at the top and one under <name>.data/purelib."""
    with zipfile.ZipFile(folder / "gpucheck_probe-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("gpucheck_probe/__init__.py", "VALUE = 7\n")
        wheel.writestr("gpucheck_probe-1.0.data/purelib/gpucheck_probe_data.py", "VALUE = 7\n")
        wheel.writestr(
            "gpucheck_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 1.0\n"
        )
        wheel.writestr(
            "gpucheck_probe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr("gpucheck_probe-1.0.dist-info/RECORD", "")


def test_quick_check_runs_on_cpu_and_skips_the_cuda_steps(tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    write_wheel(wheels)
    (wheels / "MANIFEST.tsv").write_text(
        "status\tgroup\tbytes\tneeded by\nkept\tprobe\t1\tthis test\nleft-out\tbig\t99\tnothing\n"
    )
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE_TESTS)
    env = {
        **os.environ,
        "GPU_CHECK_PYTHON": sys.executable,
        "GPU_WHEELS": str(wheels),
        "OUT": str(out),
        "GPU_CHECK_PYTEST_ARGS": str(probe),
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", "bench/gpu-check.sh", "--quick"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "no CUDA device: the CUDA-only steps (bench, served) are skipped" in done.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "quick" and summary["environment"]["cuda_available"] is False
    # A CPU run is never a pass, whatever its steps did: nothing GPU-specific was verified.
    assert summary["status"] == "no-cuda" and "tritonserver none): no-cuda: cuda no-cuda | install" in done.stdout
    steps = {step["step"]: step for step in summary["steps"]}
    assert list(steps) == ["cuda", "install", "unit", "bench", "served"]
    assert steps["cuda"]["status"] == "no-cuda"
    assert steps["cuda"]["detail"] == "no CUDA device: nothing GPU-specific was verified"
    assert steps["install"]["status"] == "passed"
    assert (
        steps["install"]["detail"].startswith("1 wheels")
        and "left out of the budget: big" in steps["install"]["detail"]
    )
    assert steps["unit"]["status"] == "passed"
    assert steps["unit"]["detail"].startswith("on cpu: 1 passed, 0 failed, 1 skipped")
    assert "skipped for want of not_a_real_package (1)" in steps["unit"]["detail"]
    assert steps["bench"]["status"] == "skipped" and steps["bench"]["detail"].startswith("CUDA-only")
    assert steps["served"]["status"] == "skipped"
    assert (out / "unit.xml").is_file() and (out / "environment.json").is_file()

    # The line it stands for: docker/Dockerfile's line with this Python (none for a Python no line
    # has), its pins beside this machine's versions; no tritonserver ran.
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    expected = subprocess.run(
        [sys.executable, "docker/image_lines.py", "--python", python], cwd=REPO_ROOT, capture_output=True, text=True
    )
    expected = json.loads(expected.stdout)
    line = summary["line"]
    assert line["image"] == expected and line["name"] == (expected["name"] if expected else None)
    assert line["here"]["python"].startswith(python + ".") and line["here"]["numpy"]
    assert line["tritonserver"] is None
    assert f"summary (line {line['name'] or 'none'}, tritonserver none)" in done.stdout
    if expected is None:
        assert f"line none: no docker/Dockerfile line has Python {python}" in done.stdout
    else:
        assert f"line {expected['name']}: Python {python}" in done.stdout
