"""One HTTP request to the stack on loopback, its `Answer`, and the curl line that repeats it
against `make serve` on its default port."""

from __future__ import annotations

import http.client
import shlex

from .checks import Answer

# Where reproducers point: `make serve`'s default HTTP port.
REPRODUCER_BASE = "http://localhost:8000"
# What reproducers show instead of the run's admin key.
KEY_PLACEHOLDER = "$TRITON_ADMIN_KEY"


def send(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> Answer:
    """`method path` with `body` to 127.0.0.1:`port` over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return Answer(response.status, {name.lower(): value for name, value in response.getheaders()}, response.read())
    except (OSError, http.client.HTTPException) as error:
        return Answer(None, error=f"{type(error).__name__}: {error}")
    finally:
        conn.close()


def _shell_bytes(data: bytes) -> str:
    """`data` as one shell word: quoted text, or $'...' with \\xNN escapes where it is not printable."""
    text = data.decode("utf-8", errors="replace")
    if text.encode() == data and text.isprintable():
        return shlex.quote(text)
    return "$'" + "".join(chr(b) if 32 <= b < 127 and chr(b) not in "\\'" else f"\\x{b:02x}" for b in data) + "'"


def curl_line(
    method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, admin_key: str = ""
) -> str:
    """A curl command repeating the request against REPRODUCER_BASE, the admin key shown as
    KEY_PLACEHOLDER."""
    words = ["curl", "-sS", "-i", "--path-as-is", "-X", method]
    for name, value in (headers or {}).items():
        if admin_key and value == admin_key:
            words += ["-H", f'"{name}: {KEY_PLACEHOLDER}"']
        else:
            words += ["-H", shlex.quote(f"{name}: {value}")]
    if body is not None:
        words += ["--data-binary", _shell_bytes(body)]
    words.append(shlex.quote(REPRODUCER_BASE + path))
    return " ".join(words)
