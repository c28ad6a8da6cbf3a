"""The transports' bodies and the state model, without engines: what each check refuses, the JSON
form of CUDA IPC handles (round trip on CPU, no CUDA needed), and the residency transitions vLLM
makes, mirrored. The real engines' side of all of it is in test_colocated and test_faults."""

from __future__ import annotations

import base64
import json
import os
import random
import re

import attrs
import pytest
import torch
from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo

from skyinfer.config import ServeConfig
from skyinfer.errors import ApiError
from skyinfer.fleet.state import (
    APPLY,
    PAUSE_FOR_PUSH,
    EngineRecord,
    Lifecycle,
    Residency,
    control_targets,
    push_verdict,
)
from skyinfer.transfer import GLOO, IPC, NCCL, SHM
from skyinfer.transfer.ipc import decode_handle, encode_handle
from skyinfer.transfer.protocol import GroupInitInfo, IpcHandle, IpcUpdateInfo, SharedMemoryUpdateInfo
from skyinfer.transfer.shm import layout
from skyinfer.weights.checkpoint import CheckpointSpec
from skyinfer.weights.transports import PICKLED_IPC_FLAG, FrontTransport, TransferRefused
from skyinfer.wire import WireError

# -- residency, as vLLM 0.32's EngineCore and executor move it ---------------------------------


def walk(*calls) -> Residency:
    r = Residency()
    for op, params in calls:
        r = r.after(op, **params)
    return r


def test_residency_follows_vllms_sleep_and_wake_up():
    asleep = walk(("sleep", {"level": 2}))
    assert (asleep.paused, asleep.sleep_level, asleep.asleep, asleep.vllm_is_sleeping) == (
        True,
        2,
        {"weights", "kv_cache"},
        True,
    )
    weights = asleep.after("wake_up", tags=["weights"])
    assert (weights.sleep_level, weights.asleep, weights.weights_awake, weights.paused) == (2, {"kv_cache"}, True, True)
    # Fully awake: the scheduler resumes (vLLM's core does it).
    assert weights.after("wake_up", tags=["kv_cache"]) == Residency()
    # A tag that is not asleep makes vLLM's executor wake nothing; "scheduling" is dropped.
    assert weights.after("wake_up", tags=["weights", "kv_cache"]) == weights
    assert asleep.after("wake_up", tags=["scheduling"]) == asleep
    # Level 0 releases nothing: any wake-up resumes it; a plain pause answers is_sleeping too.
    assert walk(("sleep", {"level": 0})).after("wake_up", tags=["scheduling"]) == Residency()
    assert walk(("pause", {})).vllm_is_sleeping and walk(("pause", {}), ("wake_up", {})) == Residency()
    # Re-read after a failed call: what vLLM's two flags cannot say stands where they agree.
    # (the second argument: what the failed call would have left).
    assert Residency.reread(weights, weights, vllm_paused=True, vllm_sleeping=True) == weights
    assert Residency.reread(weights, Residency(), vllm_paused=False, vllm_sleeping=False) == Residency()
    paused = Residency(paused=True)
    assert Residency.reread(Residency(), paused, vllm_paused=True, vllm_sleeping=True) == paused
    # A sleep that failed may have released its memory: asleep (weights too) until a wake-up, never merely paused.
    slept = Residency().after("sleep", level=1)
    assert Residency.reread(Residency(), slept, vllm_paused=True, vllm_sleeping=True) == slept
    assert not Residency.reread(Residency(), slept, vllm_paused=True, vllm_sleeping=True).weights_awake


def record(**conditions) -> EngineRecord:
    r = EngineRecord(0, devices=None, socket_path="/nonexistent", lifecycle=Lifecycle.UP)  # type: ignore[arg-type]
    for name, value in conditions.items():
        setattr(r, name, value)
    return r


