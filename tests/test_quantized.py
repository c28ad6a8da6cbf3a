"""Pushes into int8 engines (issue 49): the demo model quantized offline to int8 W8A8
(compressed-tensors: per-channel int8 weights with float32 scales, activations quantized per token
as the engine runs), served by two engines in the dtype this machine's CPU computes int8 layers in:
float32 through oneDNN on cores without AMX, bfloat16 through SGLang's AMX kernel on cores with it
(which takes no float32; skyinfer refuses that at start: tests/test_layout.py).

After a push, every engine must serve what a fresh engine loaded from the same int8 weights serves,
bit for bit (prompt and greedy logprobs, 1e-6): a push of the checkpoint's own weights changes
nothing; new weights serve as an engine started on them; the first weights pushed back serve as the
fresh engines did; by pause-push and by a staged push; from int8 weights the trainer holds, or from
full-precision weights the trainer's helpers quantize as it pushes."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from skyinfer.demo_model import build_demo_int8_model
from skyinfer.transfer.quantize import quantize_w8a8_int8

from forked_python import ForkedPopen
from moe_pushes import MoeFleet, assert_same
from pushes import (
    PROMPTS,
    adamw_step,
    fleet_checksums,
    modified_weights,
    pushed_bytes,
    run_trainer,
    save,
    sessions_per_engine,
)
from support import NO_SPARES, TRAINER, ServerProcess, is_openai_error, module_servers, vllm_process


def new_full_precision(demo_model: Path) -> dict[str, torch.Tensor]:
    """The bf16 weights a trainer holds after a step: what the "new" int8 checkpoint is quantized from."""
    return {name: t.to(torch.bfloat16) for name, t in modified_weights(demo_model, seed=5).items()}


# What the machine has, as torch (and so vLLM's kernel choice) sees it.
INT8_DTYPE = "bfloat16" if torch.cpu._is_amx_tile_supported() else "float32"


def _int8_fleet(model: Path, log_path: Path, engines: int, *more: str) -> ServerProcess:
    # A killed trainer's collective ends with the group's timeout.
    extra = ("--dtype", INT8_DTYPE, "--hold-requests", "1", "--weight-transfer-timeout", "30", *more)
    return ServerProcess(model, engines=engines, log_path=log_path, extra_args=extra)


def _launch(demo_model: Path, logs: Path) -> dict[str, ServerProcess]:
    """Two engines of the int8 demo model, and one engine started on the int8 weights a push brings:
    what the pushed engines must serve."""
    checkpoint = build_demo_int8_model(logs / "int8")
    new = logs / "int8-new"
    shutil.copytree(checkpoint, new)
    save_file(dict(quantize_w8a8_int8(new_full_precision(demo_model))), str(new / "model.safetensors"))
    return {
        "fleet": _int8_fleet(checkpoint, logs / "fleet.log", 2),
        # Colocated (sleep mode, shared-memory pushes): the module's last test pushes into it, once it judged the rest.
        "fresh_on_new": _int8_fleet(new, logs / "fresh-on-new.log", 1, "--colocate", *NO_SPARES),
    }


int8_servers = module_servers(__name__, _launch)


# MoeFleet holds a server's fresh answers (prompt and greedy logprobs, per engine) and pushes by a
# trainer process: nothing of it but ``modified`` is about experts.
@pytest.fixture(scope="module")
def fleet(int8_servers) -> MoeFleet:
    return MoeFleet(int8_servers["fleet"], Path(int8_servers["fleet"].model))


@pytest.fixture(scope="module")
def served_on_new(int8_servers, fleet) -> dict[int, list[list[float]]]:
    """What an engine started on the new int8 weights serves, as each of the fleet's engines must after their push."""
    (fresh,) = MoeFleet(int8_servers["fresh_on_new"], Path(int8_servers["fresh_on_new"].model)).fresh.values()
    return {engine: fresh for engine in fleet.sessions}


def int8_file(model_dir: Path) -> Path:
    return model_dir / "model.safetensors"


