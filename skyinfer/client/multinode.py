"""``MultiNodeClient``: several skyinfer nodes as one."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Coroutine, Sequence
from typing import Any

from ..ranks import RankLayout
from .node import AsyncClient, SkyinferError


def _on_every_node(name: str, doc: str | None = None):
    """``MultiNodeClient.<name>``: ``AsyncClient.<name>``, with its signature, called on every node at
    once and answered with one report per node; ``doc``: its docstring, where that says more."""

    @functools.wraps(getattr(AsyncClient, name))
    async def on_every_node(self: MultiNodeClient, *args, **kwargs) -> dict:
        return await self._fanout_report(name, *args, **kwargs)

    on_every_node.__module__ = __name__
    on_every_node.__qualname__ = f"MultiNodeClient.{name}"
    on_every_node.__doc__ = doc or f"``AsyncClient.{name}`` on every node at once: one report per node."
    return on_every_node


class MultiNodeClient:
    """Several skyinfer nodes as one: the ``AsyncClient`` methods, fanned out.

    Generation goes to ``router_url`` when given (a vllm-router in front of the
    nodes), else to the node that ``X-Session-ID`` hashes to (no session:
    round-robin). Control and weight calls go to every node at once; a node
    that fails makes the call raise, naming it, whatever the others did.
    In the weight-transfer group the trainer is rank 0 and node k's workers
    follow the workers of the nodes before it.
    """

    def __init__(self, node_urls: Sequence[str], *, router_url: str | None = None, **settings):
        if not node_urls:
            raise ValueError("need at least one node URL")
        self.nodes = [AsyncClient(url, **settings) for url in node_urls]
        self.router = AsyncClient(router_url, **settings) if router_url else None
        self._turn = 0

    def __repr__(self) -> str:
        return f"MultiNodeClient({[n.base_url for n in self.nodes]!r}, router_url={self.router and self.router.base_url!r})"

    @property
    def base_url(self) -> str:
        """The first node's URL."""
        return self.nodes[0].base_url

    def node_for(self, session_id: str | None) -> AsyncClient:
        """Where a generation request goes."""
        if self.router is not None:
            return self.router
        if session_id is None:
            self._turn += 1
            return self.nodes[self._turn % len(self.nodes)]
        digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
        return self.nodes[int.from_bytes(digest, "big") % len(self.nodes)]

    async def aclose(self) -> None:
        """Close every node's connections (and the router's)."""
        await asyncio.gather(*(c.aclose() for c in [*self.nodes, *([self.router] if self.router else [])]))

    async def __aenter__(self) -> MultiNodeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _fanout(self, method: str, *args, **kwargs) -> list[Any]:
        """Call ``method`` on every node at once."""
        return await self._gather(method, [getattr(node, method)(*args, **kwargs) for node in self.nodes])

    async def _gather(self, what: str, calls: list[Coroutine]) -> list[Any]:
        """Await one call per node; raise naming every node that failed, whatever the others did."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(node, r) for node, r in zip(self.nodes, results) if isinstance(r, BaseException)]
        for _node, exc in failed:
            if not isinstance(exc, SkyinferError):
                raise exc
        if failed:
            statuses = {exc.status for _node, exc in failed}
            per_node = [
                {"node": n.base_url, "status": r.status, "error": r.message}
                if isinstance(r, SkyinferError)
                else {"node": n.base_url, "status": 200, "result": r}
                for n, r in zip(self.nodes, results)
            ]
            raise SkyinferError(
                statuses.pop() if len(statuses) == 1 else 502,
                f"{what} failed on {len(failed)} of {len(self.nodes)} node(s): "
                + "; ".join(f"{node.base_url}: {exc.message}" for node, exc in failed),
                {"nodes": per_node},
            )
        return results

    def _report(self, results: list[Any]) -> dict:
        statuses = {r.get("status") for r in results if isinstance(r, dict)}
        report = {"nodes": [{"node": n.base_url, "result": r} for n, r in zip(self.nodes, results)]}
        return {"status": statuses.pop(), **report} if len(statuses) == 1 else report

    async def _fanout_report(self, method: str, *args, **kwargs) -> dict:
        return self._report(await self._fanout(method, *args, **kwargs))

    # -- data plane ---------------------------------------------------------------
    async def models(self) -> list[dict]:
        """The served models, as the first node lists them (every node serves the same model)."""
        return await self.nodes[0].models()

    async def model(self) -> str:
        """The served model's name, from the first node (asked once)."""
        return await self.nodes[0].model()

    async def generate(self, token_ids, sampling_params=None, *, session_id=None, **fields) -> dict:
        """``AsyncClient.generate`` on the node ``node_for(session_id)`` picks."""
        return await self.node_for(session_id).generate(token_ids, sampling_params, session_id=session_id, **fields)

    async def chat(self, messages, *, model=None, session_id=None, **params) -> dict:
        """``AsyncClient.chat`` on the node ``node_for(session_id)`` picks."""
        model = model or await self.model()
        return await self.node_for(session_id).chat(messages, model=model, session_id=session_id, **params)

    async def complete(self, prompt, *, model=None, session_id=None, **params) -> dict:
        """``AsyncClient.complete`` on the node ``node_for(session_id)`` picks."""
        model = model or await self.model()
        return await self.node_for(session_id).complete(prompt, model=model, session_id=session_id, **params)

    # Every node serves the same model: any one tokenizes.
    async def tokenize(self, prompt=None, **kwargs) -> list[int]:
        """``AsyncClient.tokenize`` on the first node (every node serves the same model)."""
        return await self.nodes[0].tokenize(prompt, **kwargs)

    async def detokenize(self, tokens, **kwargs) -> str:
        """``AsyncClient.detokenize`` on the first node (every node serves the same model)."""
        return await self.nodes[0].detokenize(tokens, **kwargs)

    # -- control plane: every node -------------------------------------------------
    pause = _on_every_node("pause")
    resume = _on_every_node("resume")
    sleep = _on_every_node("sleep")
    wake_up = _on_every_node("wake_up")
    reset_prefix_cache = _on_every_node("reset_prefix_cache")
    abort = _on_every_node("abort")

    async def is_paused(self) -> bool:
        """Whether any engine of any node is paused."""
        return any(await self._fanout("is_paused"))

    async def is_sleeping(self) -> bool:
        """Whether any engine of any node sleeps."""
        return any(await self._fanout("is_sleeping"))

    # -- weight transfer: one group over every node's workers ----------------------------
    async def node_world_sizes(self) -> list[int]:
        """Each node's inference workers (``GET /get_world_size``), in node order."""
        return await self._fanout("get_world_size")

    async def get_world_size(self) -> int:
        """The inference workers of every node together: the group's ``world_size`` less the trainer's ranks."""
        return sum(await self.node_world_sizes())

    async def init_weight_transfer_engine(self, init_info: dict) -> dict:
        """Join every node to the trainer's group, node k's ranks after those of nodes 0..k-1."""
        sizes = await self.node_world_sizes()
        layout = RankLayout.build(int(init_info.get("rank_offset", 1)), int(init_info["world_size"]), tuple(sizes))
        calls = [
            node.init_weight_transfer_engine({**init_info, "rank_offset": layout.rank_offset(k)})
            for k, node in enumerate(self.nodes)
        ]
        return self._report(await self._gather("init_weight_transfer", calls))

    start_weight_update = _on_every_node("start_weight_update")
    update_weights = _on_every_node("update_weights")
    finish_weight_update = _on_every_node("finish_weight_update")
    weight_checker = _on_every_node(
        "weight_checker",
        "``AsyncClient.weight_checker`` on every node at once: one report per node (each node checks its own engines).",
    )
    update_weight_version = _on_every_node("update_weight_version")
    shutdown_weight_transfer_engine = _on_every_node("shutdown_weight_transfer_engine")

    async def weight_info(self) -> dict:
        """Each node's ``/weight_info``, and the weight version if every node serves the same (else None)."""
        infos = await self._fanout("weight_info")
        versions = {i["weight_version"] for i in infos}
        return {
            "weight_version": versions.pop() if len(versions) == 1 else None,
            "nodes": [{"node": n.base_url, **i} for n, i in zip(self.nodes, infos)],
        }

    load_lora_adapter = _on_every_node(
        "load_lora_adapter", "Each node loads from its own disk: the path must hold the adapter on every node."
    )
    unload_lora_adapter = _on_every_node("unload_lora_adapter")
    update_lora_adapter = _on_every_node("update_lora_adapter")

    # -- status ----------------------------------------------------------------------
    async def engines(self) -> list[dict]:
        """Every node's engines, each marked with its ``node``."""
        per_node = await self._fanout("engines")
        return [{"node": n.base_url, **e} for n, engines in zip(self.nodes, per_node) for e in engines]

    async def health(self) -> dict:
        """Every node's ``/health`` body, each marked with its ``node``."""
        return {"nodes": [{"node": n.base_url, **h} for n, h in zip(self.nodes, await self._fanout("health"))]}

    async def ready(self) -> bool:
        """Whether every engine of every node is ready."""
        return all(await self._fanout("ready"))

    async def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> None:
        """Wait until every node is ready (``AsyncClient.wait_ready`` on each)."""
        await self._fanout("wait_ready", timeout_s, poll_s)

    async def metrics(self) -> dict[str, str]:
        """Every node's Prometheus text, by node URL."""
        return {n.base_url: text for n, text in zip(self.nodes, await self._fanout("metrics"))}
