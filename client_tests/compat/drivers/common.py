"""Shared by the drivers (run with the compat venv's python): argument parsing and the JSON answer."""

from __future__ import annotations

import json
import sys
import traceback
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_TOKENIZER = REPO_ROOT / "plugin" / "generation" / "lm_configs" / "tiny_tokenizer"


def arguments() -> dict:
    return json.loads(sys.argv[1])


def answer(result: dict) -> None:
    print(json.dumps(result, default=repr))


def run(main) -> None:
    """main(arguments) -> dict, printed; an exception the client raised is printed as {"error"}:
    the test shows it as the server's gap."""
    try:
        result = main(arguments())
    except Exception as error:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    answer(result)


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]
