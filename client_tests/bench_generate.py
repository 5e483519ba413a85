"""Tokens per second of the `generate` model (default tiny Llama) on a real tritonserver.

    .venv/bin/python -m client_tests.bench_generate [--tokens 256] [--concurrency 8]

Starts a server with only the `generate` model on free ports, warms it up, then times one request
and `concurrency` requests sent back to back (batched together by the dynamic batcher), each
streaming and not, with sampling masks on (top_k 20). Prints wall-clock tokens/second.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from triton_sampling_mask.ops.launcher import TritonServer

from .generate_client import GenerateStream
from .server import MODEL_REPOSITORY

PARAMS = dict(temperature=1.0, top_k=20, top_p=0.95, return_sampling_mask=True, ignore_eos=True)


def timed_run(url: str, requests: int, tokens: int, stream: bool) -> tuple[int, float]:
    """(tokens received, seconds) for `requests` concurrent requests of `tokens` new tokens."""
    with GenerateStream(url) as client:
        start = time.perf_counter()
        for i in range(requests):
            client.send([5 + i, 6, 7], tokens, request_id=str(i), stream=stream, seed=i, **PARAMS)
        received = finished = 0
        while finished < requests:
            _, outputs, final, error = client.next()
            if error is not None:
                raise error
            received += 0 if outputs is None else len(outputs["output_ids"])
            finished += final
        return received, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    repository = Path(tempfile.mkdtemp()) / "model_repository"
    shutil.copytree(MODEL_REPOSITORY / "generate", repository / "generate", ignore=shutil.ignore_patterns("__pycache__"))
    started = time.perf_counter()
    with TritonServer(repository) as server:
        print(f"server ready in {time.perf_counter() - started:.1f}s (generate model only)")
        timed_run(server.grpc_url, 1, 16, stream=False)  # warm-up
        for requests in (1, args.concurrency):
            for stream in (False, True):
                tokens, seconds = timed_run(server.grpc_url, requests, args.tokens, stream)
                print(
                    f"{requests} request(s) x {args.tokens} tokens, {'streaming' if stream else 'non-streaming'}: "
                    f"{tokens / seconds:8.1f} tokens/s ({tokens} tokens in {seconds:.2f}s)"
                )
    shutil.rmtree(repository.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
