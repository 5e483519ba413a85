"""Readiness that means "a real inference works": one tiny inference per model, standard library only.
Why by hand (urllib, not tritonclient): tritonclient is an optional extra, and the probe must run
wherever the package is installed (an exec probe in any image).

    python -m triton_sampling_mask.ops.probe [--url localhost:8000] [--model sampler ...] [--timeout 5]

Exit status 0 when every named model answered correctly, 1 otherwise (one line per model), so a
Kubernetes `exec` probe or a container HEALTHCHECK can run it. `/v2/health/ready` is not enough:
Triton keeps answering 200 there while a model's Python stub is dead and every inference fails.

What each model gets is chosen from its config: a sampler (input `logits`, nothing else
required) samples one greedy row of 8 logits and must return their argmax; a decoupled
generator (inputs `input_ids` and `max_new_tokens`) generates one token through
`/v2/models/<m>/generate`; any other model is only asked `/v2/models/<m>/ready`. The supervisor's
watchdog (`ops.supervisor`) runs the same probes every few seconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..sampling.inputs import IGNORE_EOS, INPUT_IDS, INPUTS_BY_NAME, LOGITS_INPUT, MAX_NEW_TOKENS
from ..sampling.params import TEMPERATURE

DEFAULT_URL = "localhost:8000"
DEFAULT_MODELS = ("sampler",)
DEFAULT_TIMEOUT_S = 5.0
# Greedy over these logits must pick id 7: a wrong id means the model answers but computes wrong.
PROBE_LOGITS = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 8.0]
PROBE_PROMPT = [1, 2, 3]
# The Python backend's answer (r24.10 and r26.x alike) for every request to a model whose stub died.
UNHEALTHY_STUB = "is not healthy"
# Since Triton 2.64 GET /v2/models/<m>/ready also answers 400 once a loaded model's stub died (2.51
# keeps answering 200). The watchdog probes only models the index lists as READY, so for a model
# probed by readiness alone that 400 means the same: reload it.
NOT_READY_STATUS = 400


@dataclass
class ProbeResult:
    """The outcome of one probe. `unhealthy`: the model's stub is dead (reload the model);
    `timed_out`: no answer within the timeout; `unreachable`: the server itself did not answer;
    `shed`: a full queue refused the probe with 503 (alive but saturated: counts as ok)."""

    model: str
    kind: str  # "sampler", "generate" or "ready"
    ok: bool
    detail: str
    seconds: float
    unhealthy: bool = False
    timed_out: bool = False
    unreachable: bool = False
    shed: bool = False

    def line(self) -> str:
        """One line for a person: the model, ok or FAILED, the probe kind, its time and detail."""
        state = "ok" if self.ok else "FAILED"
        return f"{self.model}: {state} ({self.kind} probe, {self.seconds * 1000:.0f} ms): {self.detail}"


def base_url(url: str) -> str:
    """'localhost:8000' or 'http://localhost:8000/' -> 'http://localhost:8000'."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def http_request(
    method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[int, bytes]:
    """(status, body) of one request on a fresh connection (never kept alive: an idle kept-alive
    connection holds tritonserver's shutdown). Raises TimeoutError or ConnectionError."""
    request = urllib.request.Request(url, data=body, method=method, headers={"Connection": "close", **(headers or {})})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()
    except urllib.error.URLError as error:
        if isinstance(error.reason, (TimeoutError, socket.timeout)):
            raise TimeoutError(str(error.reason)) from None
        raise ConnectionError(str(error.reason)) from None
    except TimeoutError as error:
        raise TimeoutError(str(error)) from None
    except OSError as error:  # reset, refused mid-request, ...
        raise ConnectionError(str(error)) from None


def probe_kind(config: dict) -> str:
    """ "sampler", "generate" or "ready": the real inference a model's config allows."""
    inputs = {spec["name"]: spec for spec in config.get("input", [])}
    required = {name for name, spec in inputs.items() if not spec.get("optional", False)}
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    if not decoupled and LOGITS_INPUT.name in inputs and required <= {LOGITS_INPUT.name}:
        return "sampler"
    needed = {INPUT_IDS.name, MAX_NEW_TOKENS.name}
    if decoupled and needed <= inputs.keys() and required <= needed:
        return "generate"
    return "ready"


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body[:200]))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def _greedy(config: dict) -> bool:
    return any(spec["name"] == TEMPERATURE.name for spec in config.get("input", []))


