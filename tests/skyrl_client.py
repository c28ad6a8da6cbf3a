"""SkyRL's ``RemoteInferenceClient`` (PyPI ``skyrl`` 0.4.0) against a skyinfer server, as a SkyRL trainer calls it.

    python tests/skyrl_client.py URL MODEL
    python tests/skyrl_client.py URL MODEL --colocated LEVEL WEIGHTS VERSION SOCKET0,SOCKET1,...

Prints one JSON object: per method, what it returned or the error it raised. With ``--colocated``
it makes one colocated weight sync as SkyRL's trainer does (``WorkerDispatch.save_weights_for_sampler``
with ``colocate_all``): sleep at LEVEL if the engines are not sleeping, wake the weights, push
WEIGHTS (here with skyinfer's ``SharedMemoryTrainer``, the trainer's side SkyRL lacks for CPU),
wake the KV cache; and prints, after each call, what the server says of every engine and what
each engine's vLLM says of itself, asked on its own socket.
skyinfer is given as both SkyRL's data-plane proxy and its one control-plane
server (skyinfer fans admin calls out to its engines itself).

SkyRL 0.4.0 declares Python >= 3.12; on 3.11 the one thing it lacks is pydantic
accepting ``typing.TypedDict`` in its models, so that name is pointed at
typing_extensions' (which pydantic accepts) before SkyRL is imported.
"""

import argparse
import asyncio
import json
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict

from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient  # noqa: E402


async def main(url: str, model: str) -> dict:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    results: dict = {}

    async def call(name: str, coro):
        try:
            value = await coro
            results[name] = {"ok": json.loads(json.dumps(value, default=str))}
        except Exception as exc:  # what the client raises is the finding
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "status": getattr(exc, "status", None)}
        return results[name].get("ok")

    chat = [{"role": "user", "content": "Say something."}]
    ids = await call("tokenize", client.tokenize(["Hello there", "RL"]))
    await call("detokenize", client.detokenize([ids[0]]))
    greedy = {"max_tokens": 5, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    await call(
        "generate",
        client.generate(
            {"prompt_token_ids": [ids[0], ids[0]], "sampling_params": greedy, "session_ids": ["skyrl-a", "skyrl-b"]}
        ),
    )
    await call(
        "sample",
        client.sample(
            {
                "json": {
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": ids[0]}]},
                    "num_samples": 2,
                    "sampling_params": {"max_tokens": 4, "temperature": 1.0},
                    "session_id": "skyrl-c",
                    "include_prompt_logprobs": True,
                }
            }
        ),
    )
    await call(
        "chat_completion",
        client.chat_completion(
            {"json": {"messages": chat, "max_tokens": 4, "ignore_eos": True, "session_id": "skyrl-a"}}
        ),
    )
    render = {"json": {"messages": chat, "session_id": "skyrl-a"}}
    await call("render_chat_completion", client.render_chat_completion(render))
    await call("completion", client.completion({"json": {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}}))
    await call("finish_session", client.finish_session("skyrl-a"))
    await call("get_world_size", client.get_world_size())
    await call("pause", client.pause(mode="keep"))
    await call("resume", client.resume())
    await call("pause_generation", client.pause_generation())
    await call("resume_generation", client.resume_generation())
    await call("sleep", client.sleep(level=1))
    await call("is_sleeping", client.is_sleeping())
    await call("wake_up", client.wake_up())
    await call("is_sleeping_after_wake", client.is_sleeping())
    await call("reset_prefix_cache", client.reset_prefix_cache(reset_running_requests=True))
    # Outside a push (no transfer group): refused with the reason, nothing changes.
    norm = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    await call("update_named_weights", client.update_named_weights(norm))
    # Calls that need SkyRL's own server or worker extension (see docs/clients.rst).
    await call("sleep_for_weight_sync", client.sleep_for_weight_sync())
    await call("load_lora_adapter", client.load_lora_adapter("skyrl-lora", "/nonexistent"))
    await call("unload_lora_adapter", client.unload_lora_adapter("skyrl-lora"))
    await call("fetch_weights", client.fetch_weights(target_version=1))
    await client.teardown()
    return results


async def colocated_sync(
    url: str, model: str, level: int, weights: str, version: str, sockets: list[str]
) -> list[dict]:
    import httpx
    from safetensors.torch import load_file

    from skyinfer.trainer import SharedMemoryTrainer

    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    trainer = SharedMemoryTrainer(url)
    steps: list[dict] = []

    async def snapshot(after: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            engines = (await http.get("/engines")).json()["engines"]
        vllm = []
        for path in sockets:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://engine") as own:
                vllm.append((await own.get("/conditions")).json())
        steps.append(
            {"after": after, "skyrl_is_sleeping": await client.is_sleeping(), "engines": engines, "vllm": vllm}
        )

    await asyncio.to_thread(trainer.init)
    if not await client.is_sleeping():
        await client.sleep(level=level)
    await snapshot("sleep")
    await client.wake_up(tags=["weights"])
    await snapshot("wake_up weights")
    await asyncio.to_thread(trainer.push, load_file(weights).items(), version)
    await snapshot("push")
    await client.wake_up(tags=["kv_cache"])
    await snapshot("wake_up kv_cache")
    trainer.close()
    await client.teardown()
    return steps


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--colocated", nargs=4, metavar=("LEVEL", "WEIGHTS", "VERSION", "SOCKETS"))
    args = p.parse_args()
    if args.colocated:
        level, weights, version, sockets = args.colocated
        print(
            json.dumps(
                asyncio.run(colocated_sync(args.url, args.model, int(level), weights, version, sockets.split(",")))
            )
        )
    else:
        print(json.dumps(asyncio.run(main(args.url, args.model))))