def test_verdicts_keep_half_loaded_engines_paused_and_pushes_off_sleeping_weights():
    running, paused = record(), record(residency=Residency(paused=True))
    asleep = record(residency=walk(("sleep", {"level": 1})))
    weights_awake = record(residency=walk(("sleep", {"level": 1}), ("wake_up", {"tags": ["weights"]})))
    receiving = record(residency=Residency(paused=True), mid_update=True)
    assert [push_verdict(r) for r in (running, paused, weights_awake)] == [PAUSE_FOR_PUSH, APPLY, APPLY]
    assert "wake_up?tags=weights first" in push_verdict(asleep)
    # Nothing resumes an engine inside a weight update; pausing it again is harmless.
    for operation, params in (("resume", {}), ("wake_up", {}), ("sleep", {"level": 1})):
        with pytest.raises(ApiError, match="receiving a weight update"):
            control_targets(operation, [receiving], **params)
    assert control_targets("pause", [receiving], mode="keep") == ([receiving], [])
    # A wait-mode pause lets vLLM's scheduler step until its requests drain: on half-loaded layers.
    with pytest.raises(ApiError, match=r"receiving a weight update.*mode=keep"):
        control_targets("pause", [receiving], mode="wait")
    receiving_asleep = record(residency=weights_awake.residency, mid_update=True)
    with pytest.raises(ApiError, match="receiving a weight update"):
        control_targets("wake_up", [receiving_asleep], tags=["kv_cache"])
    # vLLM wakes a paused engine; one that is running has nothing to wake.
    assert control_targets("wake_up", [paused, running]) == ([paused], [running])
    with pytest.raises(ApiError, match="already sleeping"):
        control_targets("sleep", [weights_awake], level=2)


# -- what the updates carry --------------------------------------------------------------


def test_shared_memory_updates_name_a_segment_of_this_server_and_fit_in_it(tmp_path):
    front = FrontTransport(SHM, (1, 1), 60.0, allow_pickled_ipc=False)
    prefix = front.segment_prefix
    segment = f"{prefix}{'e' * 32}"
    path = f"/dev/shm/{segment}"
    with open(path, "wb") as f:
        f.write(b"\0" * 1024)
    norm = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[128]]}
    try:
        meta = front.parse_update({**norm, "segment": segment, "offsets": [512]}, carries_data=True)
        assert isinstance(meta, SharedMemoryUpdateInfo) and meta.end() == 1024
        refused = {
            "../x": "a segment name is skyinfer-",
            f"{prefix}{'e' * 31}/": "no path",
            f"{prefix}{'f' * 32}": "does not exist",
            f"skyinfer-00000000-{'e' * 32}": "is not this server's",
        }
        for name, says in refused.items():
            with pytest.raises((WireError, TransferRefused), match=says):
                front.parse_update({**norm, "segment": name, "offsets": [0]}, carries_data=True)
        with pytest.raises(TransferRefused, match="past the end"):
            front.parse_update({**norm, "segment": segment, "offsets": [576]}, carries_data=True)
        with pytest.raises(WireError, match="not aligned"):
            front.parse_update({**norm, "segment": segment, "offsets": [2]}, carries_data=True)
        with pytest.raises(WireError, match="2 offsets for 1 tensors"):
            front.parse_update({**norm, "segment": segment, "offsets": [0, 512]}, carries_data=True)
        # A start names only the tensors; an update that carries none is refused.
        assert front.parse_update(norm, carries_data=False).names == ["w"]
        with pytest.raises(WireError, match="segment is required"):
            front.parse_update(norm, carries_data=True)
        # When an update ends, this server's leftovers go, and nothing else.
        other = "/dev/shm/skyinfer-00000000-" + "e" * 32
        open(other, "wb").close()
        try:
            assert front.update_ended() == [segment] and not os.path.exists(path) and os.path.exists(other)
        finally:
            os.unlink(other)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_the_trainer_lays_tensors_out_aligned():
    tensors = [
        ("a", torch.zeros(3, dtype=torch.float32)),
        ("b", torch.zeros(1, dtype=torch.bfloat16)),
        ("c", torch.zeros(0)),
    ]
    offsets, size = layout(tensors)
    assert offsets == [0, 64, 128] and size == 128