def _sampler_request(config: dict) -> bytes:
    batched = int(config.get("max_batch_size", 0)) > 0
    shape = [1, len(PROBE_LOGITS)] if batched else [len(PROBE_LOGITS)]
    tensors = [{"name": LOGITS_INPUT.name, "shape": shape, "datatype": LOGITS_INPUT.datatype, "data": PROBE_LOGITS}]
    if _greedy(config):
        greedy = INPUTS_BY_NAME[TEMPERATURE.name]
        tensors.append(
            {"name": greedy.name, "shape": [1, 1] if batched else [1], "datatype": greedy.datatype, "data": [0.0]}
        )
    return json.dumps({"inputs": tensors, "outputs": [{"name": "output_ids"}]}).encode()


def _check_sampler(body: bytes, greedy: bool) -> str | None:
    """None when the answer is right, else what is wrong with it."""
    outputs = {out["name"]: out for out in json.loads(body).get("outputs", [])}
    ids = outputs.get("output_ids", {}).get("data")
    if not ids or len(ids) != 1:
        return f"expected one output id, got {ids!r}"
    expected = max(range(len(PROBE_LOGITS)), key=PROBE_LOGITS.__getitem__)
    if greedy and ids[0] != expected:
        return f"greedy probe sampled id {ids[0]}, expected {expected}"
    if not 0 <= ids[0] < len(PROBE_LOGITS):
        return f"sampled id {ids[0]} is outside the probe's vocabulary"
    return None


def _generate_request(config: dict) -> bytes:
    inputs = {spec["name"] for spec in config.get("input", [])}
    body: dict = {INPUT_IDS.name: PROBE_PROMPT, MAX_NEW_TOKENS.name: 1}
    for name, value in ((IGNORE_EOS.name, True), (TEMPERATURE.name, 0.0)):
        if name in inputs:
            body[name] = value
    return json.dumps(body).encode()


def _check_generate(body: bytes) -> str | None:
    ids = json.loads(body).get("output_ids")
    ids = [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list) or len(ids) != 1:
        return f"expected one generated token, got {ids!r}"
    return None


def probe_model(url: str, model: str, timeout_s: float = DEFAULT_TIMEOUT_S, config: dict | None = None) -> ProbeResult:
    """One real inference against `model` on the HTTP endpoint `url` (its config is fetched when
    not given), classified so a watchdog knows whether to reload the model."""
    root = base_url(url)
    started = time.monotonic()
    kind = "ready"

    def result(ok: bool, detail: str, **flags) -> ProbeResult:
        return ProbeResult(model, kind, ok, detail, time.monotonic() - started, **flags)

    try:
        if config is None:
            status, body = http_request("GET", f"{root}/v2/models/{model}/config", timeout_s=timeout_s)
            if status != 200:
                return result(False, f"config: HTTP {status}: {_error_text(body)}")
            config = json.loads(body)
        kind = probe_kind(config)
        if kind == "sampler":
            status, body = http_request(
                "POST", f"{root}/v2/models/{model}/infer", _sampler_request(config), timeout_s=timeout_s
            )
        elif kind == "generate":
            status, body = http_request(
                "POST", f"{root}/v2/models/{model}/generate", _generate_request(config), timeout_s=timeout_s
            )
        else:
            status, body = http_request("GET", f"{root}/v2/models/{model}/ready", timeout_s=timeout_s)
    except TimeoutError:
        return result(False, f"no answer within {timeout_s:g} s", timed_out=True)
    except ConnectionError as error:
        return result(False, f"server unreachable: {error}", unreachable=True)
    if status == 503:  # a full queue shed it (the front proxy's): the model runs, the server is saturated
        return result(True, f"shed by a full queue: {_error_text(body)}", shed=True)
    if status != 200:
        message = _error_text(body) if body else f"HTTP {status}"
        stub_dead = UNHEALTHY_STUB in message or (kind == "ready" and status == NOT_READY_STATUS)
        return result(False, f"HTTP {status}: {message}", unhealthy=stub_dead)
    if kind == "ready":
        return result(True, "model ready (no inference: its inputs are not a sampler's or a generator's)")
    try:
        problem = _check_sampler(body, _greedy(config)) if kind == "sampler" else _check_generate(body)
    except (ValueError, AttributeError, TypeError) as error:
        problem = f"unreadable answer: {error}"
    return result(problem is None, problem or "answered correctly")


def main(argv: list[str] | None = None) -> int:
    """Probe each model once; exit 0 when all answered correctly."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=DEFAULT_URL, help="tritonserver's HTTP endpoint (default %(default)s)")
    parser.add_argument("--model", action="append", help="model to probe (repeatable; default: sampler)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request (default %(default)s)"
    )
    args = parser.parse_args(argv)
    results = [probe_model(args.url, model, args.timeout) for model in (args.model or DEFAULT_MODELS)]
    for probe in results:
        print(probe.line(), flush=True)
    return 0 if all(probe.ok for probe in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
