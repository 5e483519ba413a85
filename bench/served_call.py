"""One served call of B=64 x V=151936 (issue 13, item 4): bytes moved per call, against the floor.

One request carries the whole batch (a single-request batch: no dynamic batching, no
concatenation), masks on, every output sent. Timed over gRPC, HTTP binary, and both with the
inputs in system shared memory, with FP32 and with BF16 logits (the `bench_sampler_bf16`
deployment: the shipped config with the logits' data_type changed), against the model's own path
in-process (`BatchSampler.run` on the same rows, one request of 64 rows, plus assembling the
requested outputs as `sampler_response` does). perf_analyzer drives the served points where it
runs (bench/perf_analyzer.py: shared-memory mode puts inputs and outputs in shm, written once,
as an engine whose output buffer is the region would); else a Python tritonclient does, with the
logits (only) in shm. A no-op Python model (bench/perf_analyzer.py: NOOP_MODELS) takes the same
logits over gRPC + shm: the Python backend's own cost, without the sampler. Each point: `requests`
calls back to back at concurrency 1 (30, in 3 rounds that interleave every point, so a slow spell of
this shared machine falls on all of them); the time per call is the median of the rounds' medians.

Bytes moved per call: the request's tensors plus the response's. The physical floor is one
memcpy of those bytes at this machine's bandwidth (numpy copy of the B=64 x V=151936 FP32 array,
best of 10), whatever the size being timed; `(p50 - in-process) / floor` says how many copies'
worth of time the serving path adds.

`python -m bench.served_call [--tiny] [--requests N] [--no-perf-analyzer]` runs this table alone.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from testbed.server import TritonServer
from triton_sampling_mask.client import unregister_shared_memory
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.sampling.backends import TorchSamplingBackend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.outputs import SAMPLING_MASK_LOGPROBS, TOKEN_OUTPUT_NAMES
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import MaskPolicy

from . import perf_analyzer as pa_module
from . import report
from .common import interleaved_medians, machine_facts, mask_width, paired_median_ratio, server_breakdown

FULL_SHAPE, TINY_SHAPE = (64, 151936), (4, 2000)
# Calls per served point and the interleaved rounds they are split into, full size and --tiny.
REQUESTS = {"full": 30, "tiny": 3}
ROUNDS = {"full": 3, "tiny": 1}
# The served B=1 table's parameters (served.ROW_PARAMS), plus min_p and a seed per row: the
# bench_sampler models take every input (perf_analyzer's shm mode refuses optional ones).
CALL_PARAMS = {"temperature": 0.8, "top_k": 512, "top_p": 0.95, "min_p": 0.0, "return_sampling_mask": True}
PATHS = ("grpc", "http", "grpc_shm", "http_shm")
DTYPES = {"fp32": ("FP32", np.float32), "bf16": ("BF16", ml_dtypes.bfloat16)}
# Wire bytes per row of every input but the logits: temperature, top_k, top_p, min_p (4 each),
# seed (8), return_sampling_mask (1).
PARAM_BYTES_PER_ROW = 4 * 4 + 8 + 1


def call_params(rows: int) -> dict[str, np.ndarray]:
    """Per-row input arrays of the call (wire dtypes), seeds 0..rows-1."""
    return {
        "temperature": np.full(rows, CALL_PARAMS["temperature"], np.float32),
        "top_k": np.full(rows, CALL_PARAMS["top_k"], np.int32),
        "top_p": np.full(rows, CALL_PARAMS["top_p"], np.float32),
        "min_p": np.full(rows, CALL_PARAMS["min_p"], np.float32),
        "seed": np.arange(rows, dtype=np.uint64),
        "return_sampling_mask": np.full(rows, CALL_PARAMS["return_sampling_mask"], np.bool_),
    }


def make_logits(rows: int, vocab: int) -> dict[str, np.ndarray]:
    """Seeded N(0, 3^2) logits, FP32 and the same values rounded to BF16 (ml_dtypes)."""
    fp32 = (np.random.default_rng(7).standard_normal((rows, vocab)) * 3.0).astype(np.float32)
    return {"fp32": fp32, "bf16": fp32.astype(ml_dtypes.bfloat16)}


def memcpy_bandwidth(nbytes: int = FULL_SHAPE[0] * FULL_SHAPE[1] * 4, repeats: int = 10) -> dict:
    """This machine's memcpy bandwidth: numpy copy of an `nbytes` array, best of `repeats`."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return {"bytes": nbytes, "best_s": best, "bytes_per_s": nbytes / best, "repeats": repeats}


