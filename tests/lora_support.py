"""Real PEFT LoRA adapters on the demo model, and what transformers + peft make of them (float32)."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pushes import greedy_completion
from support import engine_of

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Long enough to fill a KV block (128 tokens on CPU): only whole blocks are cached, so a
# stale-cache bug shows only on a prompt this long.
LONG_PROMPT = " ".join(f"word{i % 97} alpha beta" for i in range(60))
PROMPTS = ["The quick brown fox", LONG_PROMPT]


def make_adapter(demo_model: Path, directory: Path, seed: int, rank: int = 8, targets: list[str] = ALL_LINEAR) -> Path:
    """A LoRA adapter made with peft: random A and B (PEFT's zero B would change nothing), then
    one real AdamW step on a language-modelling loss; saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, base.config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.save_pretrained(directory)
    return directory


def write_adapter(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter directory written by hand (for adapters peft would not make: wrong shapes)."""
    import json

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def reference_logprobs(
    demo_model: Path, adapter: Path | None, prompt_ids: list[int], out_ids: list[int]
) -> list[float]:
    """Each out token's logprob under transformers (+ peft with ``adapter``), float32."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, tok].item() for i, tok in enumerate(out_ids)]


def complete(server, model: str, prompt: str, session: str, max_tokens: int = 12) -> httpx.Response:
    return greedy_completion(server, model, prompt, session, max_tokens)


def served_vs_reference(
    server, base_model: str, demo_model: Path, model: str, adapter: Path | None, prompt: str, session: str
) -> tuple[float, httpx.Response]:
    """The largest logprob difference between what ``model`` serves and the reference of ``adapter``."""
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"model": base_model, "prompt": prompt}, timeout=30).json()[
        "tokens"
    ]
    r = complete(server, model, prompt, session)
    choice = r.json()["choices"][0]
    expected = reference_logprobs(demo_model, adapter, prompt_ids, choice["token_ids"])
    got = choice["logprobs"]["token_logprobs"]
    return max(abs(a - b) for a, b in zip(got, expected, strict=True)), r


def assert_serves(server, base_model, demo_model, model, adapter, version, sessions: dict[int, str]) -> None:
    """On every engine (``sessions``: one sticky session each), ``model`` serves ``adapter``'s
    weights under ``version``, within 0.05 of the reference on every prompt."""
    for engine, session in sessions.items():
        for prompt in PROMPTS:
            diff, r = served_vs_reference(server, base_model, demo_model, model, adapter, prompt, session)
            assert engine_of(r) == engine
            assert r.headers["X-Weight-Version"] == version
            assert diff < 0.05, (
                f"engine {engine}, {model} ({version}), prompt {prompt[:20]!r}: logprobs differ by {diff:.4f}"
            )