def cpu_rebuild_args(tensor: torch.Tensor, rng: random.Random) -> tuple:
    """What torch's reduce_tensor gives for a CUDA tensor, with a CPU tensor's size, stride and dtype
    and random handle bytes: the codec never opens a handle."""
    return (
        torch.nn.Parameter if rng.random() < 0.5 else torch.Tensor,
        tensor.size(),
        tensor.stride(),
        0,
        torch.storage.TypedStorage,
        tensor.dtype,
        0,
        rng.randbytes(64),
        tensor.numel() * tensor.element_size(),
        0,
        False,
        b"/torch_1234_" + rng.randbytes(8).hex().encode(),
        5,
        rng.randbytes(64),
        True,
    )


def test_ipc_handles_travel_as_json_and_come_back_as_torch_rebuilds_them():
    rng = random.Random(3)
    for tensor in (torch.zeros(4, 8), torch.zeros(16, dtype=torch.bfloat16), torch.zeros(2, 3, 5, dtype=torch.float16)):
        args = cpu_rebuild_args(tensor, rng)
        wire = json.loads(json.dumps(encode_handle(args)))
        assert decode_handle(IpcHandle.parse(wire)) == args


def test_ipc_handle_fields_are_checked_one_by_one():
    good = encode_handle(cpu_rebuild_args(torch.zeros(4, 8), random.Random(4)))
    uuid = "GPU-2c3a1f1e-8f5e-4b4e-9c1d-0123456789ab"
    update = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[4, 8]], "ipc_handles": [{uuid: good}]}
    front = FrontTransport(IPC, (1,), 60.0, allow_pickled_ipc=False)
    assert front.parse_update(update, carries_data=True).ipc_handles[0][uuid].size == [4, 8]
    bad = {
        "tensor_class": ("builtins.eval", "update_info.ipc_handles.0"),
        "storage_class": ("os.system", "update_info.ipc_handles.0"),
        "dtype": ("complex64", "update_info.ipc_handles.0"),
        "storage_handle": ("not base64!", "update_info.ipc_handles.0"),
        "ref_counter_handle": (base64.b64encode(b"x" * 600).decode(), "update_info.ipc_handles.0"),
        "size": ([4, -8], "update_info.ipc_handles.0"),
        "stride": ([8], "update_info.ipc_handles.0"),
        "storage_size_bytes": (16, "update_info.ipc_handles.0"),
        "device": ("0", "update_info.ipc_handles.0"),
    }
    for field, (value, param) in bad.items():
        with pytest.raises(WireError) as refused:
            front.parse_update({**update, "ipc_handles": [{uuid: {**good, field: value}}]}, carries_data=True)
        assert refused.value.param.startswith(param), (field, refused.value.param)
    for handles, says in (
        ([{"not-a-uuid": good}], "not a GPU UUID"),
        ([{uuid: {**good, "size": [8, 4], "stride": [4, 1]}}], "update_info says float32 [4, 8]"),
        ([], "0 ipc_handles for 1 tensors"),
        ({uuid: good}, "needs tensor_sizes"),
    ):
        with pytest.raises(WireError, match=re.escape(says)):
            front.parse_update({**update, "ipc_handles": handles}, carries_data=True)
    pickled = {**{k: v for k, v in update.items() if k != "ipc_handles"}, "ipc_handles_pickled": "gASVAAAAAAAAAAB9lC4="}
    with pytest.raises(TransferRefused, match=PICKLED_IPC_FLAG):
        front.parse_update(pickled, carries_data=True)
    # With the operator's opt-in the body passes the front (the engines' vLLM unpickles it).
    assert FrontTransport(IPC, (1,), 60.0, allow_pickled_ipc=True).parse_update(pickled, carries_data=True).pickled
    with pytest.raises(WireError, match="exactly one"):
        IpcUpdateInfo.parse({**update, "ipc_handles_pickled": "x"})


# The engines taking part in a transfer: two, of one worker each.
FLEET = (1, 1)


