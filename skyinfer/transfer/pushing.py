"""What every trainer helper shares: the server's client, a push's HTTP calls and their order.

A push is three calls however many tensors: start (the server checks the metadata against the
served checkpoint before any byte moves), update (the transport moves the bytes while it is in
flight), finish (the new version is served). With ``one_call`` a single ``/update_weights`` does
all three. The HTTP side is ``skyinfer.client.Client``, which also satisfies vLLM's
``VLLMWeightSyncClient`` protocol; ``sync_client=`` makes the calls through any client of that
protocol instead (vLLM's ``HTTPVLLMWeightSyncClient``), in the protocol's shape.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from ..client import Client, SkyinferError
from ..errors import TRANSFER_GROUP_GONE, UNKNOWN_LAYOUT, UPDATE_ABANDONED
from .packing import dtype_name
from .protocol import layout_id, without_layout
from .quantize import W8A8_INT8, quantize_w8a8_int8

log = logging.getLogger("skyinfer.trainer")

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def tensor_list(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """vLLM's update_info core for ``tensors``: names, dtype names, shapes."""
    return {
        "names": [name for name, _ in tensors],
        "dtype_names": [dtype_name(t.dtype) for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
    }


class Trainer:
    """A trainer's side of one skyinfer server (or, for the group transports, several nodes)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        admin_key: str | None = None,
        timeout_s: float = 120.0,
        client: Client | None = None,
        # A client of vLLM's VLLMWeightSyncClient protocol to make the push's calls instead.
        sync_client: object | None = None,
    ):
        self.client = client or Client(base_url, admin_key=admin_key, timeout_s=timeout_s + 60)
        self._calls = self.client if sync_client is None else ProtocolCalls(sync_client)
        self.timeout_s = timeout_s
        # Whether the push under way goes whole, though the trainer pushes deltas.
        self._whole_push = False
        # The layouts (protocol.py) the server took a push of, which later pushes name alone; and
        # those of the push under way, taken once it succeeds.
        self._layouts_taken: set[str] = set()
        self._layouts_pushing: set[str] = set()

    def close(self) -> None:
        """Close the HTTP connections."""
        self.client.close()

    def push(
        self,
        named_tensors: NamedTensors,
        version: str,
        one_call: bool = False,
        verify: bool = False,
        staged: bool = False,
        kv: str = "recompute",
        quantize: bool = True,
        dense: bool = False,
    ) -> None:
        """Send the tensors to every engine; afterwards they serve ``version``.

        ``one_call`` uses a single ``/update_weights`` (skyinfer starts and finishes the update
        itself). ``verify`` has the engines' weights checked against each other at the finish:
        one that differs is held out and the push raises. ``staged`` (one call): the engines
        receive while they generate and pause only to swap the weights in. ``kv``: after the
        push, requests that were running recompute their KV with the new weights ("recompute",
        exact) or go on over the KV they have ("keep").

        Engines that serve a quantized checkpoint of a scheme these helpers know (int8 W8A8, as
        ``/weight_info`` says) get full-precision tensors quantized to it here, each weight
        followed by its scale; tensors already quantized go as they are. ``quantize=False`` sends
        every tensor as it is.

        A trainer that pushes deltas (``GlooTrainer``) sends only what changed since its last push;
        ``dense`` sends every tensor whole this time (the next push's delta is then taken from it).
        """
        if one_call and verify:
            raise ValueError("verify needs the finish call: push with one_call=False")
        # A staged push, or one asked dense, goes whole.
        self._whole_push = staged or dense
        try:
            tensors = self._prepare(self._as_served(named_tensors) if quantize else named_tensors)
            if one_call:
                send = OneCall(version, staged, kv)
                self._in_group(lambda: self._send(tensors, tensor_list(tensors), send))
            else:
                self._in_group(lambda: self._push(tensors, version, verify, kv, staged))
            self._layouts_taken |= self._layouts_pushing
            self._took(tensors, version)
        finally:
            self._layouts_pushing.clear()
            self._pushed()

    def _planned(self, update_info: dict) -> dict:
        """``update_info`` as sent: with its layout's id, and without the per-tensor fields once the
        server took a push of that layout (vLLM's own clients send them every push)."""
        if isinstance(self._calls, ProtocolCalls):
            return update_info
        layout = layout_id(update_info)
        self._layouts_pushing.add(layout)
        if layout in self._layouts_taken:
            return {**without_layout(update_info), "layout": layout}
        return {**update_info, "layout": layout}

    def _update_weights(self, update_info: dict, one_call: OneCall | None, check_only: bool = False) -> None:
        """The ``/update_weights`` call for one chunk, or for a whole push made in one call
        (``check_only``: only what the server would refuse that call for)."""
        update_info = self._planned(update_info)
        fields = {} if one_call is None else one_call.fields()
        self._calls.update_weights(update_info, **fields, **({"check_only": True} if check_only else {}))

    @functools.cached_property
    def _engines_scheme(self) -> str | None:
        """The scheme the engines want full-precision tensors quantized to (``/weight_info``), asked once."""
        try:
            info = self.client.weight_info()
        except SkyinferError:  # a server that cannot say: it gets what the trainer holds
            return None
        schemes = {(node.get("quantization") or {}).get("trainer_scheme") for node in info.get("nodes", [info])}
        # Nodes that disagree get what the trainer holds, and refuse what does not fit them.
        return schemes.pop() if len(schemes) == 1 else None

    def _as_served(self, named_tensors: NamedTensors) -> NamedTensors:
        return quantize_w8a8_int8(named_tensors) if self._engines_scheme == W8A8_INT8 else named_tensors

    def _pushed(self) -> None:
        """The push is over, however it ended: let go of what it held for the engines."""

    def _took(self, tensors: list[tuple[str, torch.Tensor]], version: str) -> None:
        """Every engine took the push of ``tensors`` as ``version``."""

    def _in_group(self, send: Callable[[], None]) -> None:
        """``send``, and if the server refuses it (before any byte moved) because its engines left
        the transfer (an engine restarted or rejoined the fleet, a push was aborted) or it abandoned
        the update this push had begun (this trainer was silent too long), set the transfer up
        again and send the whole push once more."""
        try:
            send()
        except SkyinferError as exc:
            if exc.code == UNKNOWN_LAYOUT:  # a server restarted since, say: the layouts go in full again
                self._layouts_taken.clear()
                send()
                return
            if exc.code not in (TRANSFER_GROUP_GONE, UPDATE_ABANDONED):
                raise
            log.warning("the server's engines left the weight transfer (%s): setting it up again", exc.message)
            self.init()
            send()

    def init(self) -> None:
        """Set up the transfer with every engine of the server."""
        raise NotImplementedError

    def _push(self, tensors: list[tuple[str, torch.Tensor]], version: str, verify: bool, kv: str, staged: bool) -> None:
        metadata = tensor_list(tensors)
        self._calls.start_weight_update(self._planned(metadata), staged=staged)  # a refusal here: nothing moved
        self._send(tensors, metadata, None)
        self._calls.finish_weight_update(version, verify, kv=kv)

    def _prepare(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        """The tensors as the transport sends them."""
        raise NotImplementedError

    def _send(self, tensors: list[tuple[str, torch.Tensor]], metadata: dict, one_call: OneCall | None) -> None:
        """Move the bytes, making the ``/update_weights`` call(s) they travel with (``one_call``: the
        one call that starts, receives and finishes a push)."""
        raise NotImplementedError


@attrs.frozen
class OneCall:
    """A push made by one ``/update_weights``: what the call carries beside the tensors."""

    version: str
    staged: bool = False
    kv: str = "recompute"

    def fields(self) -> dict:
        return {"weight_version": self.version, "staged": self.staged, "kv": self.kv}


class ProtocolCalls:
    """A push's calls made through a client of vLLM's ``VLLMWeightSyncClient`` protocol, whose
    start carries no metadata (the front then checks it at the update) and whose finish has no verify."""

    def __init__(self, client):
        self._client = client

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._client.init_weight_transfer_engine(init_info)

    def start_weight_update(self, _update_info: dict, staged: bool = False) -> None:
        if staged:
            raise ValueError("a staged push needs skyinfer's client: vLLM's protocol has no staging")
        self._client.start_weight_update()

    def update_weights(self, update_info: dict, weight_version: str | None = None, **one_call) -> None:
        if weight_version is not None:
            raise ValueError(
                "a one-call or staged push needs skyinfer's client: vLLM's update_weights takes no version"
            )
        self._client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str, verify: bool, kv: str = "recompute") -> None:
        if verify or kv != "recompute":
            raise ValueError(
                "a verified push, or one that keeps KV, needs skyinfer's client: vLLM's protocol has neither"
            )
        self._client.finish_weight_update(weight_version)
