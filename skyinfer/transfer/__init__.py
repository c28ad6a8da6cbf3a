"""How weights travel from a trainer into the engines: one module per transport, each holding both
of its sides (the trainer's sender and the engine's receiver), like vLLM's ``nccl_engine.py``. The
senders run in the trainer's process, the receivers in every engine's vLLM workers; the front
imports what needs neither torch nor vLLM (this module, ``protocol``, ``rendezvous``, ``quantize``'s
names).

=========  ==============================  ===================  ======================================
transport  when                            vLLM backend         trainer side
=========  ==============================  ===================  ======================================
gloo       separate devices, CPU           ``skyinfer_gloo``    ``skyinfer.trainer.GlooTrainer``
nccl       separate devices, GPU           ``skyinfer_nccl``    vLLM's NCCL trainer engine
shm        colocated (``--colocate``), CPU  ``skyinfer_shm``     ``skyinfer.trainer.SharedMemoryTrainer``
ipc        colocated (``--colocate``), GPU  ``skyinfer_ipc``     ``skyinfer.trainer.IPCTrainer``
=========  ==============================  ===================  ======================================

gloo and nccl form a process group between the trainer (rank 0) and every engine's workers;
shm and ipc need none: the trainer's memory is mapped by the engines (a POSIX shared-memory
segment, CUDA IPC handles). Every backend is skyinfer's own receiver (``receiving``): the front
never runs one of vLLM's, whose failures, partial layers and CPU kernels skyinfer's handle. On a
CPU, ``--weight-transport nccl`` runs NCCL's wire and receiver over a gloo communicator in NCCL's
place (``nccl``), and ``--colocate --weight-transport ipc`` the CUDA IPC path over handles to
torch's shared memory in CUDA's place (``ipc``): what only a GPU runs is the device primitives. What the updates carry is declared once, in ``protocol``; this module and
``protocol`` import neither torch nor vLLM, so the front can use them.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Transport:
    name: str
    # The weight-transfer backend every engine runs (vLLM's --weight-transfer-config).
    backend: str
    # Whether /init_weight_transfer forms a process group with the trainer (a rendezvous).
    group: bool
    # What a trainer pushes with, for messages that tell a user which side to use.
    trainer: str


GLOO = Transport("gloo", "skyinfer_gloo", True, "skyinfer.trainer.GlooTrainer")
NCCL = Transport("nccl", "skyinfer_nccl", True, "vLLM's NCCLTrainerWeightTransferEngine")
SHM = Transport("shm", "skyinfer_shm", False, "skyinfer.trainer.SharedMemoryTrainer")
IPC = Transport("ipc", "skyinfer_ipc", False, "skyinfer.trainer.IPCTrainer (or vLLM's IPC trainer engine)")


TRANSPORTS = (GLOO, NCCL, SHM, IPC)
# What ``--weight-transport`` may name, by device kind and colocated or not; the first is "auto"'s.
_CHOICES = {
    ("cpu", False): (GLOO, NCCL),
    ("cpu", True): (SHM, IPC),
    ("cuda", False): (NCCL,),
    ("cuda", True): (IPC,),
}


def transport_for(device_kind: str, colocate: bool, choice: str = "auto") -> Transport:
    """The transport a server's engines receive with: colocated engines map the trainer's memory,
    separate ones join a process group; ``choice`` (``--weight-transport``) one of those that fit."""
    fitting = _CHOICES[(device_kind, colocate)]
    if choice == "auto":
        return fitting[0]
    for transport in fitting:
        if transport.name == choice:
            return transport
    where = f"{'colocated' if colocate else 'separate'} engines on {device_kind}"
    raise ValueError(
        f"--weight-transport {choice} does not fit {where}: they take {', '.join(t.name for t in fitting)}"
    )


# The backends skyinfer registers into vLLM in every worker (engine/backends.py, imported by the worker extension).
SKYINFER_BACKENDS = tuple(t.backend for t in TRANSPORTS)
