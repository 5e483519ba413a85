"""Weight updates two ways, side by side on one tritonserver: in place (a control request to the
`generate` model, docs/weights.md) against Triton's own way, a model reload through the
repository API with a config override naming the new `model_path`.

For each LM (the tiny default one, and a random Llama of about 100M parameters) and each way, a
steady trickle of requests runs while the update happens; measured: the time from the update's
start until a request sampled by the new weights comes back (each request's tokens carry their
weight version: the reload's override sets `weight_version` too), the stubs' peak resident memory
above what they held before (all `triton_python_backend_stub` processes of the server, sampled
every 5 ms), and what became of the requests in flight or sent meanwhile (old weights, new
weights, refused). Results go to bench/results/weight_update.md.

    python -m bench.weight_update [--tiny-only] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from bench.common import RESULTS_DIR
from testbed.checkpoints import random_model
from testbed.process_memory import process_name
from testbed.server import TritonServer, copy_model
from triton_sampling_mask.client import GenerateClient, GenerateError
from triton_sampling_mask.client.sampler_client import admin_headers
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.generation.lm import build_default_model
from triton_sampling_mask.ops.child import group_members

MODEL = "generate"
ADMIN_KEY = "bench-weights-key"
# A Llama of about 100M parameters (untied 32000-token embeddings and head, 8 layers of 768).
LARGE_CONFIG = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
PARAMS = SamplingParams(temperature=0.8, top_k=20, seed=1)
TRICKLE_TOKENS = 8


def checkpoints(root: Path, size: str) -> tuple[str, str, int]:
    """Two checkpoints of one architecture under `root`: (served first, pushed, bytes of one)."""
    from transformers import AutoConfig

    names = (f"{size}-a", f"{size}-b")
    for seed, name in enumerate(names):
        model = build_default_model() if size == "tiny" else random_model(AutoConfig.for_model(**LARGE_CONFIG), seed)
        if size == "tiny" and seed:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(1.1)
        model.save_pretrained(root / name)
        del model
    size_bytes = sum(p.stat().st_size for p in (root / names[1]).glob("*.safetensors"))
    return *names, size_bytes


def repository(dest: Path, first: str, root: Path) -> Path:
    """The shipped generate model serving checkpoint `first`, its weights root `root`."""
    copy_model(
        dest, MODEL, parameters={"model_path": str(root / first), "weights_root": str(root), "weight_version": first}
    )
    return dest


class StubMemory:
    """Samples the summed VmRSS of the server's Python stubs every 5 ms on a thread."""

    def __init__(self, pgid: int):
        self.pgid, self.samples, self._stop = pgid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        total = 0
        for pid in group_members(self.pgid):
            try:
                process = psutil.Process(pid)
                if process_name(process).startswith("stub"):
                    total += process.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.rss()))
            time.sleep(0.005)

    def __enter__(self) -> StubMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Trickle:
    """Two loops sending small requests back to back; each outcome recorded with its time."""

    def __init__(self, url: str):
        self.client = GenerateClient(url, model_name=MODEL, max_attempts=1, busy_timeout_s=0)
        self.outcomes: list[tuple[float, float, str]] = []  # (sent, done, version or "refused: ...")
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                (result,) = self.client.generate([[5, 6, 7]], PARAMS, TRICKLE_TOKENS, ignore_eos=True)
                outcome = str(result.weight_version[-1])
            except GenerateError as error:
                outcome = f"refused: {error.message[:80]}"
            self.outcomes.append((sent, time.monotonic(), outcome))

    def __enter__(self) -> Trickle:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        self.client.close()


def update_in_place(server, target: str) -> None:
    with GenerateClient(server.grpc_url, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        client.update_weights_from_disk(target, weight_version=target, pause_mode="in_place")


def reload_with_override(server, target: str, root: Path) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=600)
    try:
        config = client.get_model_config(MODEL)
        config["parameters"]["model_path"] = {"string_value": str(root / target)}
        config["parameters"]["weight_version"] = {"string_value": target}
        client.load_model(MODEL, config=json.dumps(config), headers=admin_headers("http", ADMIN_KEY))
    finally:
        client.close()