def test_the_fresh_int8_engines_serve_and_say_what_a_push_must_carry(fleet, served_on_new):
    """The ground the other tests stand on: the int8 engines serve (finite), and the new weights
    serve something else than the checkpoint's; ``/weight_info`` says what a push must carry,
    ``/engines`` and ``/server_info`` what each engine serves (what a TIS correction is told)."""
    quantization = httpx.get(f"{fleet.server.url}/weight_info", timeout=60).json()["quantization"]
    assert quantization["method"] == "compressed-tensors" and quantization["format"] == "int-quantized", quantization
    assert "with its scale" in quantization["push"] and quantization["trainer_scheme"] == "w8a8_int8", quantization
    assert [e["quantization"] for e in fleet.server.engines()] == ["compressed-tensors"] * 2
    # What each engine serves quantized, as it reports it: q/k/v, o, gate/up and down of both layers.
    assert [e["quantized_layers"] for e in fleet.server.engines()] == [8, 8]
    server_info = httpx.get(f"{fleet.server.url}/server_info", timeout=60).json()
    assert "quantization=compressed-tensors" in server_info["vllm_config"], server_info["vllm_config"][:2000]
    for per_prompt in (*fleet.fresh.values(), *served_on_new.values()):
        assert all(torch.isfinite(torch.tensor(values)).all() for values in per_prompt)
    with pytest.raises(AssertionError):
        assert_same(served_on_new, fleet.fresh)


