"""What the front and the engine process agree on without importing each other: the classes the
front names on an engine's command line, the headers and markers of an engine's answers, the
files of an adapter's directory, the signal that asks for an engine's stacks. Imports nothing but the
standard library, so that the front never imports vLLM through it."""

from __future__ import annotations

import signal

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "CONTINUE_FIELD",
    "CONTINUE_HEADER",
    "CONTINUE_MARKER",
    "CPU_WORKER_PATH",
    "ENGINE_DIED_HEADER",
    "EXTENSION_PATH",
    "NOT_CONTINUED_FIELD",
    "PUSH_RECEIVE_FAILED",
    "SESSION_HEADER",
    "STACKS_SIGNAL",
    "STAGED_SWAP_ENV",
    "WORKER_SPIN_ENV",
    "push_failed_at",
]


def push_failed_at(step: str) -> str:
    """The error code of an engine's one-call push (``POST /push``) that failed at ``step``: its
    ``pause``, ``start`` or ``finish`` (the engine's own), or its ``receive`` (a collective with
    the trainer, which another party may have broken)."""
    return f"push_{step}_failed"


PUSH_RECEIVE_FAILED = push_failed_at("receive")

# Named here (not imported from worker_extension, which imports vLLM) so the
# front can pass it to engines without importing vLLM itself.
EXTENSION_PATH = "skyinfer.engine.worker_extension.SkyinferWorkerExtension"
# vLLM's CPU worker without its seeded-chunked-prefill crash (engine/cpu_worker.py says why).
CPU_WORKER_PATH = "skyinfer.engine.cpu_worker.SkyinferCPUWorker"
# The signal on which an engine process writes every Python thread's stack to its output: the
# front sends it to an engine its health probes gave up on, before it kills it (supervisor.py).
STACKS_SIGNAL = signal.SIGUSR2
# Seconds a CPU worker spins on its message queue after each message (engine/cpu_setup.py), set by
# the front for CPU engines (devices.py); unset, vLLM's own 1 s.
WORKER_SPIN_ENV = "SKYINFER_WORKER_SPIN_S"
# Set to "in-place" by the front (``--staged-swap in-place``): a staged push's weights are copied
# into the live tensors on CPU too, as on GPUs (engine/targets.py); unset, by the device.
STAGED_SWAP_ENV = "SKYINFER_STAGED_SWAP"
# A multi-turn session's id: the front keeps a session on one engine, and an engine of several
# data-parallel ranks keeps it on one rank (engine/server.py), where its earlier turns are cached.
SESSION_HEADER = "X-Session-ID"
# On an answer whose request the engine could not finish because its EngineCore died:
# the request may be re-sent to another engine (the front does, once).
ENGINE_DIED_HEADER = "X-Skyinfer-Engine-Died"
# A request whose engine died after it generated tokens goes on on another engine
# (engine/continuation.py): the answer of the engine that died carries what it generated,
# a stream as its last chunk (an SSE comment starting so), any other answer as this field of its
# body (and the header says so); the front sends the request on with the same field added, and the
# same header, which the front never passes on from a caller: an engine takes a record only from it.
CONTINUE_MARKER = b": skyinfer-continue "
CONTINUE_FIELD = "skyinfer_continue"
CONTINUE_HEADER = "X-Skyinfer-Continue"
# In such a record: why the request cannot go on from its tokens so far (the state it would lose
# at the splice); the front then starts it over (a caller that has nothing yet) or ends it.
NOT_CONTINUED_FIELD = "not_continued"
# A LoRA adapter's directory, as PEFT lays it out: the front checks one on disk, the engine
# writes a pushed adapter's config and tensors into one.
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
