"""AReaL 1.0.4's RemoteSGLangEngine as its FSDP trainer drives it (areal/engine/fsdp_engine.py:1460-1500,
1565-1660): greedy rollouts, then weight syncs over a gloo group the trainer opens with AReaL's own
init_custom_process_group, each between pause_generation and continue_generation."""

import asyncio
from datetime import timedelta

from common import run

# A server that never joins fails the rendezvous or a broadcast after this, instead of hanging the run.
GROUP_TIMEOUT = timedelta(seconds=60)


def rollout(engine, prompt, max_new_tokens):
    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest

    gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=True)
    response = asyncio.run(engine.agenerate(ModelRequest(input_ids=list(prompt), gconfig=gconfig)))
    return {
        "tokens": list(response.output_tokens),
        "logprobs": list(response.output_logprobs),
        "stop_reason": response.stop_reason,
    }


def sync(engine, meta, group, tensors):
    import torch.distributed as dist
    from areal.api.io_struct import ParamSpec

    engine.pause_generation()
    specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split(".")[-1]) for n, t in tensors.items()]
    future = engine.update_weights_from_distributed(meta, specs)
    for tensor in tensors.values():
        dist.broadcast(tensor, src=0, group=group)
    future.result()
    engine.continue_generation()


def main(args: dict) -> dict:
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import InferenceEngineConfig
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.core.distributed import init_custom_process_group
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from safetensors.torch import load_file

    config = InferenceEngineConfig(
        backend="sglang:d1",
        experiment_name="compat",
        trial_name="compat",
        setup_timeout=60,
        request_timeout=120,
        request_retries=1,
        pause_grace_period=0.1,
    )
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=[args["address"]], train_data_parallel_size=1)
    result = {"before": rollout(engine, args["prompt"], args["max_new_tokens"])}
    if not args.get("sync"):
        engine.destroy()
        return result
    meta = WeightUpdateMeta(
        type="xccl",
        gen_allocation=ModelAllocation.from_str("sglang:d1"),
        nccl_master_address="127.0.0.1",
        nccl_master_port=args["master_port"],
        nccl_group_name="update_weight_group",
    )
    future = engine.init_weights_update_group(meta)
    group = init_custom_process_group(
        backend="gloo",
        world_size=2,
        init_method=f"tcp://127.0.0.1:{args['master_port']}",
        rank=0,
        group_name="update_weight_group",
        timeout=GROUP_TIMEOUT,
    )
    future.result()
    for step, path in (("moved", args["moved"]), ("restored", args["original"])):
        sync(engine, meta, group, load_file(path))
        result[step] = rollout(engine, args["prompt"], args["max_new_tokens"])
    engine.destroy()
    return result


run(main)
