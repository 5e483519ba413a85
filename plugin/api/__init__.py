"""The HTTP API RL frameworks already call: OpenAI's `/v1/completions`, `/v1/chat/completions`
and `/v1/models`, and SGLang's native `/generate`, with text in and out, token ids, log-probs and
sampling masks, over the `generate` model.

Run it beside tritonserver (`python -m triton_sampling_mask.api --triton-url localhost:8001`);
it reaches the model over loopback gRPC through `client.AsyncGenerateClient` and turns text into
ids with the checkpoint's own tokenizer and chat template. Owns `config` (command line and
settings), `errors` (every refusal in OpenAI's error shape), `text` (tokenizer, incremental
detokenizer, stop strings), `schemas` (the request bodies, typed as each upstream types them), `sequences` (running
generations and turning their chunks into text deltas), `token_fields` (ids, log-probs and masks
as JSON), `field_table` (every upstream request field and what is done with it), `openai_routes`,
`sglang_routes`, `token_route` (vLLM's `/inference/v1/generate`), `info_routes` (the worker
routes routers read), `in_flight` (requests by id, for the aborts), `weight_routes`,
`request_limits` (the key, the body's size and silence), `input_bounds` (what a request may ask
before any tokenizing), `preparation` (parsing and tokenizing off the event loop), `admission`
(the order sequences enter the engine in), `disconnects` (a client that leaves cancels its
generation; the SSE response) and `app` (the FastAPI application). May import
`sampling`, `generation` (paths only), `model_config` and `client`; never `serving` or `ops`.
"""
