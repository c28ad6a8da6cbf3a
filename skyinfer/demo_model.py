"""Build the tiny, deterministic demo checkpoint that tests and the demo serve.

Nothing can be downloaded here, so the model is made from scratch: a Qwen2
architecture small enough to start in vLLM on two CPU cores, with its own
byte-level BPE tokenizer trained offline on a corpus generated below.
The same call always writes the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen2 models use; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# head_dim 64: vLLM's CPU attention kernel rejects smaller heads.
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    # A wide initialisation gives peaked next-token distributions, so greedy
    # decoding is not decided by rounding noise between near-equal logits.
    initializer_range=0.25,
)

_SENTENCES = """\
The quick brown fox jumps over the lazy dog.
Reinforcement learning updates a policy from rewards collected in rollouts.
An inference service keeps many requests in flight and streams tokens back.
The trainer pushes new weights after every step, and the engines pause briefly.
Hello, world! How are you today? I am fine, thank you.
def main():\n    print("hello")\n    return 0
{"role": "user", "content": "What is two plus two?"}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048 65536.
"""


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = _SENTENCES.splitlines()
    words = " ".join(lines).split()
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = list(lines) * 20
    for _ in range(4000):
        # Pseudo-words give BPE enough distinct pairs to fill the vocabulary.
        made = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        out.append(" ".join([rng.choice(words), made, rng.choice(words)]))
    return out


def _build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        # Every id the model can sample must decode to something.
        raise RuntimeError(f"demo tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tokenizer


# Mixtures of experts of the demo model's size (tools and tests of MoE pushes). Qwen3-MoE's
# expert width, 48, is one vLLM's CPU kernel pads (to 64): the padded layout is part of what a push
# must land in. Qwen2-MoE adds a shared expert and its gate beside the routed ones.
MOE_CONFIGS = {
    "qwen3_moe": dict(
        moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False
    ),
    "qwen2_moe": dict(
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


def build_demo_model(out_dir: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write the demo checkpoint (config, safetensors weights, tokenizer) to ``out_dir``.

    ``config_overrides`` change the architecture (e.g. ``num_hidden_layers``)
    for benchmarks that need a bigger model; keep ``head_dim`` at 64.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _write_checkpoint(out_dir, seed, Qwen2Config, Qwen2ForCausalLM, config_overrides)


def build_demo_moe_model(
    out_dir: str | Path, architecture: str = "qwen3_moe", seed: int = 0, **config_overrides
) -> Path:
    """The demo model as a mixture of experts (``MOE_CONFIGS``' architectures), with its tokenizer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    classes = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}
    config_class, model_class = classes[architecture]
    return _write_checkpoint(
        out_dir, seed, config_class, model_class, {**MOE_CONFIGS[architecture], **config_overrides}
    )


def build_demo_int8_model(out_dir: str | Path, seed: int = 0, **config_overrides) -> Path:
    """The demo model (``config_overrides`` as ``build_demo_model``'s) as int8 W8A8 (compressed-tensors,
    per-channel weight scales, dynamic per-token activations): its linear layers quantized by
    ``skyinfer.transfer.quantize``, the rest as built."""
    from safetensors.torch import load_file, save_file

    from .transfer.quantize import W8A8_INT8_CONFIG, quantize_w8a8_int8

    out = build_demo_model(out_dir, seed, **config_overrides)
    weights = load_file(out / "model.safetensors")
    save_file(dict(quantize_w8a8_int8(weights)), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = W8A8_INT8_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _write_checkpoint(out_dir: str | Path, seed: int, config_class, model_class, config_overrides: dict) -> Path:
    import torch
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_build_tokenizer(seed),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    hf_tokenizer.save_pretrained(out)

    eos_id = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = config_class(
        **{**MODEL_CONFIG, **config_overrides}, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None
    )
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        # Sharpens the output distribution (the top logit usually leads by
        # more than bf16 noise), so greedy decoding is reproducible.
        model.model.norm.weight.fill_(4.0)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": pad_id}, indent=2) + "\n"
    )
    return out


def ensure_demo_model(out_dir: str | Path) -> Path:
    """Build the demo model unless ``out_dir`` already holds one."""
    out = Path(out_dir)
    if not (out / "config.json").exists() or not (out / "model.safetensors").exists():
        build_demo_model(out)
    return out