async def test_init_info_says_which_transport_the_server_takes():
    shm, gloo, nccl = (FrontTransport(t, FLEET, 60.0, False) for t in (SHM, GLOO, NCCL))
    plan = await shm.plan_init({"timeout_s": 5}, FLEET)
    assert plan.answer == {"transport": "shm", "segment_prefix": shm.segment_prefix} and plan.timeout_s == 5
    assert plan.engine_init_infos == [{}, {}]
    with pytest.raises(TransferRefused, match="colocated"):
        await shm.plan_init({"master_address": "127.0.0.1", "master_port": 1234, "world_size": 3}, FLEET)
    with pytest.raises(TransferRefused, match="--colocate"):
        await gloo.plan_init({"packed": False}, FLEET)  # vLLM's ipc trainer, to a server on devices of its own
    group = {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 3, "timeout_s": 7}
    gloo_plan, nccl_plan = await gloo.plan_init(group, FLEET), await nccl.plan_init(group, FLEET)
    assert [i["rank_offset"] for i in gloo_plan.engine_init_infos] == [1, 2]
    # Every engine's receiver (skyinfer's, NCCL's too) bounds its rendezvous and collectives by the group's timeout.
    assert [i["timeout_s"] for plan in (gloo_plan, nccl_plan) for i in plan.engine_init_infos] == [7] * 4
    # NCCL's torch-free rendezvous, without master_address.
    unique = {"nccl_unique_id_b64": base64.b64encode(bytes(128)).decode(), "world_size": 3}
    assert (await nccl.plan_init(unique, FLEET)).engine_init_infos[1] == {
        **unique,
        "rank_offset": 2,
        "timeout_s": 60.0,
        "packed": False,
        "packed_buffer_size_bytes": 1024**3,
        "packed_num_buffers": 2,
    }
    # What an engine's receiver parses them with, and what vLLM's trainer engine tells the engines
    # (its init info for the workers, as it sends it): every field taken.
    for plan in (nccl_plan, await nccl.plan_init(unique, FLEET)):
        for info in plan.engine_init_infos:
            GroupInitInfo.parse(info)
    vllm_worker_info = worker_init_payload(
        NCCLWeightTransferInitInfo(master_address="127.0.0.1", master_port=1234, rank_offset=1, world_size=3)
    )
    assert (await nccl.plan_init(vllm_worker_info, FLEET)).engine_init_infos[0]["rank_offset"] == 1
    with pytest.raises(TransferRefused, match="only NCCL"):
        await gloo.plan_init(unique, FLEET)
    with pytest.raises(WireError, match="not both"):
        GroupInitInfo.parse({**group, **unique})
    # One engine retired: the group spans the other alone, and a world size for two is refused.
    alone = await gloo.plan_init({**group, "world_size": 2}, (1,))
    assert [i["rank_offset"] for i in alone.engine_init_infos] == [1]
    with pytest.raises(TransferRefused, match="world_size"):
        await gloo.plan_init({**group, "world_size": 2}, FLEET)


def test_pushed_dtypes_must_be_ones_vllm_casts_into_the_checkpoints():
    from skyinfer.transfer.protocol import UpdateMetadata

    spec = CheckpointSpec({"w": (2,), "ids": (2,)}, {"w": "bfloat16", "ids": "int64"})
    for dtypes in (["float32", "int64"], ["bfloat16", "int64"], ["float16", "int64"]):
        spec.check(UpdateMetadata(names=["w", "ids"], dtype_names=dtypes, shapes=[[2], [2]]))
    for dtypes, says in ((["int8", "int64"], "send a floating-point dtype"), (["float32", "int32"], "send int64")):
        with pytest.raises(ValueError, match=says):
            spec.check(UpdateMetadata(names=["w", "ids"], dtype_names=dtypes, shapes=[[2], [2]]))


