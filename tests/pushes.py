"""Pushing weights into test servers with a real trainer process, and judging what engines serve
against a transformers float32 forward pass of the same weights."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from forked_python import ForkedPopen, run_python
from support import TRAINER, engine_of

PROMPTS = ["The quick brown fox", "Reinforcement learning updates a policy", "def main():"]


def modified_weights(demo_model: Path, seed: int) -> dict[str, torch.Tensor]:
    """The demo model's weights, float32, with some scaled, some re-randomized, the embeddings changed."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in model.state_dict().items():
        t = tensor.clone()
        if "layers.0.self_attn.q_proj" in name or "layers.1.mlp.up_proj" in name:
            t *= 1.25 + 0.25 * seed
        elif "layers.1.mlp.down_proj.weight" in name or "layers.0.self_attn.o_proj" in name:
            t = torch.randn(t.shape, generator=g) * 0.2
        elif "embed_tokens" in name:
            t += torch.randn(t.shape, generator=g) * 0.1
        weights[name] = t.contiguous()
    weights.pop("lm_head.weight", None)  # tied to the embeddings
    return weights


def adamw_step(weights: dict[str, torch.Tensor], seed: int = 3, lr: float = 1e-6) -> dict[str, torch.Tensor]:
    """``weights`` after one AdamW step at ``lr`` (gradients drawn at random), in their own dtype:
    in bfloat16, at 1e-6, few of their bits change."""
    params = {name: torch.nn.Parameter(t.clone()) for name, t in weights.items()}
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    torch.optim.AdamW(params.values(), lr=lr).step()
    return {name: p.detach().clone() for name, p in params.items()}


def changed_elements(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    """How many elements of ``b`` differ from ``a``'s bit for bit (tensors of 2-byte dtypes)."""
    return sum(int((b[n].view(torch.int16) != a[n].view(torch.int16)).sum()) for n in a)


def pushed_bytes(trainer, weights: dict[str, torch.Tensor], version: str) -> dict:
    """``trainer`` (in this process) pushes ``weights`` as ``version`` in one call: the bytes
    ``/weight_info`` says it sent, against the tensors' dense size."""
    trainer.push(list(weights.items()), version, one_call=True)
    last = trainer.client.weight_info()["last_push"]
    assert last["weight_version"] == version, last
    return last["bytes"]


def save(weights: dict[str, torch.Tensor], path: Path) -> Path:
    save_file(weights, str(path))
    return path


def run_trainer(
    server, weights_file: Path, version: str, *extra: str, timeout_s: float = 180, url: str | None = None
) -> subprocess.CompletedProcess:
    """The trainer as a separate process; ``url`` may list several nodes, comma-separated."""
    return run_python(
        [TRAINER, url or server.url, str(weights_file), version, *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_trainer(server, weights_file: Path, version: str, *extra: str) -> subprocess.Popen:
    """The trainer as a separate process that stays up (``--more``, ``--hold-before-update``): its
    stdin, stdout and stderr are text pipes."""
    return ForkedPopen(
        [TRAINER, server.url, str(weights_file), version, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def push_more(trainer: subprocess.Popen, path: Path, version: str) -> None:
    """One more push from a trainer started with ``--more``, answered before this returns."""
    trainer.stdin.write(f"{path} {version}\n")
    trainer.stdin.flush()
    assert trainer.stdout.readline().split() == ["pushed", version]


def two_pushes_into_one_segment(
    server, demo_model: Path, pushes, transport: str, check: Callable[[str], None] = lambda segment: None
) -> tuple[subprocess.Popen, str]:
    """One trainer process (``--more``) pushes twice through ``transport`` (``pushes.next()`` gives
    each push's weights): its first push makes its segment in /dev/shm; the second writes other
    weights into the same file (same name, same inode), which the server left in place; every
    engine serves each push exactly, ``check(segment)`` after each. The trainer, still up, and the
    segment's path."""
    weights, path, version = pushes.next()
    trainer = start_trainer(server, path, version, "--transport", transport, "--more")
    assert trainer.stdout.readline().split() == ["pushed", version], trainer.stderr.read()
    [segment] = server.shm_files("pushes")
    inode = os.stat(segment).st_ino
    assert_engines_match(server, server.model, demo_model, weights, version)
    check(segment)
    weights, path, version = pushes.next()
    push_more(trainer, path, version)
    assert server.shm_files("pushes") == [segment] and os.stat(segment).st_ino == inode
    assert_engines_match(server, server.model, demo_model, weights, version)
    check(segment)
    return trainer, segment


def reference_logprobs(
    demo_model: Path, weights: dict[str, torch.Tensor], prompt_ids: list[int], out_ids: list[int]
) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, tok].item() for i, tok in enumerate(out_ids)]


def sessions_per_engine(server, model_name) -> dict[int, str]:
    engines = len(server.engines())
    found: dict[int, str] = {}
    for i in range(20):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model_name, "prompt": "x", "max_tokens": 1},
            headers={"X-Session-ID": f"ws-{i}"},
            timeout=60,
        )
        found.setdefault(engine_of(r), f"ws-{i}")
    assert set(found) == set(range(engines))
    return found


def greedy_completion(
    server, model_name: str, prompt: str, session: str, max_tokens: int = 16, **more
) -> httpx.Response:
    """A greedy completion of ``prompt`` with its token ids and logprobs, on ``session``'s engine
    (``more``: other fields of the request)."""
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
            **more,
        },
        headers={"X-Session-ID": session},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def assert_engines_match(server, model_name, demo_model, weights, version):
    for engine, session in sessions_per_engine(server, model_name).items():
        for prompt in PROMPTS:
            prompt_ids = httpx.post(
                f"{server.url}/tokenize", json={"model": model_name, "prompt": prompt}, timeout=30
            ).json()["tokens"]
            r = greedy_completion(server, model_name, prompt, session)
            assert engine_of(r) == engine
            assert r.headers["X-Weight-Version"] == version
            choice = r.json()["choices"][0]
            expected = reference_logprobs(demo_model, weights, prompt_ids, choice["token_ids"])
            got = choice["logprobs"]["token_logprobs"]
            diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
            assert diff < 0.05, f"engine {engine}, {prompt!r}: logprobs differ by {diff:.4f}"


def fleet_checksums(server) -> dict[str, str]:
    """vLLM's weight checksums (every tensor a worker computes with), which every engine agrees on."""
    checked = httpx.post(f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=120).json()
    assert checked["agree"] and checked["held_out"] == [], checked
    return checked["checksums"]


def greedy(server, model_name, session: str) -> list[int]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": model_name,
            "prompt": "unchanged?",
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
        },
        headers={"X-Session-ID": session},
        timeout=60,
    )
    return r.json()["choices"][0]["token_ids"]
