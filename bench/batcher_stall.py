"""Triton's dynamic batcher stalls a request ~500 ms when its queue policy turns prefetching off.

    python -m bench.batcher_stall [--calls 2000] [--execute-ms 4] [VARIANT ...]

A minimal reproduction with no code of ours in the server: a Python model whose `execute` only
busy-waits `--execute-ms` (about one B=1 sampler call) and echoes its input, served under five
scheduling variants, each called `--calls` times sequentially and from 8 threads over gRPC (B=1).
It prints the latency p50 / p99 / max and the calls over 200 ms and over 450 ms per variant
(docs/batcher-stall.md explains the cause and carries the upstream report).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from testbed.server import TritonServer

MODEL = """
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.seconds = float(parameters["execute_ms"]["string_value"]) / 1000

    def execute(self, requests):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:  # busy, like a sampler call
            pass
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests
        ]
"""
CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 256
input [ {{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "Y", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {count} }} ]
parameters [ {{ key: "execute_ms", value: {{ string_value: "{execute_ms}" }} }} ]
{scheduling}
"""
POLICY = "default_queue_policy { max_queue_size: 32, timeout_action: REJECT, default_timeout_microseconds: 2000000 }"
BATCHING = "dynamic_batching {{ max_queue_delay_microseconds: 0, preferred_batch_size: [ 64 ] {policy} }}"
# name -> (instances, scheduling block)
VARIANTS = {
    "policy": (1, BATCHING.format(policy=POLICY)),
    "no_policy": (1, BATCHING.format(policy="")),
    "policy_two_instances": (2, BATCHING.format(policy=POLICY)),
    "no_dynamic_batching": (1, ""),
    "timeout_action_only": (1, BATCHING.format(policy="default_queue_policy { timeout_action: REJECT }")),
}
THREADS = (1, 8)


def write_repository(root: Path, variants: list[str], execute_ms: float) -> None:
    """One model directory per variant, the same model.py in each."""
    for name in variants:
        count, scheduling = VARIANTS[name]
        (root / name / "1").mkdir(parents=True)
        config = CONFIG.format(name=name, count=count, execute_ms=execute_ms, scheduling=scheduling)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(MODEL)


def latencies_ms(url: str, model: str, calls: int, threads: int) -> np.ndarray:
    """`calls` B=1 inferences split over `threads` closed-loop clients; each call's latency."""
    found: list[float] = []
    lock = threading.Lock()

    def client(count: int) -> None:
        connection = grpcclient.InferenceServerClient(url)
        tensor = grpcclient.InferInput("X", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.ones((1, 1), np.int32))
        mine = []
        for _ in range(count):
            start = time.perf_counter()
            connection.infer(model, [tensor])
            mine.append(time.perf_counter() - start)
        connection.close()
        with lock:
            found.extend(mine)

    workers = [threading.Thread(target=client, args=(calls // threads,)) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return np.array(found) * 1000


def summary(name: str, threads: int, ms: np.ndarray) -> str:
    p50, p99 = np.percentile(ms, [50, 99])
    return (
        f"| {name} | {threads} | {ms.size} | {p50:.2f} | {p99:.2f} | {ms.max():.1f} | "
        f"{int((ms > 200).sum())} | {int((ms > 450).sum())} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant and thread count")
    parser.add_argument("--execute-ms", type=float, default=4.0, help="busy time of one execute")
    parser.add_argument("variants", nargs="*", help=f"some of {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args(argv)
    variants = args.variants or list(VARIANTS)
    unknown = set(variants) - VARIANTS.keys()
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    with tempfile.TemporaryDirectory() as root:
        write_repository(Path(root), variants, args.execute_ms)
        with TritonServer(Path(root)) as server:
            print("| variant | threads | calls | p50 ms | p99 ms | max ms | > 200 ms | > 450 ms |")
            print("|---|---|---|---|---|---|---|---|")
            for name in variants:
                for threads in THREADS:
                    print(summary(name, threads, latencies_ms(server.grpc_url, name, args.calls, threads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