def w8a8_reference(demo_model: Path, int8_weights: dict[str, torch.Tensor]):
    """transformers float32 computing as W8A8 does: the int8 weights times their scales, and each
    quantized layer's input rounded to int8 per token (symmetric, max |x| / 127)."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    dequantized = {
        name: t.float() * int8_weights[name + "_scale"] for name, t in int8_weights.items() if t.dtype == torch.int8
    }
    model.load_state_dict(dequantized, strict=False)

    def quantize_input(module, args):
        (x,) = args
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-12)
        return (torch.round(x / scale).clamp(-128, 127) * scale,)

    for name, module in model.named_modules():
        if name + ".weight" in dequantized:
            module.register_forward_pre_hook(quantize_input)
    return model


def test_the_int8_engines_compute_w8a8_and_their_gap_to_full_precision_is_measured(fleet, demo_model):
    """The int8 engine's greedy logprobs against transformers computing W8A8 on the same int8
    weights (within 0.05), and, for truncated importance sampling (docs: guides/quantized),
    against transformers float32 on the full-precision weights they were quantized from (printed)."""
    w8a8 = w8a8_reference(demo_model, load_file(int8_file(fleet.model_dir)))
    full = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    to_w8a8, to_full = [], []
    for prompt, served in zip(PROMPTS, fleet.fresh[0]):
        ids = httpx.post(
            f"{fleet.server.url}/tokenize", json={"model": fleet.server.model, "prompt": prompt}, timeout=30
        ).json()["tokens"]
        out_ids = [int(t) for t in served[-12:]]
        got = served[-24:-12]
        for model, gaps in ((w8a8, to_w8a8), (full, to_full)):
            with torch.no_grad():
                logprobs = model(torch.tensor([ids + out_ids])).logits[0].log_softmax(-1)
            expected = [logprobs[len(ids) - 1 + i, token].item() for i, token in enumerate(out_ids)]
            gaps += [abs(a - b) for a, b in zip(got, expected, strict=True)]
    mean_w8a8, mean_full = sum(to_w8a8) / len(to_w8a8), sum(to_full) / len(to_full)
    print(
        f"\nint8 W8A8 engine, greedy logprobs: to transformers computing W8A8 max gap {max(to_w8a8):.4f},"
        f" mean {mean_w8a8:.4f}; to transformers float32 on the full-precision weights max"
        f" {max(to_full):.4f}, mean {mean_full:.4f}"
    )
    assert mean_w8a8 < 0.75 * mean_full and max(to_full) < 5


@pytest.mark.parametrize("how", [(), ("--staged",)], ids=["pause-push", "staged"])
def test_a_push_of_the_checkpoints_own_int8_weights_changes_nothing(fleet, how, tmp_path):
    fleet.push_file(int8_file(Path(fleet.model_dir)), "same", *how)
    fleet.assert_serves_fresh()
    if not how:  # int8 layers are processed after loading: reloaded as vLLM reloads a layer
        last = httpx.get(f"{fleet.server.url}/weight_info", timeout=60).json()["last_push"]
        assert last["weight_version"] == "same" and last["applied"] == "layerwise reload", last


@pytest.mark.parametrize("how", [(), ("--staged",)], ids=["pause-push", "staged"])
def test_new_int8_weights_serve_as_an_engine_started_on_them_and_the_first_come_back(
    fleet, served_on_new, int8_servers, how
):
    """Bit for bit: vLLM's CPU int8 kernel keeps a pointer to the weight scales it was built with,
    which the reload frees as it puts the layer's old tensors back (NaN or another layer's numbers
    served, without an error, before skyinfer kept them)."""
    fleet.push_file(int8_file(Path(int8_servers["fresh_on_new"].model)), "new", *how)
    assert_same(fleet.served(), served_on_new)
    fleet.push_file(int8_file(fleet.model_dir), "back", *how)
    fleet.assert_serves_fresh()


def test_a_staged_push_leaves_the_weights_a_live_push_of_the_same_weights_leaves(fleet, int8_servers, tmp_path):
    """vLLM's checksums of every tensor the workers hold (the scales, and the weights where the
    kernel keeps them as parameters) after a live and a staged push of the new int8 weights."""
    new = load_file(int8_file(Path(int8_servers["fresh_on_new"].model)))
    fleet.assert_staged_lands_as_live(new, tmp_path, back=load_file(int8_file(fleet.model_dir)))


def test_the_weights_served_after_pushes_hold_through_many_steps(fleet, int8_servers):
    """Freed memory is reused: answers after several pushes and many decode steps still equal the
    fresh engines' (a dangling scale shows once the allocator hands its memory out again)."""
    for version in ("churn-1", "churn-2", "churn-3"):
        fleet.push_file(int8_file(Path(int8_servers["fresh_on_new"].model)), version)
        fleet.push_file(int8_file(fleet.model_dir), version + "-back")
    for _ in range(3):
        httpx.post(
            f"{fleet.server.url}/v1/completions",
            json={"model": fleet.server.model, "prompt": "churn " * 50, "max_tokens": 64, "n": 4},
            timeout=120,
        ).raise_for_status()
    fleet.assert_serves_fresh()


def test_a_trainer_holding_bf16_weights_pushes_them_quantized_and_they_land_exact(
    fleet, served_on_new, demo_model, tmp_path
):
    """The trainer pushes its bf16 weights as they are: ``/weight_info`` names the engines' scheme,
    skyinfer's trainer quantizes to it as it pushes (``quantize_w8a8_int8``: the linear layers in
    about half of their bf16 bytes), and the push equals an engine started on the same quantization."""
    full_precision = new_full_precision(demo_model)
    quantized = dict(quantize_w8a8_int8(full_precision))
    linear = [name for name in full_precision if name + "_scale" in quantized]
    int8_bytes = sum(quantized[n].nbytes + quantized[n + "_scale"].nbytes for n in linear)
    assert int8_bytes < 0.55 * sum(full_precision[n].nbytes for n in linear)
    fleet.push_file(save(full_precision, tmp_path / "bf16.safetensors"), "quantized-by-the-trainer")
    assert_same(fleet.served(), served_on_new)
    fleet.push_file(int8_file(fleet.model_dir), "back")
    fleet.assert_serves_fresh()