def byte_counts(rows: int, vocab: int, itemsize: int, width: int) -> dict:
    """Bytes of the call's request tensors and response tensors (every output, width W masks)."""
    logits = rows * vocab * itemsize
    params = rows * PARAM_BYTES_PER_ROW
    outputs = rows * (4 * 4 + 2 * 4 * width)  # 4 scalars + sampling_mask and sampling_mask_logprobs
    return {"logits": logits, "params": params, "outputs": outputs, "payload": logits + params + outputs}


def in_process_part(logits: dict[str, np.ndarray], width: int, timing: dict) -> dict:
    """The model's own path on the same rows: BatchSampler.run on one request of all the rows, then
    the requested outputs assembled as `sampler_response` does (np.ascontiguousarray of each wanted
    output). Three functions timed in interleaved rounds: FP32 with every output, FP32 without the
    per-support log-probs (target g), BF16 with every output."""
    rows = logits["fp32"].shape[0]
    sampler = BatchSampler(TorchSamplingBackend(), MaskPolicy(width, "config.pbtxt"), torch.device("cpu"))
    wire = call_params(rows)
    params = RowParams.defaults(rows)
    for name in ("temperature", "top_k", "top_p", "min_p", "return_sampling_mask"):
        getattr(params, name)[:] = wire[name]
    params.seed[:], params.has_seed[:] = wire["seed"], True
    tensors = {"fp32": torch.from_numpy(logits["fp32"]), "bf16": torch.from_numpy(logits["fp32"]).bfloat16()}
    every, without = set(TOKEN_OUTPUT_NAMES), set(TOKEN_OUTPUT_NAMES) - {SAMPLING_MASK_LOGPROBS.name}

    def call(tensor: torch.Tensor, wanted: set[str]):
        def run():
            outcome = sampler.run([(tensor, params)])[0]
            if outcome.error is not None:
                raise RuntimeError(outcome.error)
            return [np.ascontiguousarray(v) for n, v in outcome.outputs.items() if n in wanted]

        return run

    functions = {
        "fp32": call(tensors["fp32"], every),
        "fp32_no_support_logprobs": call(tensors["fp32"], without),
        "bf16": call(tensors["bf16"], every),
    }
    timed = interleaved_medians(functions, torch.device("cpu"), **timing)
    return {
        "ms": {name: t["median_ms"] for name, t in timed.items()},
        "min_ms": {name: t["min_ms"] for name, t in timed.items()},
        "rounds": timed["fp32"]["rounds"],
        "support_logprobs_ratio": timed["fp32"]["median_ms"] / timed["fp32_no_support_logprobs"]["median_ms"],
        "support_logprobs_paired": paired_median_ratio(
            timed["fp32"]["samples_ms"], timed["fp32_no_support_logprobs"]["samples_ms"]
        ),
        "support_logprobs_best_of": timed["fp32"]["min_ms"] / timed["fp32_no_support_logprobs"]["min_ms"],
    }


