"""skyinfer's calls of an engine's workers, answered by every worker, failures as values.

vLLM's multiprocess executor reads its workers' answers in rank order and raises at the first
failure, leaving the later ranks' answers queued: the engine's next worker call of any kind reads
those instead of its own (vllm-project/vllm#57846, open in vLLM 0.32 and 0.33). On an engine of
tensor-parallel size 2 or more, a failure on rank 0 thus broke every later call (measured: a
trainer killed mid-push cost a tp-2 engine a restart, its abort reading the push's stale
failure). So skyinfer's worker methods never raise through the executor: every rank answers, a
failure as a value, and the engine raises once all have.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("skyinfer.engine.worker_calls")

_FAILED = "skyinfer_worker_failed"


class StepFailed(RuntimeError):
    """A worker method of several steps failed at ``step``: its cause's message, and the step."""

    def __init__(self, step: str, cause: BaseException):
        super().__init__(f"at its {step}: {type(cause).__name__}: {cause}")
        self.step = step


class WorkerFailed(RuntimeError):
    """Workers failed a call: each one's error; ``steps``, the steps they failed at (``StepFailed``)."""

    def __init__(self, message: str, steps: set[str]):
        super().__init__(message)
        self.steps = steps


def answers_every_rank(method: Callable) -> Callable:
    """For a worker method: its exception becomes its answer, so every rank's answer is read."""

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            step = {"step": exc.step} if isinstance(exc, StepFailed) else {}
            return {_FAILED: f"{type(exc).__name__}: {exc}", **step}

    return call


async def every_worker_answers(engine, method: str, *args: Any) -> list:
    """``method``'s answer from every worker of ``engine`` (an AsyncLLM), of every data-parallel rank,
    in ``ranks.worker_index`` order. ``AsyncLLM.collective_rpc`` asks every data-parallel rank of an
    engine but returns the first rank's answers alone; vLLM's client asks each rank's EngineCore
    itself for the answers of all (as vLLM's own weight checksums do)."""
    per_rank = await engine.engine_core.call_utility_all_async("collective_rpc", method, None, args, None)
    return [answer for answers in per_rank for answer in answers]


async def on_every_worker(engine, method: str, *args: Any) -> list:
    """Call a worker method decorated with ``answers_every_rank`` on every worker of ``engine``
    (an AsyncLLM): their answers in worker order, or ``WorkerFailed`` naming each worker that failed."""
    answers = await every_worker_answers(engine, method, *args)
    failures = {rank: answer for rank, answer in enumerate(answers) if isinstance(answer, dict) and _FAILED in answer}
    if failures:
        message = "; ".join(f"worker {rank}: {answer[_FAILED]}" for rank, answer in failures.items())
        raise WorkerFailed(message, {answer["step"] for answer in failures.values() if "step" in answer})
    return answers