def test_a_quantized_layer_takes_a_push_of_all_its_tensors_or_none():
    """vLLM loads q, k and v into one layer; an int8 layer's weight comes with its scale."""
    attention = "model.layers.0.self_attn"
    shapes = {f"{attention}.{p}_proj.{t}": (4, 1) for p in "qkv" for t in ("weight", "weight_scale")}
    shapes |= {"model.layers.0.mlp.down_proj.weight": (4, 4), "model.norm.weight": (4,)}
    spec = CheckpointSpec(shapes, dict.fromkeys(shapes, "float32"))
    spec.check_whole_layers(shapes)
    spec.check_whole_layers({"model.norm.weight", "model.layers.0.mlp.down_proj.weight"})  # not quantized
    for left_out in (f"{attention}.q_proj.weight_scale", f"{attention}.v_proj.weight"):
        with pytest.raises(ValueError, match=rf"5 of the 6 tensors of {attention}\.qkv_proj \({left_out} left out\)"):
            spec.check_whole_layers(set(shapes) - {left_out})


def test_a_layer_the_engines_serve_quantized_takes_a_push_of_all_its_tensors_or_none():
    """An online quantization (``--quantization fp8`` on a bf16 checkpoint) stores no scale: the
    layers the engines report quantized are whole or refused all the same; the others take part."""
    attention = "model.layers.0.self_attn"
    shapes = {f"{attention}.{p}_proj.weight": (4, 4) for p in "qkvo"} | {"model.norm.weight": (4,)}
    bf16 = CheckpointSpec(shapes, dict.fromkeys(shapes, "bfloat16"))
    part = {f"{attention}.q_proj.weight", f"{attention}.o_proj.weight"}
    bf16.check_whole_layers(part)  # full precision as served: the rest is read back from the engines
    online = attrs.evolve(bf16, served_quantized=frozenset({f"{attention}.qkv_proj", f"{attention}.o_proj"}))
    assert online.quantized_modules == {f"{attention}.{p}_proj" for p in "qkvo"}
    online.check_whole_layers(set(shapes))
    online.check_whole_layers({f"{attention}.o_proj.weight", "model.norm.weight"})
    with pytest.raises(ValueError, match=rf"1 of the 3 tensors of {attention}\.qkv_proj"):
        online.check_whole_layers(part)


def test_the_trainers_int8_quantizer_scales_each_output_channel_to_127():
    """Per-channel symmetric int8 (compressed-tensors W8A8): scale = max|w| / 127 per row, round half to even."""
    from skyinfer.transfer.quantize import W8A8_INT8_CONFIG, is_w8a8_int8, quantize_w8a8_int8

    weight = torch.tensor([[1.0, -2.0], [0.5, 0.25]], dtype=torch.bfloat16)
    norm = torch.ones(2)
    out = dict(quantize_w8a8_int8([("l.q_proj.weight", weight), ("l.input_layernorm.weight", norm)]))
    assert list(out) == ["l.q_proj.weight", "l.q_proj.weight_scale", "l.input_layernorm.weight"]
    assert out["l.q_proj.weight"].dtype == torch.int8
    assert out["l.q_proj.weight"].tolist() == [[64, -127], [127, 64]]
    assert torch.equal(out["l.q_proj.weight_scale"], torch.tensor([[2 / 127], [0.5 / 127]]))
    assert out["l.input_layernorm.weight"] is norm
    # Already int8 (with its scale): sent as it is.
    again = dict(quantize_w8a8_int8(out))
    assert again["l.q_proj.weight"] is out["l.q_proj.weight"] and list(again) == list(out)
    assert is_w8a8_int8(W8A8_INT8_CONFIG)
    per_tensor = {
        **W8A8_INT8_CONFIG,
        "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}}},
    }
    assert not is_w8a8_int8(per_tensor) and not is_w8a8_int8({"quant_method": "fp8"})