def _python_point(
    server,
    path: str,
    model: str,
    logits: np.ndarray,
    datatype: str,
    params: dict | None,
    requests: int,
    statistics=None,
) -> dict:
    """`requests` calls through a Python tritonclient (one warm-up first): latencies in ms
    (`requests` 0: the warm-up call only; `params` None: the logits only, for the no-op model)."""
    module = grpcclient if path.startswith("grpc") else httpclient
    client = module.InferenceServerClient(server.grpc_url if module is grpcclient else server.http_url)
    region = handle = None
    try:
        inputs = sampler_inputs(module, np.zeros((logits.shape[0], 1), np.float32), **params) if params else [None]
        inputs[0] = module.InferInput("logits", list(logits.shape), datatype)
        if path.endswith("_shm"):
            region = f"bench_call_{os.getpid()}_{path}_{datatype}"
            handle = shm.create_shared_memory_region(region, "/" + region, logits.nbytes)
            shm.set_shared_memory_region(handle, [np.ascontiguousarray(logits)])  # written once, as PA does
            client.register_system_shared_memory(region, "/" + region, logits.nbytes)
            inputs[0].set_shared_memory(region, logits.nbytes)
        else:
            inputs[0].set_data_from_numpy(logits)
        client.infer(model, inputs)  # warm-up: maps the region, grows the stub's shm pool
        if not requests:
            return {}
        before = statistics(server, model) if statistics else None
        latencies = []
        for _ in range(requests):
            t0 = time.perf_counter()
            client.infer(model, inputs)
            latencies.append(time.perf_counter() - t0)
        breakdown = server_breakdown(before, statistics(server, model)) if statistics else None
    finally:
        if region is not None:
            try:
                unregister_shared_memory(client, region)
            finally:
                shm.destroy_shared_memory_region(handle)
        client.close()
    lat = np.asarray(latencies) * 1e3
    out = {
        "requests": len(lat),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "mean_ms": float(lat.mean()),
    }
    return out if breakdown is None else {**out, "server": breakdown}


def warm_up(server, model: str, logits: np.ndarray, datatype: str) -> None:
    """One gRPC call of a bench_sampler model before its timed points (its stub's first call
    allocates and grows its shared-memory pool)."""
    _python_point(server, "grpc", model, logits, datatype, call_params(logits.shape[0]), requests=0)


def _measure_point(
    server,
    pa,
    path: str,
    dtype: str,
    logits: np.ndarray,
    params: dict,
    width: int,
    requests: int,
    input_json: Path | None,
    work_dir: Path,
    progress,
    statistics,
) -> dict:
    """One run of one served point: perf_analyzer where it runs, else the Python client."""
    datatype = DTYPES[dtype][0]
    model = pa_module.BENCH_MODELS[datatype]
    rows, vocab = logits.shape
    shared = path.endswith("_shm")
    if pa is not None:
        try:
            before = statistics(server, model) if statistics else None
            measured = pa_module.measure(
                pa,
                server.grpc_url if path.startswith("grpc") else server.http_url,
                path.split("_")[0],
                model,
                input_json,
                rows,
                vocab,
                shared,
                output_bytes=rows * 4 * width,
                work_dir=work_dir,
                request_count=requests,
            )
            if statistics:
                measured["server"] = server_breakdown(before, statistics(server, model))
            return {**measured, "client": "perf_analyzer"}
        except (RuntimeError, OSError) as exc:
            progress(f"  perf_analyzer failed for {path} {dtype}; Python client instead: {str(exc)[:200]}")
            fallback = _python_point(server, path, model, logits, datatype, params, requests, statistics)
            return {**fallback, "client": "python", "perf_analyzer_error": str(exc)[-600:]}
    return {**_python_point(server, path, model, logits, datatype, params, requests, statistics), "client": "python"}


def _combine_rounds(runs: list[dict]) -> dict:
    """One point from its interleaved runs: the median of their p50s, the mean of their means, the
    largest p99, the mean of each server phase; every run's p50 kept (`round_p50_ms`)."""
    out = {
        "requests": sum(r["requests"] for r in runs),
        "p50_ms": float(np.median([r["p50_ms"] for r in runs])),
        "mean_ms": float(np.mean([r["mean_ms"] for r in runs])),
        "p99_ms": max(r["p99_ms"] for r in runs),
        "round_p50_ms": [r["p50_ms"] for r in runs],
        "client": runs[-1]["client"],
    }
    if all("server" in r for r in runs):
        out["server"] = {k: float(np.mean([r["server"][k] for r in runs])) for k in runs[0]["server"]}
    errors = [r["perf_analyzer_error"] for r in runs if "perf_analyzer_error" in r]
    return {**out, "perf_analyzer_error": errors[-1]} if errors else out


