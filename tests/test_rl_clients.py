"""RL frameworks' own client classes against the shared server, unchanged: TRL 1.16's ``VLLMClient``
and its async-GRPO client, verifiers 0.4's ``TrainClient`` (prime-rl's), and the openai SDK's tool
calls and chained Responses over two engines. Their answers are judged against a float32
``transformers`` forward pass of the served checkpoint, not against what skyinfer answered elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from support import engine_of

pytestmark = pytest.mark.usefixtures("restores_checkpoint")

ROOT = Path(__file__).resolve().parent.parent
VERIFIERS_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
VERIFIERS_CLIENT = Path(__file__).with_name("verifiers_client.py")


@pytest.fixture(scope="module")
def trl_client(server):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL 1.16 names vLLM 0.31 as the newest it was tested with
        from trl.generation.vllm_client import VLLMClient

        return VLLMClient(base_url=server.url)


@pytest.fixture(scope="module")
def reference(demo_model):
    """Logprobs of ``out_ids`` after ``prompt_ids`` under the checkpoint on disk, float32."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)

    def logprobs(prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out_ids])).logits[0]
        return logits.log_softmax(-1)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(out_ids)]

    return logprobs


def assert_matches(reference, prompt_ids, completion_ids, logprobs, token_ids, top: int):
    """TRL's (logprobs, logprob_token_ids) of one greedy sequence: the sampled token first, then the
    rest of the top ``top``; each value within 0.05 of the reference's."""
    expected = reference(prompt_ids, completion_ids)
    assert len(logprobs) == len(token_ids) == len(completion_ids)
    for position, (values, ids, sampled) in enumerate(zip(logprobs, token_ids, completion_ids)):
        assert ids[0] == sampled == expected[position].argmax().item()
        assert set(ids) == set(expected[position].topk(top).indices.tolist()), position
        for value, token in zip(values, ids):
            assert abs(value - expected[position, token].item()) < 0.05, (position, token)


def test_trl_vllm_client_reads_server_info_and_world_size(trl_client, server):
    info = trl_client.get_server_info()
    assert info["model_config"]["dtype"] == "torch.float32"
    assert info["weight_transfer_config"] == {"backend": "skyinfer_gloo"}
    assert trl_client.get_world_size() == sum(len(e["devices"]["ids"]) for e in server.engines())
    # The operator's view stays beside vLLM's fields.
    raw = httpx.get(f"{server.url}/server_info", params={"config_format": "json"}, timeout=30).json()
    assert [e["engine"] for e in raw["engines"]] == [0, 1] and raw["engine"] in (0, 1)
    assert all(e["status"] == 200 and isinstance(e["result"]["vllm_config"], dict) for e in raw["engines"])
    # Without the query, vLLM's text form, as vLLM answers it.
    assert isinstance(httpx.get(f"{server.url}/server_info", timeout=30).json()["vllm_config"], str)


@pytest.mark.parametrize("route", ["completions", "token route"])
def test_trl_generate_logprobs_match_transformers(trl_client, reference, route):
    prompt = "The quick brown fox"
    text = trl_client.generate([prompt], max_tokens=6, temperature=0.0, logprobs=3)
    prompt_ids = text["prompt_ids"][0]
    # TRL's token route: token-id prompts with (absent) multimodal features go to /inference/v1/generate,
    # whose logprob entries it reads as {"token": "token_id:N"}.
    out = (
        text
        if route == "completions"
        else trl_client.generate([prompt_ids], features=[None], max_tokens=6, temperature=0.0, logprobs=3)
    )
    (completion,) = out["completion_ids"]
    assert completion == text["completion_ids"][0] and len(completion) == 6
    assert_matches(reference, prompt_ids, completion, out["logprobs"][0], out["logprob_token_ids"][0], top=3)


def test_trl_chat_and_sequence_logprobs(trl_client, reference):
    chat = trl_client.chat([[{"role": "user", "content": "Hello"}]], max_tokens=5, temperature=0.0, logprobs=2)
    (prompt_ids,), (completion,) = chat["prompt_ids"], chat["completion_ids"]
    assert len(completion) == 5
    assert_matches(reference, prompt_ids, completion, chat["logprobs"][0], chat["logprob_token_ids"][0], top=2)
    # Teacher logprobs with TRL's default top 100 (needs --max-logprobs 100 or more on the engines).
    scored = trl_client.get_sequence_logprobs([prompt_ids + completion], [len(prompt_ids)])
    expected = reference(prompt_ids, completion)
    (values,), (ids,), (actual,) = scored["logprobs"], scored["logprob_token_ids"], scored["actual_logprobs"]
    assert len(values) == len(ids) == len(actual) == len(completion)
    for position, token in enumerate(completion):
        top = expected[position].topk(100).indices.tolist()
        assert len(ids[position]) == 100 and ids[position][0] == top[0]
        assert len(set(ids[position]) & set(top)) >= 95  # near-ties at the tail may swap
        assert abs(values[position][0] - expected[position, top[0]].item()) < 0.05
        assert abs(actual[position][0] - expected[position, token].item()) < 0.05