def test_cuda_visible_devices_by_index_or_uuid_and_mig_instances():
    from skyinfer.devices import parse_visible_devices, split_gpus
    from skyinfer.ranks import LayoutError

    gpu = ["GPU-2c3a1f1e-8f5e-4b4e-9c1d-0123456789a" + c for c in "bc"]
    known = set(gpu)
    assert parse_visible_devices(None, 2, known.__contains__) == ["0", "1"]
    assert parse_visible_devices("1,0", 2, known.__contains__) == ["1", "0"]
    assert parse_visible_devices(",".join(gpu), 2, known.__contains__) == gpu
    plans = split_gpus(gpu, workers_per_engine=(1, 1))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == gpu and plans[1].describe()["ids"] == [gpu[1]]
    mig = ["MIG-4b9e3c5a-1f2e-5d6c-8b7a-0123456789ab", "MIG-GPU-2c3a1f1e-8f5e-4b4e-9c1d-0123456789ab/1/0"]
    assert parse_visible_devices(",".join(mig), 1, lambda _uuid: True) == mig
    for value, says in (
        ("0,2", "only 2 exist"),
        ("0,GPU-zz", "neither a GPU index"),
        (gpu[0].replace("b", "f"), "does not know"),
    ):
        with pytest.raises(LayoutError, match=says):
            parse_visible_devices(value, 2, known.__contains__)
    with pytest.raises(LayoutError, match="one MIG instance"):
        split_gpus(mig, workers_per_engine=(2,))


def test_serve_options_that_cannot_work_are_refused(tmp_path):
    for engine_args in (("--data-parallel-size", "2"), ("-dp=2",), ("--data-parallel-size-local", "1")):
        with pytest.raises(ValueError, match=r"give it to skyinfer \(-dp N"):
            ServeConfig(model=str(tmp_path), engine_args=engine_args)
    with pytest.raises(ValueError, match="add --colocate"):
        ServeConfig(model=str(tmp_path), allow_pickled_ipc=True)
    with pytest.raises(ValueError, match="--allow-pickled-ipc needs an admin key"):
        ServeConfig(
            model=str(tmp_path), colocate=True, allow_pickled_ipc=True, host="0.0.0.0", allow_unauthenticated_admin=True
        )
    # Loopback too: any local process (or a web page) reaches it.
    with pytest.raises(ValueError, match="--allow-pickled-ipc needs an admin key"):
        ServeConfig(model=str(tmp_path), colocate=True, allow_pickled_ipc=True)
    ServeConfig(model=str(tmp_path), colocate=True, allow_pickled_ipc=True, admin_key="admin-0123456789")


def test_every_transport_the_front_can_choose_runs_skyinfers_receiver():
    """Whatever the device, --colocate and --weight-transport, every engine's weight-transfer backend
    is one of skyinfer's, each a ``LiveReceiver`` (its failures kept for the front to ask for,
    the rest of a layer a push filled in part kept, CPU kernels repacked); what does not fit the
    server is refused, and so is a backend the user names among vLLM's arguments."""
    from skyinfer.devices import platform_engine_args
    from skyinfer.engine import backends  # noqa: F401 - registers skyinfer's backends, as in every worker
    from skyinfer.transfer import SKYINFER_BACKENDS, TRANSPORTS, transport_for
    from skyinfer.transfer.receiving import LiveReceiver
    from skyinfer.vllm_api import WeightTransferEngineFactory

    chosen = set()
    for kind in ("cpu", "cuda"):
        for colocate in (False, True):
            for choice in ("auto", *(t.name for t in TRANSPORTS)):
                try:
                    transport = transport_for(kind, colocate, choice)
                except ValueError as exc:
                    assert "does not fit" in str(exc), exc
                    continue
                args = platform_engine_args(kind, (), colocate, 0.5, transport.backend)
                (config,) = [args[i + 1] for i, arg in enumerate(args) if arg == "--weight-transfer-config"]
                backend = json.loads(config)["backend"]
                assert backend in SKYINFER_BACKENDS, (kind, colocate, choice, backend)
                receiver = WeightTransferEngineFactory._registry[backend]()
                assert issubclass(receiver, LiveReceiver), (backend, receiver.__mro__)
                chosen.add(transport)
    assert chosen == set(TRANSPORTS)
    assert transport_for("cpu", False, "nccl") is NCCL and transport_for("cuda", False) is NCCL
    with pytest.raises(ValueError, match="weight-transfer-config among the engine arguments"):
        ServeConfig(model="m", engine_args=("--weight-transfer-config", '{"backend": "nccl"}'))