def test_a_delta_push_after_an_optimizer_step_lands_what_a_dense_push_of_the_same_weights_lands(
    fleet, served_on_new, demo_model
):
    """The trainer holds bf16 weights and steps them: GlooTrainer quantizes each push and compares
    after quantizing, so a delta carries the int8 values, scales and biases the step changed. The
    int8 layers' kernels hold their own layout: each worker applies the delta to the copy of the
    checkpoint's tensors it kept from the push before and reloads every layer it touches from it.
    After one AdamW step at 1e-6 (the biases and the embedding change), then one at 1e-4 with one
    row's largest weight doubled (int8 values and that row's scale change), vLLM's checksums equal
    a dense push's of the same weights; the first weights, pushed back by a delta, serve as an
    engine started on them does."""
    from skyinfer.client import Client
    from skyinfer.trainer import GlooTrainer

    first = new_full_precision(demo_model)
    small = adamw_step(first)
    large = adamw_step(small, lr=1e-4)
    row = large["model.layers.1.mlp.down_proj.weight"][0]
    row[0] = 2 * row.abs().max()
    quantized = [dict(quantize_w8a8_int8(w)) for w in (first, small, large)]
    int8_changed = sum(
        int((quantized[2][n] != quantized[1][n]).sum()) for n in quantized[1] if n.endswith("proj.weight")
    )
    scales_changed = [
        n for n in quantized[1] if n.endswith("_scale") and not torch.equal(quantized[1][n], quantized[2][n])
    ]
    assert int8_changed > 0 and scales_changed == ["model.layers.1.mlp.down_proj.weight_scale"], scales_changed
    with Client(fleet.server.url) as client:
        trainer = GlooTrainer(fleet.server.url, timeout_s=60, client=client)
        trainer.init()
        dense = pushed_bytes(trainer, first, "int8-delta-0")["dense"]
        assert_same(fleet.served(), served_on_new)
        at_first = fleet_checksums(fleet.server)
        assert pushed_bytes(trainer, small, "int8-delta-1")["sent"] < dense / 10
        by_small_delta = fleet_checksums(fleet.server)
        assert pushed_bytes(trainer, large, "int8-delta-2")["sent"] < dense / 3
        by_large_delta = fleet_checksums(fleet.server)
        assert len({*map(str, (at_first, by_small_delta, by_large_delta))}) == 3
        assert pushed_bytes(trainer, first, "int8-delta-3")["sent"] < dense / 3
        assert fleet_checksums(fleet.server) == at_first
        assert_same(fleet.served(), served_on_new)

        whole = GlooTrainer(fleet.server.url, timeout_s=60, client=client, delta=False)
        whole.init()
        assert pushed_bytes(whole, small, "int8-dense-1")["sent"] == dense
        assert fleet_checksums(fleet.server) == by_small_delta
        pushed_bytes(whole, large, "int8-dense-2")
        assert fleet_checksums(fleet.server) == by_large_delta
    fleet.push_file(int8_file(fleet.model_dir), "back")
    fleet.assert_serves_fresh()


def test_a_push_that_does_not_fit_the_int8_model_is_refused_before_any_byte_moves(fleet, demo_model, tmp_path):
    """400, naming the tensor: full precision where the engine keeps int8, a weight without its
    scale, a scale of the wrong shape or of an integer dtype; every engine serves as it did."""
    checkpoint = load_file(int8_file(fleet.model_dir))
    weight = "model.layers.0.self_attn.q_proj.weight"
    scale = weight + "_scale"
    cases = {
        "full precision": (
            {**checkpoint, weight: checkpoint[weight].float() * checkpoint[scale]},
            f"{weight!r}",
        ),
        "no scale": ({n: t for n, t in checkpoint.items() if n != scale}, scale),
        "scale's shape": ({**checkpoint, scale: checkpoint[scale].reshape(1, -1).contiguous()}, f"{scale!r}"),
        "scale's dtype": ({**checkpoint, scale: torch.ones_like(checkpoint[scale], dtype=torch.int32)}, f"{scale!r}"),
    }
    for case, (weights, said) in cases.items():
        done = run_trainer(fleet.server, save(weights, tmp_path / "refused.safetensors"), "refused", "--as-is")
        assert done.returncode == 3 and "refused 400" in done.stdout and said in done.stdout, (case, done.stdout)
    info = httpx.get(f"{fleet.server.url}/weight_info", timeout=60).json()
    assert info["update_phase"] == "idle" and [e["stale_reason"] for e in info["engines"]] == [None, None], info
    fleet.assert_serves_fresh()


