"""The image lines of docker/Dockerfile, read from the Dockerfile itself (the one place they live).

A line is a stage `FROM <base image> AS line-<name>` whose ENV sets SAMPLER_LINE, SAMPLER_TRITON,
SAMPLER_PYTHON, SAMPLER_PLATFORM and the pins SAMPLER_TORCH, SAMPLER_TRANSFORMERS, SAMPLER_NUMPY;
`ARG LINE=<name>` picks the default. tests/test_container_image.py, bench/fetch-gpu-wheels.sh and
bench/gpu-check.sh read them here. Standard library only: the GPU check runs it on a bare python3.

    python3 docker/image_lines.py                       # every line, as JSON
    python3 docker/image_lines.py --default             # the name of the line built by default
    python3 docker/image_lines.py --line current --get python
    python3 docker/image_lines.py --python 3.12         # the line whose Python is 3.12 (JSON, or null)
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parent / "Dockerfile"
STAGE_PREFIX = "line-"
# ENV name -> field of ImageLine.
FIELDS = {
    "SAMPLER_LINE": "name",
    "SAMPLER_TRITON": "triton",
    "SAMPLER_PYTHON": "python",
    "SAMPLER_PLATFORM": "platform",
    "SAMPLER_TORCH": "torch",
    "SAMPLER_TRANSFORMERS": "transformers",
    "SAMPLER_NUMPY": "numpy",
}


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword, its arguments (continuation lines joined) and the
    body of a here-document (`RUN python3 - <<'EOF'`), if any."""

    keyword: str
    arguments: str
    heredoc: str = ""


@dataclass(frozen=True)
class ImageLine:
    """One image line: its base image and what docker/Dockerfile declares for it."""

    name: str
    base: str
    triton: str
    python: str
    platform: str
    torch: str
    transformers: str
    numpy: str
    env: dict[str, str]  # the stage's ENV, SAMPLER_* names as written

    def as_dict(self) -> dict:
        """The line as plain JSON-able data."""
        return {key: getattr(self, key) for key in ("name", "base", *list(FIELDS.values())[1:])}


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions in order, comments and blank lines dropped."""
    found, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        line = lines[index].strip()
        index += 1
        if not line or line.startswith("#"):
            continue
        parts = [line]
        while parts[-1].endswith("\\") and index < len(lines):
            parts[-1] = parts[-1][:-1]
            nxt = lines[index].strip()
            index += 1
            if nxt and not nxt.startswith("#"):
                parts.append(nxt)
        keyword, _, arguments = " ".join(parts).partition(" ")
        heredoc = ""
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", arguments)
        if marker:
            body = []
            while index < len(lines) and lines[index].strip() != marker.group(1):
                body.append(lines[index])
                index += 1
            index += 1  # the terminator
            heredoc = "\n".join(body) + "\n"
        found.append(Instruction(keyword.upper(), arguments.strip(), heredoc))
    return found


def env_pairs(arguments: str) -> dict[str, str]:
    """`ENV A=1 B="two words"` -> {"A": "1", "B": "two words"}."""
    return dict(word.split("=", 1) for word in shlex.split(arguments))


def parse(text: str) -> tuple[str, dict[str, ImageLine]]:
    """(the default line's name, every line by name) from a Dockerfile's text."""
    default = None
    stages: dict[str, tuple[str, dict[str, str]]] = {}
    stage = None
    for instruction in instructions(text):
        if instruction.keyword == "ARG" and stage is None:
            name, _, value = instruction.arguments.partition("=")
            if name == "LINE":
                default = value
        elif instruction.keyword == "FROM":
            words = instruction.arguments.split()
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stage = alias[len(STAGE_PREFIX) :] if alias.startswith(STAGE_PREFIX) else ""
            if stage:
                stages[stage] = (words[0], {})
        elif instruction.keyword == "ENV" and stage:
            stages[stage][1].update(env_pairs(instruction.arguments))
    lines = {}
    for stage, (base, env) in stages.items():
        missing = sorted(set(FIELDS) - env.keys())
        if missing:
            raise ValueError(f"docker/Dockerfile: stage line-{stage} sets no {', '.join(missing)}")
        values = {field: env[key] for key, field in FIELDS.items()}
        if values["name"] != stage:
            raise ValueError(f"docker/Dockerfile: stage line-{stage} says SAMPLER_LINE={values['name']}")
        lines[stage] = ImageLine(base=base, env=env, **values)
    if default not in lines:
        raise ValueError(f"docker/Dockerfile: ARG LINE={default} names no line-<name> stage ({sorted(lines)})")
    return default, lines


def read(path: Path = DOCKERFILE) -> tuple[str, dict[str, ImageLine]]:
    """(the default line's name, every line by name) of docker/Dockerfile."""
    return parse(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dockerfile", type=Path, default=DOCKERFILE)
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--default", action="store_true", help="print the default line's name")
    choice.add_argument("--line", help="only this line")
    choice.add_argument("--python", help="only the line whose Python is this major.minor (null if none)")
    parser.add_argument("--get", help="print one field of the chosen line (name, base, triton, python, ...)")
    args = parser.parse_args(argv)
    default, lines = read(args.dockerfile)
    if args.default:
        print(default)
        return 0
    if args.line is not None or args.python is not None:
        matches = [
            line for line in lines.values() if args.line in (None, line.name) and args.python in (None, line.python)
        ]
        if args.line is not None and not matches:
            parser.error(f"no line {args.line!r} in {args.dockerfile} (there are {', '.join(lines)})")
        chosen = matches[0].as_dict() if matches else None
        if args.get:
            if chosen is None:
                return 1
            print(chosen[args.get])
        else:
            print(json.dumps(chosen))
        return 0
    print(json.dumps({"default": default, "lines": {name: line.as_dict() for name, line in lines.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