def served_part(
    server,
    logits: dict[str, np.ndarray],
    width: int,
    requests: int,
    work_dir: Path,
    pa: pa_module.PerfAnalyzer | None,
    progress=print,
    statistics=None,
    rounds: int = 1,
) -> list[dict]:
    """Every path x dtype on a running server that serves the bench_sampler models, in `rounds`
    interleaved rounds of `requests / rounds` calls per point (so a slow spell of this shared
    machine lands on every point alike). `statistics` (model_statistics) adds the server's own
    per-phase breakdown of each point."""
    rows, vocab = logits["fp32"].shape
    params = call_params(rows)
    per_round = max(1, requests // rounds)
    input_json = {}
    for dtype, (datatype, _) in DTYPES.items():
        input_json[dtype] = (
            pa_module.write_input_data(work_dir / f"call_{dtype}.json", logits[dtype], params) if pa else None
        )
        warm_up(server, pa_module.BENCH_MODELS[datatype], logits[dtype], datatype)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(rounds):
        for dtype in DTYPES:
            for path in PATHS:
                runs.setdefault((dtype, path), []).append(
                    _measure_point(
                        server,
                        pa,
                        path,
                        dtype,
                        logits[dtype],
                        params,
                        width,
                        per_round,
                        input_json[dtype],
                        work_dir,
                        progress,
                        statistics,
                    )
                )
    entries = []
    for dtype, (datatype, _) in DTYPES.items():
        data = logits[dtype]
        counts = byte_counts(rows, vocab, data.dtype.itemsize, width)
        for path in PATHS:
            entry = {
                "path": path,
                "logits": dtype,
                "model": pa_module.BENCH_MODELS[datatype],
                "rows": rows,
                "vocab": vocab,
                "bytes": counts,
                **_combine_rounds(runs[dtype, path]),
            }
            # perf_analyzer's shm mode puts every tensor in shm; the Python client only the logits.
            shared_bytes = counts["payload"] if entry["client"] == "perf_analyzer" else counts["logits"]
            entry["socket_bytes"] = counts["payload"] - (shared_bytes if path.endswith("_shm") else 0)
            entries.append(entry)
            progress(
                f"  call B={rows} V={vocab} {path} {dtype} ({entry['client']}): p50 {entry['p50_ms']:.1f} ms "
                f"(rounds {', '.join(f'{v:.1f}' for v in entry['round_p50_ms'])}), mean {entry['mean_ms']:.1f} ms "
                f"over {entry['requests']} calls"
            )
        # The Python backend alone: the same logits through gRPC + shm to a model that reads nothing.
        noop = pa_module.NOOP_MODELS[datatype]
        _python_point(server, "grpc", noop, data, datatype, None, requests=0)  # the stub's first call
        entry = {
            "path": "grpc_shm",
            "logits": dtype,
            "model": noop,
            "noop": True,
            "rows": rows,
            "vocab": vocab,
            "bytes": {
                "logits": counts["logits"],
                "params": 0,
                "outputs": rows * 4,
                "payload": counts["logits"] + rows * 4,
            },
            **_python_point(server, "grpc_shm", noop, data, datatype, None, requests, statistics),
            "client": "python",
            "socket_bytes": rows * 4,
        }
        entries.append(entry)
        progress(
            f"  call B={rows} V={vocab} grpc_shm {dtype}, no-op model (python): p50 {entry['p50_ms']:.1f} ms, "
            f"server { ({k: round(v, 2) for k, v in entry.get('server', {}).items()}) }"
        )
    return entries


def summarise(
    in_process: dict,
    served: list[dict],
    bandwidth: dict,
    rows: int,
    vocab: int,
    width: int,
    requests: int,
    client: str,
    rounds: int = 1,
) -> dict:
    """The call table: each served point with its floor and its ratios to in-process."""
    for entry in served:
        floor_ms = entry["bytes"]["payload"] / bandwidth["bytes_per_s"] * 1e3
        reference = in_process["ms"][entry["logits"]]
        entry["floor_ms"] = floor_ms
        if entry.get("noop"):  # no sampler there: only its floor compares
            entry["over_floor"] = entry["p50_ms"] / floor_ms
            continue
        entry["over_in_process"] = entry["p50_ms"] / reference
        entry["over_in_process_fp32"] = entry["p50_ms"] / in_process["ms"]["fp32"]
        entry["copies_over_in_process"] = (entry["p50_ms"] - reference) / floor_ms
    return {
        "rows": rows,
        "vocab": vocab,
        "mask_width": width,
        "params": CALL_PARAMS,
        "requests_per_point": requests,
        "rounds": rounds,
        "client": client,
        "memcpy": bandwidth,
        "bytes": {d: byte_counts(rows, vocab, np.dtype(t).itemsize, width) for d, (_, t) in DTYPES.items()},
        "in_process": in_process,
        "served": served,
    }


def prepare(tiny: bool, width: int, timing: dict | None = None, progress=print) -> dict:
    """Everything before a server is up: the rows, the memcpy bandwidth, the in-process timings."""
    rows, vocab = TINY_SHAPE if tiny else FULL_SHAPE
    timing = timing or ({"min_rounds": 2, "budget_s": 0.0} if tiny else {"min_rounds": 7, "budget_s": 3.0})
    logits = make_logits(rows, vocab)
    bandwidth = memcpy_bandwidth()
    in_process = in_process_part(logits, width, timing)
    progress(
        f"  call in-process B={rows} V={vocab}: "
        + ", ".join(f"{n} {ms:.1f} ms" for n, ms in in_process["ms"].items())
        + f"; memcpy {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s"
    )
    size = "tiny" if tiny else "full"
    return {
        "logits": logits,
        "bandwidth": bandwidth,
        "in_process": in_process,
        "width": width,
        "requests": REQUESTS[size],
        "rounds": ROUNDS[size],
    }


def run_on_server(
    prepared: dict, server, requests: int | None, work_dir: Path, pa, pa_status: str, progress=print, statistics=None
) -> dict:
    """The served points on `server` (serving the bench_sampler models), summarised with `prepared`
    (`requests` None: its default for the size)."""
    rows, vocab = prepared["logits"]["fp32"].shape
    requests, rounds = requests or prepared["requests"], prepared["rounds"]
    served = served_part(
        server, prepared["logits"], prepared["width"], requests, work_dir, pa, progress, statistics, rounds=rounds
    )
    out = summarise(
        prepared["in_process"],
        served,
        prepared["bandwidth"],
        rows,
        vocab,
        prepared["width"],
        requests,
        "perf_analyzer" if pa else "python",
        rounds,
    )
    out["perf_analyzer"] = pa_status
    return out


def model_statistics(server: TritonServer, model: str) -> dict:
    """A model's cumulative server-side statistics (counts and nanoseconds per phase)."""
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


def explicit_models(models) -> list[str]:
    """tritonserver flags that load only `models` (the generate model's stub stays out of the timing)."""
    return ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]