def test_a_staged_push_of_part_of_an_int8_layer_is_refused_and_every_engine_serves_as_before(fleet, tmp_path):
    """A staged push whose start names no tensors (as vLLM's client starts one) and whose chunks
    carry q of layer 0's q/k/v, with its scale, and nothing of k and v: each chunk fits, and only
    once all came is the layer known to be part of a push. Refused before the swap, naming it: no
    engine swapped anything in, each serves what it served, as before, under its version."""
    before = httpx.get(f"{fleet.server.url}/weight_info", timeout=60).json()["weight_version"]
    new = load_file(int8_file(fleet.model_dir))
    q = "model.layers.0.self_attn.q_proj.weight"
    part = {q: new[q], q + "_scale": new[q + "_scale"] * 2}
    done = run_trainer(
        fleet.server, save(part, tmp_path / "part.safetensors"), "part-of-qkv", "--staged", "--start-names-nothing"
    )
    assert done.returncode == 3 and "refused 400" in done.stdout, done.stdout + done.stderr
    assert "not swapped in" in done.stdout and "self_attn.qkv_proj" in done.stdout, done.stdout
    info = httpx.get(f"{fleet.server.url}/weight_info", timeout=60).json()
    assert info["update_phase"] == "idle" and info["weight_version"] == before, info
    assert [(e["state"], e["weight_version"]) for e in info["engines"]] == [("ready", before)] * 2, info
    fleet.assert_serves_fresh()