async def test_the_front_refuses_ipc_bodies_over_http_before_any_engine(aiohttp_client, demo_model, tmp_path):
    """A colocated GPU server's front, without its engines (none would be reached): bad JSON handles
    and vLLM's own pickled body (made by vLLM's own HTTP client from its own handle tuples) are
    OpenAI-shaped 400s; with the opt-in, the pickled body gets past the checks only with the admin key."""
    from vllm.distributed.weight_transfer.clients import _json_safe_update_info

    from skyinfer.front.app import create_app
    from skyinfer.weights.sync import WEIGHT_SYNC

    def front(allow_pickled_ipc: bool):
        app = create_app(
            ServeConfig(
                model=str(demo_model),
                device="cpu",
                colocate=True,
                admin_key="admin-0123456789",
                allow_pickled_ipc=allow_pickled_ipc,
                socket_dir=str(tmp_path),
            )
        )
        app.cleanup_ctx.clear()  # no engines: nothing here may reach one
        app[WEIGHT_SYNC].transport = FrontTransport(IPC, (1, 1), 60.0, allow_pickled_ipc)
        return app

    key = {"Authorization": "Bearer admin-0123456789"}
    args = cpu_rebuild_args(torch.zeros(128), random.Random(5))
    norm = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    uuid = "GPU-2c3a1f1e-8f5e-4b4e-9c1d-0123456789ab"
    pickled = _json_safe_update_info({**norm, "ipc_handles": [{uuid: args}]})  # what vLLM's client sends
    assert set(pickled) == {*norm, "ipc_handles_pickled"}
    client = await aiohttp_client(front(allow_pickled_ipc=False))
    for update_info, says in (
        (pickled, PICKLED_IPC_FLAG),
        (
            {**norm, "ipc_handles": [{uuid: {**encode_handle(args), "tensor_class": "os.system"}}]},
            "'Tensor' or 'Parameter'",
        ),
        ({**norm, "ipc_handles": [{uuid: {**encode_handle(args), "dtype": "bfloat16"}}]}, "update_info says float32"),
    ):
        r = await client.post("/update_weights", json={"update_info": update_info}, headers=key)
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == 400 and says in body["error"]["message"], body
    opted_in = await aiohttp_client(front(allow_pickled_ipc=True))
    r = await opted_in.post("/update_weights", json={"update_info": pickled})
    assert r.status == 401
    # Past the checks, it reaches the engines' group, which is not set up here: 409, and no engine touched.
    r = await opted_in.post("/update_weights", json={"update_info": pickled}, headers=key)
    assert r.status == 409 and "weight transfer needs every engine" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(
    "spelling",
    [
        ("--weight_transfer_config", '{"backend": "nccl"}'),
        ('--weight-transfer-config={"backend": "nccl"}',),
        ("--weight-transfer-config.backend", "nccl"),
        ("--weight_transfer_config.backend=nccl",),
    ],
)
def test_a_backend_named_in_any_spelling_vllm_reads_is_refused(spelling):
    """vLLM's own parser reads each of these spellings as a weight-transfer backend (the user's, after
    skyinfer's, would win): the configuration refuses every one, as it refuses the plain flag."""
    from skyinfer.vllm_api import FlexibleArgumentParser, make_arg_parser

    read = make_arg_parser(FlexibleArgumentParser()).parse_args(["m", *spelling])
    assert read.weight_transfer_config is not None and read.weight_transfer_config.backend == "nccl", read
    with pytest.raises(ValueError, match="weight-transfer-config among the engine arguments"):
        ServeConfig(model="m", engine_args=spelling)


def test_a_config_file_among_the_engine_arguments_is_refused(tmp_path):
    """vLLM's ``--config`` file can set any engine argument, out of the front's sight: refused."""
    with pytest.raises(ValueError, match="--config among the engine arguments"):
        ServeConfig(model="m", engine_args=("--config", str(tmp_path / "engine.yaml")))
    with pytest.raises(ValueError, match="--data-parallel-size among the engine arguments"):
        ServeConfig(model="m", engine_args=("--data_parallel_size", "2"))
