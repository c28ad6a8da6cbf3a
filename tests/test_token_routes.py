"""Token-in/token-out generation and tokenize/detokenize through the front."""

from __future__ import annotations

import httpx
import pytest

from support import both_fronts, engine_of

# Against one front process, then against front workers.
server = both_fronts("one_front_server", "_workers_process")


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def test_tokenize_detokenize_round_trip(server, model_name):
    text = "Héllo wörld — RL in 2026 🚀\n\tdef f(): return 42"
    tok = post(server, "/tokenize", {"model": model_name, "prompt": text})
    assert tok.status_code == 200, tok.text
    tokens = tok.json()["tokens"]
    assert tok.json()["count"] == len(tokens) > 5
    detok = post(server, "/detokenize", {"model": model_name, "tokens": tokens})
    assert detok.status_code == 200, detok.text
    assert detok.json()["prompt"] == text


def test_generate_returns_token_ids_and_logprobs(server, model_name):
    headers = {"X-Session-ID": "token-route"}
    prompt = "The quick brown fox"
    prompt_ids = post(server, "/tokenize", {"model": model_name, "prompt": prompt}).json()["tokens"]
    gen = post(
        server,
        "/inference/v1/generate",
        {
            "token_ids": prompt_ids,
            "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 1, "ignore_eos": True},
        },
        headers=headers,
    )
    assert gen.status_code == 200, gen.text
    choice = gen.json()["choices"][0]
    ids = choice["token_ids"]
    assert len(ids) == 12 and all(isinstance(t, int) and 0 <= t < 2048 for t in ids)
    assert choice["finish_reason"] == "length"
    entries = choice["logprobs"]["content"]
    assert [e["token_id"] for e in entries] == ids
    assert all(e["logprob"] <= 0 for e in entries)

    # The same greedy request through the text route yields the same tokens.
    comp = post(
        server,
        "/v1/completions",
        {
            "model": model_name,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        headers=headers,
    )
    assert engine_of(comp) == engine_of(gen)
    assert comp.json()["choices"][0]["token_ids"] == ids


@pytest.mark.parametrize("bad", [{"token_ids": []}, {"token_ids": [-1, 3]}, {"token_ids": "abc"}, {}])
def test_generate_rejects_bad_token_input(server, bad):
    r = post(server, "/inference/v1/generate", {**bad, "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400
