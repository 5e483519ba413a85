"""TRL 1.16's VLLMClient (trl/generation/vllm_client.py) generating through the front door as
GRPOTrainer's server mode does: token-id prompts to /v1/completions with its defaults (top_k 0,
logprobs 0, return_tokens_as_token_ids), and chat() to /v1/chat/completions. Its constructor refuses to
run without the vllm package, which generation does not use (weight sync does, over NCCL only): that
guard alone is set to True here."""

from common import run


def main(args: dict) -> dict:
    import trl.generation.vllm_client as vllm_client

    vllm_client.is_vllm_available = lambda *a, **k: True
    client = vllm_client.VLLMClient(base_url=args["url"], connection_timeout=30)
    generation_kwargs = {"seed": args["seed"]}
    completions = client.generate(
        args["prompts"], max_tokens=args["max_tokens"], temperature=1.0, generation_kwargs=generation_kwargs
    )
    chat = client.chat(
        [[{"role": "user", "content": "Tell me about masks."}]],
        max_tokens=args["max_tokens"],
        temperature=1.0,
        generation_kwargs=generation_kwargs,
    )
    return {"model": client.model, "completions": completions, "chat": chat}


run(main)