def test_trl_init_communicator_gets_past_the_server_to_the_cuda_device(trl_client):
    """On a GPU this would join vLLM's NCCL group; here it must fail only where it needs a CUDA device,
    after reading /server_info's weight_transfer_config and /get_world_size."""
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        trl_client.init_communicator(device="cpu")
    trl_client.reset_prefix_cache()


def test_trl_async_grpo_client(server, model_name):
    from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncGrpoClient

    client = AsyncGrpoClient(server.url)
    assert client.get_dtype() == "torch.float32"
    assert client.get_server_info()["model_config"]["model"] == model_name
    assert client.get_max_model_len() > 0
    client.pause()
    assert all(e["paused"] for e in server.engines())
    client.resume()
    assert not any(e["paused"] for e in server.engines())


@pytest.mark.skipif(not VERIFIERS_PYTHON.exists(), reason="tools/bootstrap makes .venv-verifiers")
def test_verifiers_train_client_one_turn_through_the_token_route(server, demo_model, reference):
    done = subprocess.run(
        [VERIFIERS_PYTHON, VERIFIERS_CLIENT, server.url, str(demo_model)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    turn = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(turn["completion_ids"]) == 8 and turn["finish_reason"] == "length"
    expected = reference(turn["prompt_ids"], turn["completion_ids"])
    for position, (token, value) in enumerate(zip(turn["completion_ids"], turn["completion_logprobs"])):
        assert token == expected[position].argmax().item()  # greedy
        assert abs(value - expected[position, token].item()) < 0.05


def test_openai_tool_choice_auto_and_required(server, model_name):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # "auto" needs the engines' tool-call parser: vLLM refuses it without --enable-auto-tool-choice.
    auto = client.chat.completions.create(
        model=model_name, messages=messages, tools=tools, tool_choice="auto", max_tokens=6, temperature=0
    )
    assert auto.choices[0].message.role == "assistant" and auto.choices[0].finish_reason in (
        "length",
        "stop",
        "tool_calls",
    )
    # A forced call is parsed into the SDK's typed tool calls.
    forced = client.chat.completions.create(
        model=model_name, messages=messages, tools=tools, tool_choice="required", max_tokens=300, temperature=0
    )
    calls = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and calls
    assert {c.function.name for c in calls} == {"get_weather"}


def test_chained_responses_reach_the_engine_that_stores_them(server, model_name):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    firsts = {}
    for i in range(8):  # sessions spread over the engines: chains start on both
        raw = client.responses.with_raw_response.create(
            model=model_name,
            input=f"Chain {i}: the quick brown fox",
            max_output_tokens=3,
            store=True,
            extra_headers={"X-Session-ID": f"chain-{i}"},
        )
        firsts.setdefault(engine_of(raw), raw.parse())
    assert set(firsts) == {0, 1}
    for engine, first in firsts.items():
        # The next turn carries no session: only previous_response_id says where the chain lives.
        raw = client.responses.with_raw_response.create(
            model=model_name, input="and then?", previous_response_id=first.id, max_output_tokens=3
        )
        second = raw.parse()
        assert engine_of(raw) == engine and second.previous_response_id == first.id
        assert engine_of(httpx.get(f"{server.url}/v1/responses/{second.id}", timeout=30)) == engine
    # A streamed turn is remembered too.
    with client.responses.stream(model=model_name, input="def main():", max_output_tokens=3, store=True) as stream:
        streamed = stream.get_final_response()
    raw = client.responses.with_raw_response.create(
        model=model_name, input="go on", previous_response_id=streamed.id, max_output_tokens=2
    )
    streamed_engine = engine_of(raw)
    assert raw.parse().previous_response_id == streamed.id
    # A session bound to the other engine contradicts the chain: refused, nothing sent.
    other = 1 - streamed_engine
    session = next(f"chain-{i}" for i in range(8) if server_session_engine(server, model_name, f"chain-{i}") == other)
    with pytest.raises(openai.ConflictError, match="previous_response_id"):
        client.responses.create(
            model=model_name,
            input="x",
            previous_response_id=streamed.id,
            max_output_tokens=2,
            extra_headers={"X-Session-ID": session},
        )


def server_session_engine(server, model_name: str, session: str) -> int:
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"model": model_name, "prompt": "x"},
        headers={"X-Session-ID": session},
        timeout=30,
    )
    return engine_of(r)