def wait_states(fleet: MoeFleet, states: list[str], timeout_s: float = 240, new_pid: tuple[int, int] | None = None):
    """The engines once in ``states`` (and engine ``new_pid[0]`` in another process than ``new_pid[1]``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        engines = fleet.server.engines()
        if [e["state"] for e in engines] == states and (new_pid is None or engines[new_pid[0]]["pid"] != new_pid[1]):
            return engines
        assert time.monotonic() < deadline, engines
        time.sleep(0.5)


def completion_status(fleet: MoeFleet) -> int:
    body = {"model": fleet.server.model, "prompt": "x", "max_tokens": 2}
    return httpx.post(f"{fleet.server.url}/v1/completions", json=body, timeout=60).status_code


def test_an_engine_core_killed_after_a_push_cannot_catch_up_and_waits_for_the_next_push(
    fleet, served_on_new, int8_servers
):
    """Engine 1's EngineCore is SIGKILLed after a push of new weights: it restarts from the
    checkpoint on disk. A peer's catch-up copies the tensors a worker holds, and vLLM's CPU int8
    kernel holds its weights in a form of its own (only inside its oneDNN handler on cores without
    AMX: copying the rest would serve the checkpoint's weights under the new label). It stays stale, saying why, while engine 0 serves;
    a catch-up asked for is refused 409; the next push brings it in exact."""
    new_file = int8_file(Path(int8_servers["fresh_on_new"].model))
    fleet.push_file(new_file, "before-the-kill")
    before = fleet.server.engines()
    vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
    engines = wait_states(fleet, ["ready", "stale"], new_pid=(1, before[1]["pid"]))
    deadline = time.monotonic() + 60
    while "kernel" not in (reason := fleet.server.engines()[1]["stale_reason"] or ""):
        assert time.monotonic() < deadline, reason
        time.sleep(0.5)
    assert "int8" in reason and engines[0]["pid"] == before[0]["pid"], (reason, engines)
    asked = httpx.post(f"{fleet.server.url}/engines/1/catch_up", timeout=60)
    assert asked.status_code == 409 and is_openai_error(asked) and "kernel" in asked.json()["error"]["message"], (
        asked.text
    )
    fleet.push_file(new_file, "after-the-kill")
    fleet.sessions = sessions_per_engine(fleet.server, fleet.server.model)
    assert_same(fleet.served(), served_on_new)
    fleet.push_file(int8_file(fleet.model_dir), "back")
    fleet.assert_serves_fresh()


def test_a_trainer_killed_halfway_through_a_push_leaves_nothing_wrong_served(fleet, int8_servers):
    """The trainer dies after sending a third of the tensors (some int8 layers without their
    scales): no engine serves those weights, each is stale until the next push, which lands exact."""
    new_file = int8_file(Path(int8_servers["fresh_on_new"].model))
    third = len(load_file(new_file)) // 3
    done = run_trainer(fleet.server, new_file, "half", "--die-after", str(third))
    assert done.returncode == 9, done.stdout + done.stderr
    wait_states(fleet, ["stale", "stale"], timeout_s=120)
    assert completion_status(fleet) == 503
    fleet.push_file(int8_file(fleet.model_dir), "after-the-dead-trainer")
    fleet.assert_serves_fresh()


# A trainer that sends two tensors and hangs, its group's collectives bounded by 600 s.
HUNG_FOR_600_S = ("--hang-after", "2", "--timeout", "600")


def test_an_engine_core_killed_mid_receive_leaves_nothing_wrong_served(fleet, served_on_new, int8_servers):
    """The trainer has sent two tensors and hangs, holding the transfer open (its group's timeout
    600 s), when engine 1's EngineCore is SIGKILLed: the update is aborted on every engine at once.
    Engine 1 comes back in a new process while engine 0's workers are still inside the hung
    trainer's collective (its restart does not wait for them); both serve nothing (stale) until the
    next push; the trainer's death ends engine 0's part; the next push lands exact."""
    new_file = int8_file(Path(int8_servers["fresh_on_new"].model))
    before = fleet.server.engines()
    trainer = ForkedPopen(
        [TRAINER, fleet.server.url, str(new_file), "never-served", *HUNG_FOR_600_S],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "hanging"
        vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
        wait_states(fleet, ["receiving", "stale"], new_pid=(1, before[1]["pid"]))
        weight_info = httpx.get(f"{fleet.server.url}/weight_info", headers=fleet.server.admin_headers, timeout=60)
        assert weight_info.json()["update_phase"] == "idle"
        assert completion_status(fleet) == 503
    finally:
        trainer.kill()
        trainer.wait()
    wait_states(fleet, ["stale", "stale"])
    assert fleet.server.engines()[0]["pid"] == before[0]["pid"]
    assert completion_status(fleet) == 503
    fleet.push_file(new_file, "after-the-kill")
    fleet.sessions = sessions_per_engine(fleet.server, fleet.server.model)
    assert_same(fleet.served(), served_on_new)
    fleet.push_file(int8_file(fleet.model_dir), "back")
    fleet.assert_serves_fresh()


def test_colocated_pushes_into_an_int8_engine_land_exact(int8_servers, fleet, served_on_new, demo_model, tmp_path):
    """The colocated path (shared memory; the engine asleep around the push, as SkyRL's colocated
    trainer puts it), into the colocated engine started on the new weights, once it judged the
    other tests: after a level-2 sleep (its weights discarded) the checkpoint's int8 weights, and it
    serves what the fleet's fresh engines served; after a level-1 sleep the trainer's bf16 weights,
    quantized as they are pushed, and it serves what it served fresh."""
    judge = MoeFleet(int8_servers["fresh_on_new"], Path(int8_servers["fresh_on_new"].model))
    assert_same(judge.fresh, {0: served_on_new[0]})
    shm = ("--transport", "shm")
    judge.push_file(int8_file(fleet.model_dir), "colocated-checkpoint", *shm, "--colocated-step", "2")
    assert_same(judge.served(), {0: fleet.fresh[0]})
    bf16 = save(new_full_precision(demo_model), tmp_path / "bf16.safetensors")
    judge.push_file(bf16, "colocated-quantized-by-the-trainer", *shm, "--colocated-step", "1")
    judge.assert_serves_fresh()
