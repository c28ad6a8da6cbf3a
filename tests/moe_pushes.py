"""Mixture-of-experts fleets for tests: a server of a tiny random MoE checkpoint, what its fresh
engines served, pushes by a real trainer process, and judgement against transformers float32."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pushes import PROMPTS, fleet_checksums, greedy_completion, run_trainer, save, sessions_per_engine
from support import ServerProcess


class MoeFleet:
    """One MoE server, the checkpoint it started from, and what its fresh engines served."""

    def __init__(self, server: ServerProcess, model_dir: Path):
        self.server = server
        self.model_dir = model_dir
        self.sessions = sessions_per_engine(server, server.model)
        self.checkpoint = {name: t.float() for name, t in load_file(model_dir / "model.safetensors").items()}
        self.fresh = self.served()  # before any push

    def served(self) -> dict[int, list[list[float]]]:
        """Per engine, per prompt: the prompt tokens' logprobs, 12 greedy tokens' logprobs, then their ids."""
        return {
            engine: [self._logprobs(prompt, session) for prompt in PROMPTS] for engine, session in self.sessions.items()
        }

    def _logprobs(self, prompt: str, session: str) -> list[float]:
        r = greedy_completion(self.server, self.server.model, prompt, session, max_tokens=12, prompt_logprobs=0)
        choice = r.json()["choices"][0]
        prompt_part = [next(iter(entry.values()))["logprob"] for entry in choice["prompt_logprobs"][1:]]
        return prompt_part + choice["logprobs"]["token_logprobs"] + [float(t) for t in choice["token_ids"]]

    def push(self, weights: dict[str, torch.Tensor], version: str, tmp_path: Path, *how: str) -> None:
        self.push_file(save(weights, tmp_path / f"{version}.safetensors"), version, *how)

    def push_file(self, weights_file: Path, version: str, *how: str) -> None:
        """A trainer process pushes ``weights_file``'s tensors (``how``: its options) as ``version``."""
        done = run_trainer(self.server, weights_file, version, *how)
        assert done.returncode == 0 and f"pushed {version}" in done.stdout, done.stdout + done.stderr

    def modified(self, seed: int) -> dict[str, torch.Tensor]:
        """The checkpoint's weights with experts scaled (1, 6) and re-drawn (2, 3), the router and the shared expert moved."""
        g = torch.Generator().manual_seed(seed)
        weights = {}
        for name, tensor in self.checkpoint.items():
            t = tensor.clone()
            if ".experts.1." in name or "shared_expert." in name:
                t *= 1.5
            elif ".experts.6." in name:
                t *= 0.5
            elif ".experts.3.down_proj" in name or ".experts.2.gate_proj" in name:
                t = torch.randn(t.shape, generator=g) * 0.25
            elif name.endswith("mlp.gate.weight") or "embed_tokens" in name:
                t += torch.randn(t.shape, generator=g) * 0.1
            weights[name] = t.contiguous()
        return weights

    def assert_matches_transformers(self, weights: dict[str, torch.Tensor], tmp_path: Path) -> None:
        """Every engine's greedy tokens and logprobs within 0.05 of transformers float32 on ``weights``."""
        model = transformers_model(self.model_dir, weights, tmp_path)
        for engine, per_prompt in self.served().items():
            for prompt, served in zip(PROMPTS, per_prompt):
                ids = httpx.post(
                    f"{self.server.url}/tokenize", json={"model": self.server.model, "prompt": prompt}, timeout=30
                ).json()["tokens"]
                generated = [int(t) for t in served[-12:]]
                with torch.no_grad():
                    logprobs = model(torch.tensor([ids + generated])).logits[0].log_softmax(-1)
                expected = [logprobs[i, token].item() for i, token in enumerate((ids + generated)[1:])]
                got = served[:-12]
                diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
                assert diff < 0.05, f"engine {engine}, {prompt!r}: logprobs differ from transformers by {diff:.4f}"

    def assert_staged_lands_as_live(
        self, new: dict[str, torch.Tensor], tmp_path: Path, back: dict[str, torch.Tensor] | None = None
    ) -> None:
        """A live push of ``new`` and a staged push of it leave the same weights (vLLM's checksums of
        every tensor the workers compute with), other than the fresh engines'; ``back`` (the
        checkpoint's weights, as pushed) is pushed back after each."""
        back = self.checkpoint if back is None else back
        fresh = fleet_checksums(self.server)
        self.push(new, "live-new", tmp_path)
        live = fleet_checksums(self.server)
        self.push(back, "live-back", tmp_path)
        assert fleet_checksums(self.server) == fresh
        self.push(new, "staged-new", tmp_path, "--staged")
        staged = fleet_checksums(self.server)
        assert staged.keys() == live.keys() and [k for k in live if staged[k] != live[k]] == []
        assert live != fresh
        self.push(back, "staged-back", tmp_path, "--staged")
        self.assert_serves_fresh()

    def assert_serves_fresh(self) -> None:
        assert_same(self.served(), self.fresh)

    def restore(self) -> None:
        r = httpx.post(f"{self.server.url}/reload_weights", timeout=300)
        assert r.status_code == 200, r.text


def transformers_model(model_dir: Path, weights: dict[str, torch.Tensor], tmp_path: Path):
    """transformers' model of ``model_dir`` holding ``weights`` (named as the checkpoint stores
    them: one tensor per expert, which transformers fuses as it loads)."""
    directory = tmp_path / "reference"
    directory.mkdir(exist_ok=True)
    shutil.copy(model_dir / "config.json", directory / "config.json")
    save({**weights}, directory / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def assert_same(got: dict, expected: dict, tolerance: float = 1e-6) -> None:
    for engine in expected:
        for prompt, a, b in zip(PROMPTS, got[engine], expected[engine], strict=True):
            assert len(a) == len(b), f"engine {engine}, {prompt!r}: {len(a)} values, {len(b)} expected"
            diff = max(abs(x - y) for x, y in zip(a, b))
            assert diff <= tolerance, f"engine {engine}, {prompt!r}: differs by {diff:.6f}"