def measure(server, way: str, target: str, root: Path) -> dict:
    """One update while the trickle runs: times, peak stub memory, the requests' fates."""
    memory = StubMemory(server.process.pid)
    with memory, Trickle(server.grpc_url) as trickle:
        time.sleep(1.0)
        baseline = max(rss for _, rss in memory.samples)
        started = time.monotonic()
        (update_in_place(server, target) if way == "in place" else reload_with_override(server, target, root))
        returned = time.monotonic()
        deadline = returned + 120
        while not any(o[2] == target for o in trickle.outcomes) and time.monotonic() < deadline:
            time.sleep(0.005)
        served_new = min((o[1] for o in trickle.outcomes if o[2] == target), default=float("nan"))
        time.sleep(0.5)
    overlapping = [o for o in trickle.outcomes if o[1] >= started and o[0] <= returned]
    peak = max(rss for t, rss in memory.samples if t >= started)
    return {
        "update_s": returned - started,
        "new_weights_after_s": served_new - started,
        "peak_rss_above_bytes": max(0, peak - baseline),
        "baseline_rss_bytes": baseline,
        "during": {
            "old weights": sum(o[2] not in (target,) and not o[2].startswith("refused") for o in overlapping),
            "new weights": sum(o[2] == target for o in overlapping),
            "refused": sum(o[2].startswith("refused") for o in overlapping),
        },
        "refusals": sorted({o[2] for o in overlapping if o[2].startswith("refused")}),
    }


def run_size(size: str, rounds: int, work: Path) -> dict:
    root = work / f"{size}-weights"
    root.mkdir()
    first, second, size_bytes = checkpoints(root, size)
    rows = {}
    repo = repository(work / f"{size}-models", first, root)
    control = ["--model-control-mode=explicit", f"--load-model={MODEL}"]
    with TritonServer(repo, extra_args=control, admin_key=ADMIN_KEY, log_path=work / f"{size}.log") as server:
        update_in_place(server, first)  # warm-up: the stub's first update imports safetensors
        targets = [second, first] * rounds
        for way in ("in place", "reload"):
            rows[way] = [measure(server, way, target, root) for target in targets[:rounds]]
            # back to the first weights for the next way
            if rounds % 2:
                update_in_place(server, first)
    return {"checkpoint_bytes": size_bytes, "ways": rows}


def markdown(results: dict, note: str) -> str:
    lines = [
        "# Weight updates: in place against a reload with a model_path override",
        "",
        f"Loaded run ({note}): `python -m bench.weight_update`; the machine was shared with other jobs,",
        "so the times are upper bounds. One tritonserver 2.51 per LM, the shipped generate model (one",
        "KIND_CPU instance), two client loops sending 8-token requests back to back during each update;",
        "one in-place update to the same weights first (the stub's first update imports safetensors).",
        "",
        "| LM | checkpoint | way | update call (s) | new weights serve after (s) | stubs' peak RSS above before | "
        "requests during: old / new weights / refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, data in results.items():
        mib = data["checkpoint_bytes"] / 2**20
        for way, runs in data["ways"].items():
            update = statistics.median(r["update_s"] for r in runs)
            serve = statistics.median(r["new_weights_after_s"] for r in runs)
            peak = max(r["peak_rss_above_bytes"] for r in runs) / 2**20
            during = [sum(r["during"][k] for r in runs) for k in ("old weights", "new weights", "refused")]
            lines.append(
                f"| {size} | {mib:.0f} MiB | {way} | {update:.2f} | {serve:.2f} | {peak:.0f} MiB "
                f"({100 * peak / mib:.0f}% of the checkpoint) | {during[0]} / {during[1]} / {during[2]} |"
            )
    lines += [
        "",
        "In place: generation pauses between two engine steps (`in_place` mode), the checkpoint is",
        "copied into the running LM in pieces of at most 8 MiB, and the requests in flight go on, on the",
        "new weights (their KV cache recomputed); the stub's memory grows by a few pieces. Reload:",
        "Triton starts a second stub and loads the whole model beside the first, which keeps answering",
        "on the old weights until the new one is ready and is unloaded once its requests are done: the",
        "weights are in memory twice at the peak, and the new ones serve only after a full stub start.",
    ]
    refusals = sorted({m for d in results.values() for runs in d["ways"].values() for r in runs for m in r["refusals"]})
    if refusals:
        lines += ["", "Refusals seen during the updates:", "", *(f"- `{m}`" for m in refusals)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny-only", action="store_true", help="skip the ~100M-parameter LM")
    parser.add_argument("--rounds", type=int, default=2, help="updates per way and LM (medians; peak: the largest)")
    parser.add_argument("--from-json", type=Path, help="rewrite the markdown of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        (RESULTS_DIR / "weight_update.md").write_text(markdown(data["results"], data["note"]))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="weight-update-") as work:
        for size in ("tiny",) if args.tiny_only else ("tiny", "100M"):
            results[size] = run_size(size, args.rounds, Path(work))
            print(json.dumps({size: results[size]}, indent=1, default=str), flush=True)
    note = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (RESULTS_DIR / "weight_update.md").write_text(markdown(results, note))
    (RESULTS_DIR / "weight_update.json").write_text(json.dumps({"note": note, "results": results}, indent=1))
    print(markdown(results, note))


if __name__ == "__main__":
    main()