def main(argv: list[str] | None = None) -> dict:
    """This table alone, on a server of its own (a quick check; `make bench` runs it too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help=f"B x V = {TINY_SHAPE}, {REQUESTS['tiny']} calls per point")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"calls per served point (default {REQUESTS['full']} in {ROUNDS['full']} interleaved rounds, tiny {REQUESTS['tiny']})",
    )
    parser.add_argument(
        "--no-perf-analyzer", action="store_true", help="the Python client even where perf_analyzer runs"
    )
    parser.add_argument("--output", type=Path, default=None, help="write the table's JSON and verdicts here")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    load_before = machine_facts()["load_average_1m"]
    prepared = prepare(args.tiny, mask_width())
    pa, status = pa_module.locate() if not args.no_perf_analyzer else (None, "disabled (--no-perf-analyzer)")
    print(f"  client: {'perf_analyzer, ' + status if pa else 'Python tritonclient (perf_analyzer: ' + status + ')'}")
    with tempfile.TemporaryDirectory(prefix="bench-call-") as tmp:
        tmp = Path(tmp)
        repository = tmp / "model_repository"
        repository.mkdir()
        models = pa_module.bench_models(repository) + pa_module.noop_models(repository)
        with TritonServer(repository, extra_args=explicit_models(models), log_path=tmp / "tritonserver.log") as server:
            call = run_on_server(prepared, server, args.requests, tmp, pa, status, statistics=model_statistics)
    call["load_average_1m"] = {"before": load_before, "after": machine_facts()["load_average_1m"]}
    report.print_call_table(call)
    targets = report.call_verdicts(call)
    report.print_verdicts(targets)
    if args.output:
        args.output.write_text(json.dumps({"served_call": call, "targets": targets}, indent=2) + "\n")
    return call


if __name__ == "__main__":
    main()
