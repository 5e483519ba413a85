"""skyrl-train 0.3.1's RemoteInferenceEngine (engine_backend="sglang") as its trainer drives it:
rollouts with the generator's SGLang sampling params (inference_engines/utils.py get_sglang_sampling_params
over config/ppo_base_config.yaml's defaults), then a broadcast weight sync over gloo the way
BroadcastWeightTransferSender.send_chunks does it (weight_sync/broadcast_strategy.py): one
update_named_weights request per tensor, broadcast while it is pending, the prefix cache reset beside it;
sleep / wake_up (colocated mode) and the teardown. skyrl-train checks no status: the answers are
returned for the test to read."""

import asyncio
from datetime import timedelta

from common import TINY_TOKENIZER, run

# A server that never joins fails the rendezvous or a broadcast after this, instead of hanging the run.
GROUP_TIMEOUT = timedelta(seconds=60)


def sampling_params(max_new_tokens: int, temperature: float) -> dict:
    from omegaconf import OmegaConf
    from skyrl_train.inference_engines.utils import get_sglang_sampling_params

    # config/ppo_base_config.yaml generator.sampling_params (temperature 0.0: its eval_sampling_params),
    # a short length
    generator = {
        "max_generate_length": max_new_tokens,
        "repetition_penalty": 1.0,
        "temperature": temperature,
        "top_p": 1.0,
        "min_p": 0.0,
        "top_k": -1,
        "logprobs": None,
        "stop": None,
    }
    return get_sglang_sampling_params(OmegaConf.create(generator))


async def rollout(engine, prompts, max_new_tokens, temperature=0.0):
    output = await engine.generate(
        {"prompts": None, "prompt_token_ids": prompts, "sampling_params": sampling_params(max_new_tokens, temperature)}
    )
    return {"response_ids": output["response_ids"], "stop_reasons": output["stop_reasons"]}


async def sync(engine, group, tensors):
    import torch.distributed as dist
    from skyrl_train.weight_sync import BroadcastWeightUpdateRequest

    answers = {"reset_prefix_cache": None, "updates": []}
    reset = asyncio.create_task(engine.reset_prefix_cache())
    for name, tensor in tensors.items():
        request = BroadcastWeightUpdateRequest(
            names=[name], dtypes=[str(tensor.dtype).split(".")[-1]], shapes=[list(tensor.shape)]
        )
        task = asyncio.create_task(engine.update_named_weights(request))
        await asyncio.to_thread(dist.broadcast, tensor.data, 0, group)
        answers["updates"].append(await task)
    answers["reset_prefix_cache"] = await reset
    return answers


def main(args: dict) -> dict:
    from skyrl_train.inference_engines.remote_inference_engine import RemoteInferenceEngine
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    engine = RemoteInferenceEngine(
        url=args["address"], model_name=args["model"], engine_backend="sglang", tokenizer=tokenizer
    )
    result = {
        "sampled": asyncio.run(rollout(engine, args["prompts"], args["max_new_tokens"], 1.0)),
        "before": asyncio.run(rollout(engine, args["prompts"], args["max_new_tokens"])),
    }
    if not args.get("sync"):
        return result
    # skyrl_train.distributed.utils.init_custom_process_group passes torch's private
    # _new_process_group_helper a `pg_options` argument the torch this suite shares (2.13) no longer has;
    # AReaL's copy of the same SGLang function opens the identical group on this torch. skyrl-train's
    # HTTP calls, the part the server sees, are its own.
    from areal.engine.core.distributed import init_custom_process_group
    from safetensors.torch import load_file
    from skyrl_train.weight_sync import BroadcastInitInfo

    info = BroadcastInitInfo(
        master_addr="127.0.0.1",
        master_port=args["master_port"],
        rank_offset=1,
        world_size=2,
        group_name="skyrl",
        backend="gloo",
        model_dtype_str="float32",
        override_existing_receiver=False,
    )

    async def connect():
        # worker.py:270-300: sender and receiver join the group concurrently
        opened = asyncio.to_thread(
            init_custom_process_group,
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{args['master_port']}",
            world_size=2,
            rank=0,
            group_name="skyrl",
            timeout=GROUP_TIMEOUT,
        )
        return await asyncio.gather(opened, engine.init_weight_update_communicator(info))

    group, result["init"] = asyncio.run(connect())
    result["sleep"] = asyncio.run(engine.sleep())
    result["wake_up_weights"] = asyncio.run(engine.wake_up(tags=["weights"]))
    for step, path in (("moved", args["moved"]), ("restored", args["original"])):
        result[f"sync_{step}"] = asyncio.run(sync(engine, group, load_file(path)))
        result[step] = asyncio.run(rollout(engine, args["prompts"], args["max_new_tokens"]))
    result["wake_up_kv_cache"] = asyncio.run(engine.wake_up(tags=["kv_cache"]))
    # engine.teardown() awaits exactly this call and drops its answer; the test reads the answer
    result["teardown"] = asyncio.run(engine._weight_loader.destroy_group())
    return result


run(main)
