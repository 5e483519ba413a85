"""What the front door costs a served call: the same calls straight to tritonserver and through
HAProxy (the proxy of `make serve`, with its settings), timed in interleaved rounds.

- the one-call table's headline, B=64 x V=151936 FP32 over gRPC (every output, masks on): the
  proxy may add at most 10% (target "proxy_call", the paired median of per-round ratios);
- the same call with the logits in system shared memory, registered through the proxy with the
  admin key (the tensor bytes never pass the proxy);
- one B=1 step (V=151936) over gRPC and over HTTP: the proxy may add at most 0.5 ms to the p50
  (target "proxy_step", gRPC).

`python -m bench.proxy_cost [--tiny]` runs it alone; `make bench` runs it beside the served tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from testbed.fronted import FrontedTritonServer
from triton_sampling_mask.client import unregister_shared_memory
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.sampling.admin import GRPC_ADMIN_HEADER

from . import perf_analyzer as pa_module
from . import report
from .common import interleaved_medians, paired_median_ratio
from .served_call import CALL_PARAMS, call_params, explicit_models

FULL = {"call": (64, 151936), "step": (1, 151936)}
TINY = {"call": (4, 2000), "step": (1, 2000)}
TIMING = {"full": {"min_rounds": 15, "budget_s": 20.0}, "tiny": {"min_rounds": 2, "budget_s": 0.0}}
ADMIN_KEY = "proxy-cost-admin-key-0123456789abcdef"
TARGETS = {
    "proxy_call": "B=64 x V=151936 one call over gRPC through the proxy <= 1.10x straight to tritonserver (p50)",
    "proxy_step": "B=1 step over gRPC through the proxy adds <= 0.5 ms to the p50",
}


class Caller:
    """One client on one URL calling the bench sampler with fixed inputs (optionally the logits in
    system shared memory, registered with `headers`)."""

    def __init__(self, protocol: str, url: str, logits: np.ndarray, shared: bool = False, headers: dict | None = None):
        module = grpcclient if protocol == "grpc" else httpclient
        self.client = module.InferenceServerClient(url)
        self.model = pa_module.BENCH_MODELS["FP32"]
        self.inputs = sampler_inputs(module, logits, **call_params(logits.shape[0]))
        self.region = self.handle = None
        self.headers = headers
        if shared:
            self.region = f"proxy_cost_{os.getpid()}_{protocol}_{abs(hash(url)) % 10**6}"
            self.handle = shm.create_shared_memory_region(self.region, "/" + self.region, logits.nbytes)
            shm.set_shared_memory_region(self.handle, [np.ascontiguousarray(logits)])
            self.client.register_system_shared_memory(self.region, "/" + self.region, logits.nbytes, headers=headers)
            self.inputs[0].set_shared_memory(self.region, logits.nbytes)

    def __call__(self) -> None:
        self.client.infer(self.model, self.inputs)

    def close(self) -> None:
        try:
            if self.region is not None:
                unregister_shared_memory(self.client, self.region, headers=self.headers)
        finally:
            if self.handle is not None:
                shm.destroy_shared_memory_region(self.handle)
            self.client.close()


def measure(server: FrontedTritonServer, tiny: bool, progress=print) -> dict:
    """Every point, direct and proxied, in interleaved rounds; p50s, ratios and deltas."""
    shapes = TINY if tiny else FULL
    rng = np.random.default_rng(0)
    call_logits = (rng.standard_normal(shapes["call"]) * 3).astype(np.float32)
    step_logits = (rng.standard_normal(shapes["step"]) * 3).astype(np.float32)
    direct, proxied = server.server, server
    internal = {GRPC_ADMIN_HEADER: server.front_door.internal_key}
    public = {GRPC_ADMIN_HEADER: ADMIN_KEY}
    callers = {
        "call_grpc_direct": Caller("grpc", direct.grpc_url, call_logits),
        "call_grpc_proxy": Caller("grpc", proxied.grpc_url, call_logits),
        "call_grpc_shm_direct": Caller("grpc", direct.grpc_url, call_logits, shared=True, headers=internal),
        "call_grpc_shm_proxy": Caller("grpc", proxied.grpc_url, call_logits, shared=True, headers=public),
        "step_grpc_direct": Caller("grpc", direct.grpc_url, step_logits),
        "step_grpc_proxy": Caller("grpc", proxied.grpc_url, step_logits),
        "step_http_direct": Caller("http", direct.http_url, step_logits),
        "step_http_proxy": Caller("http", proxied.http_url, step_logits),
    }
    try:
        timed = interleaved_medians(callers, torch.device("cpu"), **TIMING["tiny" if tiny else "full"])
    finally:
        for caller in callers.values():
            caller.close()
    points = {}
    for name in ("call_grpc", "call_grpc_shm", "step_grpc", "step_http"):
        d, p = timed[f"{name}_direct"], timed[f"{name}_proxy"]
        points[name] = {
            "direct_p50_ms": d["median_ms"],
            "proxy_p50_ms": p["median_ms"],
            "ratio": p["median_ms"] / d["median_ms"],
            "paired_ratio": paired_median_ratio(p["samples_ms"], d["samples_ms"]),
            "delta_ms": p["median_ms"] - d["median_ms"],
            "paired_delta_ms": statistics.median(a - b for a, b in zip(p["samples_ms"], d["samples_ms"])),
            "rounds": d["rounds"],
        }
        progress(
            f"  proxy cost {name}: direct {d['median_ms']:.2f} ms, through the proxy {p['median_ms']:.2f} ms "
            f"(x{points[name]['paired_ratio']:.3f} paired, {points[name]['paired_delta_ms']:+.2f} ms)"
        )
    return {
        "call_shape": list(shapes["call"]),
        "step_shape": list(shapes["step"]),
        "params": CALL_PARAMS,
        "points": points,
    }


def verdicts(cost: dict) -> dict:
    """The two targets on the paired per-round figures (load on this shared machine cancels)."""
    call, step = cost["points"]["call_grpc"], cost["points"]["step_grpc"]
    shape = "B={} V={}".format(*cost["call_shape"])
    return {
        "proxy_call": {
            "target": TARGETS["proxy_call"],
            "case": shape + " gRPC",
            "value": call["paired_ratio"],
            "threshold": 1.10,
            "met": call["paired_ratio"] <= 1.10,
        },
        "proxy_step": {
            "target": TARGETS["proxy_step"],
            "case": "B={} V={} gRPC (ms added)".format(*cost["step_shape"]),
            "value": step["paired_delta_ms"],
            "threshold": 0.5,
            "met": step["paired_delta_ms"] <= 0.5,
        },
    }


def run(tiny: bool, progress=print) -> dict:
    """A fresh server behind its own front door serving the bench sampler; the measurement."""
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        repository = Path(tmp) / "model_repository"
        repository.mkdir()
        models = pa_module.bench_models(repository)
        with FrontedTritonServer(
            repository, extra_args=explicit_models(models), admin_key=ADMIN_KEY, log_path=Path(tmp) / "tritonserver.log"
        ) as server:
            progress(f"proxy cost: tritonserver {server.server.grpc_url} (gRPC), HAProxy {server.grpc_url}")
            return measure(server, tiny, progress)


def main(argv: list[str] | None = None) -> dict:
    """This table alone."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, two rounds: checks that it runs")
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    cost = run(args.tiny)
    return report.publish(cost, verdicts(cost), args.output)


if __name__ == "__main__":
    main()
