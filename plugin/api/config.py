"""The API process's settings: its command line, and the secret it reads from the environment.

Every setting has a flag; the API key is read from `TRITON_API_KEY` or a file
(`--api-key-file`), never from the command line, where other local users could read it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from .weight_access import Network, parse_networks

API_KEY_ENV = "TRITON_API_KEY"
# Names of ops.settings' variables (the API cannot import ops; tests/test_settings.py checks them).
ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"
TRUSTED_NETWORKS_ENV = "TRITON_API_TRUSTED_NETWORKS"
FORWARDED_ALLOW_IPS_ENV = "TRITON_API_FORWARDED_ALLOW_IPS"
DEFAULT_FORWARDED_ALLOW_IPS = "127.0.0.1"  # the front door, on loopback
DEFAULT_PORT = 9000  # Triton's own OpenAI frontend listens here too
DEFAULT_SERVED_MODEL = "generate"


@dataclass(frozen=True)
class ApiConfig:
    """What the API serves and its limits (see `parse_args` for each)."""

    triton_url: str
    model_path: str = ""
    triton_model: str = "generate"
    served_model_name: str = DEFAULT_SERVED_MODEL
    api_key: str | None = None
    max_choices: int = 256
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256
    max_body_bytes: int = 32 * 2**20
    busy_timeout_s: float = 5.0
    retry_after_s: int = 1
    max_model_len: int | None = None  # None: the checkpoint's own context length
    max_prompt_chars: int | None = None  # None: what the context can hold (input_bounds)
    client_timeout_s: float = 60.0  # client silence mid-body (the front door's PROXY_CLIENT_TIMEOUT_S)
    tokenizer_threads: int = 2
    trust_request_chat_template: bool = False
    admin_key: str | None = None  # sent for keyless weight calls from trusted_networks
    trusted_networks: tuple[Network, ...] = ()
    readiness_url: str | None = None  # the supervisor's /ready: /health answers 503 while it does
    metrics_url: str | None = None  # tritonserver's /metrics: the engine's load for /v1/loads


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m triton_sampling_mask.api`."""
    parser = argparse.ArgumentParser(
        prog="python -m triton_sampling_mask.api",
        description="OpenAI- and SGLang-compatible HTTP API over the generate model (docs/api.md).",
    )
    parser.add_argument("--triton-url", required=True, help="tritonserver's gRPC address, host:port (loopback)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument(
        "--model-path",
        default="",
        help="the checkpoint directory the generate model serves (its tokenizer and chat template); "
        "empty: the built-in tiny LM's",
    )
    parser.add_argument("--triton-model", default="generate", help="the Triton model to call (default generate)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the checkpoint directory's name, or 'generate')",
    )
    parser.add_argument(
        "--api-key-file", type=Path, default=None, help=f"a file holding the API key (else ${API_KEY_ENV}; none: open)"
    )
    parser.add_argument("--max-choices", type=_positive_int, default=256, help="sequences one request may ask for")
    parser.add_argument("--max-stop-strings", type=_positive_int, default=64, help="stop strings one request may carry")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=32 * 2**20, help="largest request body")
    parser.add_argument(
        "--busy-timeout-s",
        type=_non_negative_float,
        default=5.0,
        help="how long a request the model refuses as busy is retried before the API answers 503",
    )
    parser.add_argument("--max-model-len", type=_positive_int, default=None, help="context length (default: the LM's)")
    parser.add_argument(
        "--max-prompt-chars",
        type=_positive_int,
        default=None,
        help="longest prompt text (and chat content) in characters, refused before tokenizing (default: what the "
        "context can hold at the vocabulary's longest token, twice over)",
    )
    parser.add_argument(
        "--client-timeout-s",
        type=_positive_float,
        default=60.0,
        help="seconds a client may stay silent while sending a body (408 beyond)",
    )
    parser.add_argument(
        "--tokenizer-threads",
        type=_positive_int,
        default=2,
        help="threads that parse bodies, tokenize prompts and render chat templates, off the event loop",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat template a request brings (chat_template_kwargs.chat_template); refused by default",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help=f"a file holding the server's admin key (else ${ADMIN_KEY_ENV}), used only for keyless weight calls "
        f"from ${TRUSTED_NETWORKS_ENV}",
    )
    parser.add_argument(
        "--trusted-networks",
        default=None,
        help=f"CIDRs whose weight calls need no admin key (default ${TRUSTED_NETWORKS_ENV}; none)",
    )
    parser.add_argument(
        "--forwarded-allow-ips",
        default=None,
        help="proxies whose X-Forwarded-For names the client (default "
        f"${FORWARDED_ALLOW_IPS_ENV}, else {DEFAULT_FORWARDED_ALLOW_IPS}: the front door)",
    )
    parser.add_argument(
        "--readiness-url",
        default=None,
        help="the server's readiness probe (the supervisor's http://127.0.0.1:PORT/ready): GET /health answers "
        "503 while it does not answer 200 (default: none, the model's own readiness only)",
    )
    parser.add_argument(
        "--metrics-url",
        default=None,
        help="tritonserver's metrics (http://127.0.0.1:PORT/metrics): GET /v1/loads reports the generate "
        "model's queue and KV cache from it (default: none, no /v1/loads)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def read_api_key(path: Path | None) -> str | None:
    """The API key from `path`, else from $TRITON_API_KEY; None when neither is set (no key)."""
    if path is not None:
        try:
            key = path.read_text().strip()
        except OSError as error:
            raise ValueError(f"--api-key-file {path}: {error.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {path} is empty")
        return key
    return os.environ.get(API_KEY_ENV, "").strip() or None


def read_admin_key(path: Path | None) -> str | None:
    """The admin key from `path`, else from $TRITON_ADMIN_KEY; None when neither is set."""
    if path is not None:
        try:
            return path.read_text().strip() or None
        except OSError as error:
            raise ValueError(f"--admin-key-file {path}: {error.strerror}") from None
    return os.environ.get(ADMIN_KEY_ENV, "").strip() or None


def forwarded_allow_ips(args: argparse.Namespace) -> str:
    """Whose X-Forwarded-For uvicorn believes (its `forwarded_allow_ips`)."""
    given = args.forwarded_allow_ips
    if given is None:
        given = os.environ.get(FORWARDED_ALLOW_IPS_ENV, "").strip() or DEFAULT_FORWARDED_ALLOW_IPS
    return given


def config_from_args(args: argparse.Namespace) -> ApiConfig:
    """The ApiConfig of parsed arguments (raises ValueError for a bad key file or network, or for
    trusted networks without an admin key to send for them)."""
    name = args.served_model_name or (Path(args.model_path).name if args.model_path else DEFAULT_SERVED_MODEL)
    text = args.trusted_networks if args.trusted_networks is not None else os.environ.get(TRUSTED_NETWORKS_ENV, "")
    try:
        networks = parse_networks(text)
    except ValueError as error:
        raise ValueError(f"--trusted-networks / ${TRUSTED_NETWORKS_ENV}: {error}") from None
    admin_key = read_admin_key(args.admin_key_file) if networks else None
    if networks and not admin_key:
        raise ValueError(
            f"${TRUSTED_NETWORKS_ENV} needs the admin key to send for those networks: --admin-key-file or ${ADMIN_KEY_ENV}"
        )
    return ApiConfig(
        triton_url=args.triton_url,
        model_path=args.model_path,
        triton_model=args.triton_model,
        served_model_name=name,
        api_key=read_api_key(args.api_key_file),
        max_choices=args.max_choices,
        max_stop_strings=args.max_stop_strings,
        max_body_bytes=args.max_body_bytes,
        busy_timeout_s=args.busy_timeout_s,
        max_model_len=args.max_model_len,
        max_prompt_chars=args.max_prompt_chars,
        client_timeout_s=args.client_timeout_s,
        tokenizer_threads=args.tokenizer_threads,
        trust_request_chat_template=args.trust_request_chat_template,
        admin_key=admin_key,
        trusted_networks=networks,
        readiness_url=_local_url(args.readiness_url, "--readiness-url"),
        metrics_url=_local_url(args.metrics_url, "--metrics-url"),
    )


def _local_url(url: str | None, flag: str) -> str | None:
    """An http:// URL the API reads its own server's state from (None stays None)."""
    if url is None:
        return None
    if not url.startswith("http://") or len(url) <= len("http://"):
        raise ValueError(f"{flag} must be an http:// URL, got {url!r}")
    return url
