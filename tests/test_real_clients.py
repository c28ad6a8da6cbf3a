"""Clients nobody on this project wrote, pointed at a real server: a user changes only the URL.

SkyRL's ``RemoteInferenceClient`` (in its own process), vLLM's
``HTTPVLLMWeightSyncClient`` and TRL's async-GRPO call sequence driving real
pushes (the trainer's broadcast by ``skyinfer.trainer``), the ``openai`` SDK's
Responses API and the ``anthropic`` SDK. What a client calls that skyinfer
cannot serve is asserted to fail with the reason, and named in docs/clients.rst.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from forked_python import run_python
from pushes import assert_engines_match, modified_weights, run_trainer, save

pytestmark = pytest.mark.usefixtures("restores_checkpoint")

SKYRL_CLIENT = Path(__file__).with_name("skyrl_client.py")


@pytest.fixture(scope="module")
def skyrl(server, model_name) -> dict:
    done = run_python([SKYRL_CLIENT, server.url, model_name], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_skyrl_data_plane(skyrl):
    ids = skyrl["tokenize"]["ok"]
    assert len(ids) == 2 and all(isinstance(t, int) for t in ids[0])
    assert skyrl["detokenize"]["ok"] == ["Hello there"]
    generated = skyrl["generate"]["ok"]
    assert [len(r) for r in generated["response_ids"]] == [5, 5]
    assert [len(lp) for lp in generated["response_logprobs"]] == [5, 5]
    assert generated["response_ids"][0] == generated["response_ids"][1]  # greedy, same prompt
    sampled = skyrl["sample"]["ok"]
    assert [len(s["tokens"]) for s in sampled["sequences"]] == [4, 4]
    assert len(sampled["prompt_logprobs"]) == len(ids[0])
    assert skyrl["chat_completion"]["ok"]["usage"]["completion_tokens"] == 4
    assert skyrl["render_chat_completion"]["ok"]["token_ids"]
    assert skyrl["completion"]["ok"]["usage"]["completion_tokens"] == 4
    assert skyrl["finish_session"] == {"ok": None}


def test_skyrl_control_plane(skyrl):
    assert skyrl["get_world_size"]["ok"] == [2, 2]
    for name in ("pause", "resume", "pause_generation", "resume_generation", "sleep", "wake_up", "reset_prefix_cache"):
        (reply,) = skyrl[name]["ok"].values()
        assert reply["status"] == 200, (name, reply)
    assert skyrl["is_sleeping"]["ok"] is True and skyrl["is_sleeping_after_wake"]["ok"] is False
    # SkyRL sends reset_running_requests in the body: honoured, not refused.
    (reset,) = skyrl["reset_prefix_cache"]["ok"].values()
    assert all(e["status"] == 200 for e in reset["body"]["engines"])


def test_skyrl_calls_skyinfer_does_not_serve_fail_with_the_reason(skyrl):
    assert skyrl["update_named_weights"]["status"] == 409  # no update started: the order is wrong
    assert skyrl["sleep_for_weight_sync"]["status"] == 403  # SkyRL's worker method over /collective_rpc
    assert "allow-collective-rpc" in skyrl["sleep_for_weight_sync"]["error"]
    for name in ("load_lora_adapter", "unload_lora_adapter", "fetch_weights"):
        assert skyrl[name]["status"] == 404, (name, skyrl[name])


def test_vllm_http_weight_sync_client_drives_a_push(server, model_name, demo_model, tmp_path):
    weights = modified_weights(demo_model, seed=7)
    done = run_trainer(server, save(weights, tmp_path / "w.safetensors"), "vllm-client", "--client", "vllm")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert_engines_match(server, model_name, demo_model, weights, "vllm-client")
    # The client's fifth call: every engine leaves the group (the trainer process has exited).
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    HTTPVLLMWeightSyncClient(server.url).shutdown_weight_transfer_engine()
    engines = httpx.get(f"{server.url}/weight_info", timeout=30).json()["engines"]
    assert [e["in_transfer_group"] for e in engines] == [False, False]


def test_trl_async_grpo_push_sequence(server, model_name, demo_model, tmp_path):
    """pause?mode=keep, init, start {is_checkpoint_format: true}, update, finish {}, resume: as TRL sends them."""
    weights = modified_weights(demo_model, seed=8)
    done = run_trainer(server, save(weights, tmp_path / "w.safetensors"), "unused", "--client", "trl", "--pause-keep")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    info = httpx.get(f"{server.url}/weight_info", timeout=30).json()
    # TRL's finish names no version: skyinfer labels the update itself.
    assert info["weight_version"].startswith("update-")
    assert httpx.get(f"{server.url}/is_paused", timeout=30).json()["is_paused"] is False
    assert_engines_match(server, model_name, demo_model, weights, info["weight_version"])


def test_openai_responses_api(server, model_name):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(
        model=model_name, input="Write a haiku.", max_output_tokens=8, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete" and response.usage.output_tokens == 8
    assert response.output_text
    events = [e.type for e in client.responses.create(model=model_name, input="Hi", max_output_tokens=4, stream=True)]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in events


def test_anthropic_messages_api(server, model_name):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=model_name, max_tokens=6, messages=[{"role": "user", "content": "Hello"}], extra_body={"ignore_eos": True}
    )
    assert message.usage.output_tokens == 6 and message.content[0].text
    counted = client.messages.count_tokens(model=model_name, messages=[{"role": "user", "content": "Hello"}])
    assert counted.input_tokens == message.usage.input_tokens
    with client.messages.stream(model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens <= 4
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model_name, max_tokens=-1, messages=[{"role": "user", "content": "x"}])


def test_vllm_ipc_init_is_refused_with_the_reason(server):
    """vLLM's ipc trainer engine (colocated on a GPU) against a server whose engines have devices of
    their own: skyinfer says which transport it takes, and how to run colocated, instead of failing later."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    with pytest.raises(requests.HTTPError) as info:
        HTTPVLLMWeightSyncClient(server.url).init_weight_transfer_engine({"packed": True})
    assert info.value.response.status_code == 400
    message = info.value.response.json()["error"]["message"]
    assert "ipc" in message and "--colocate" in message and "GlooTrainer" in message
    assert httpx.get(f"{server.url}/weight_info", timeout=30).json()["update_phase"] == "idle"
