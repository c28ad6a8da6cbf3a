"""A request whose engine dies goes on on another engine, from where it was: the engine's side, what
a running request generated (its record, answered if the EngineCore dies) and going on from another
engine's record. docs/architecture.rst ("Inside an engine") says how."""

from __future__ import annotations

import contextvars
import copy
from collections.abc import AsyncGenerator
from typing import Any

import attrs
import orjson

from ..engine_wire import CONTINUE_FIELD, CONTINUE_MARKER, NOT_CONTINUED_FIELD
from ..vllm_api import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams

__all__ = [
    "RequestTrack",
    "begin",
    "continued_frame",
    "finished_choices",
    "marker",
    "track_outputs",
    "why_chat_stream_not_continued",
    "why_not_continued",
]

# What the running request keeps (set per HTTP request by the serving routes; vLLM's calls of
# ``generate``, in tasks of that request, see the same object).
_TRACK: contextvars.ContextVar[RequestTrack | None] = contextvars.ContextVar("skyinfer_track", default=None)


def _logprobs_json(positions) -> list | None:
    """vLLM's per-position logprob dicts (a list, or FlatLogprobs) as JSON: [[id, logprob, rank, token], ...]."""
    if positions is None:
        return None
    return [
        None if at is None else [[tok, lp.logprob, lp.rank, lp.decoded_token] for tok, lp in at.items()]
        for at in positions
    ]


def _logprobs_from_json(positions: list | None) -> list | None:
    if positions is None:
        return None
    return [None if at is None else {tok: Logprob(lp, rank, token) for tok, lp, rank, token in at} for at in positions]


@attrs.define
class ChoiceTrack:
    token_ids: list[int] = attrs.Factory(list)
    texts: list[str] = attrs.Factory(list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Which weights sampled which tokens: vLLM gives the spans with a choice's last output.
    weight_versions: list | None = None

    def add(self, output) -> None:
        self.token_ids.extend(output.token_ids)
        self.texts.append(output.text)
        if output.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(output.logprobs)
        self.cumulative_logprob = output.cumulative_logprob
        self.finish_reason = output.finish_reason
        self.stop_reason = output.stop_reason
        if output.weight_versions is not None:
            self.weight_versions = output.weight_versions

    def as_output(self, index: int):
        return CompletionOutput(
            index=index,
            text="".join(self.texts),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            weight_versions=self.weight_versions,
        )

    def as_json(self) -> dict:
        return {
            "token_ids": self.token_ids,
            "text": "".join(self.texts),
            "logprobs": _logprobs_json(self.logprobs),
            "cumulative_logprob": self.cumulative_logprob,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }

    @classmethod
    def from_json(cls, data: dict) -> ChoiceTrack:
        return cls(
            list(data["token_ids"]),
            [data["text"]],
            _logprobs_from_json(data["logprobs"]),
            data["cumulative_logprob"],
            data["finish_reason"],
            data["stop_reason"],
        )


@attrs.define
class CallTrack:
    """One call of vLLM's ``generate``: one prompt, ``n`` choices."""

    n: int
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    choices: dict[int, ChoiceTrack] = attrs.Factory(dict)

    def observe(self, out) -> None:
        if self.prompt_token_ids is None and out.prompt_token_ids is not None:
            self.prompt_token_ids = list(out.prompt_token_ids)
            self.prompt_logprobs = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
        for output in out.outputs:
            self.choices.setdefault(output.index, ChoiceTrack()).add(output)

    def gathered(self, out):
        """``out`` (the last output of a request run with delta outputs) as vLLM's final output would be."""
        out.prompt_token_ids = self.prompt_token_ids
        out.prompt_logprobs = self.prompt_logprobs
        out.outputs = [self.choices[i].as_output(i) for i in sorted(self.choices)]
        out.finished = True
        return out

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def as_json(self) -> dict:
        return {
            "n": self.n,
            "prompt_token_ids": self.prompt_token_ids,
            "prompt_logprobs": _logprobs_json(self.prompt_logprobs),
            "choices": {str(i): c.as_json() for i, c in self.choices.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> CallTrack:
        return cls(
            data["n"],
            data["prompt_token_ids"],
            _logprobs_from_json(data["prompt_logprobs"]),
            {int(i): ChoiceTrack.from_json(c) for i, c in data["choices"].items()},
        )


@attrs.define
class RequestTrack:
    """What one HTTP request generated so far, call by call; and, on the engine it went on on, the
    record it goes on from."""

    calls: list[CallTrack] = attrs.Factory(list)
    # The record this request goes on from (None: a request of its own).
    resumed: dict | None = None
    # A stream's first event, kept to give the caller's stream id to the engine it goes on on.
    first_frame: str | None = None
    # Why this request cannot go on from its tokens so far (``why_not_continued``), if it cannot.
    not_continued: str | None = None

    def resumed_call(self, index: int) -> CallTrack | None:
        if self.resumed is None or index >= len(self.resumed["calls"]):
            return None
        return CallTrack.from_json(self.resumed["calls"][index])

    def record(self) -> bytes:
        """What another engine needs to go on with this request."""
        head = {}
        if self.resumed is not None:
            head = {k: self.resumed[k] for k in ("id", "created") if k in self.resumed}
        elif self.first_frame is not None:
            first = orjson.loads(self.first_frame[len("data: ") :])
            head = {"id": first.get("id"), "created": first.get("created")}
        if self.not_continued is not None:
            head[NOT_CONTINUED_FIELD] = self.not_continued
        return orjson.dumps({**head, "calls": [call.as_json() for call in self.calls]})


def begin(payload: dict) -> RequestTrack:
    """Start keeping what this request generates; ``payload`` loses the record it goes on from
    (checked whole here: a malformed one, which only a caller could send, is a ValueError, a 400)."""
    resumed = payload.pop(CONTINUE_FIELD, None)
    if resumed is not None:
        try:
            for call in resumed["calls"]:
                CallTrack.from_json(call)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{CONTINUE_FIELD} is skyinfer's own, and this one is malformed: {exc!r}") from None
    track = RequestTrack(resumed=resumed)
    _TRACK.set(track)
    return track


def track_outputs(engine_client: Any) -> None:
    """Route this engine's ``generate`` through the tracking below (its serving classes call it)."""
    generate = engine_client.generate

    async def tracked(prompt, sampling_params, request_id, **kwargs) -> AsyncGenerator:
        track = _TRACK.get()
        if track is None or not isinstance(sampling_params, SamplingParams):
            async for out in generate(prompt, sampling_params, request_id, **kwargs):
                yield out
            return
        if not track.calls:
            lost = (track.not_continued, why_not_continued(sampling_params))
            track.not_continued = "; ".join(reason for reason in lost if reason) or None
        call = CallTrack(sampling_params.n)
        resumed = track.resumed_call(len(track.calls))
        if resumed is not None and resumed.prompt_token_ids is None:
            resumed = None  # the engine that died had not begun it: it starts here
        track.calls.append(call)
        final_only = sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        if final_only:
            sampling_params = copy.copy(sampling_params)
            sampling_params.output_kind = RequestOutputKind.DELTA
        if resumed is None:
            outputs = generate(prompt, sampling_params, request_id, **kwargs)
        else:
            call.prompt_token_ids, call.prompt_logprobs, call.choices = (
                resumed.prompt_token_ids,
                resumed.prompt_logprobs,
                resumed.choices,
            )
            version = track.resumed.get("weight_version")
            outputs = _go_on(generate, prompt, sampling_params, request_id, kwargs, resumed, version)
        last = None
        async for out in outputs:
            call.observe(out)
            if final_only:
                last = out
            else:
                yield out
        if final_only:
            yield call.gathered(last if last is not None else _empty_output(request_id))

    engine_client.generate = tracked


# vLLM's own bound below which a temperature samples greedily.
_GREEDY_TEMPERATURE = 1e-5


def why_not_continued(params: SamplingParams) -> str | None:
    """Why a request sampled with ``params`` cannot go on on another engine from its tokens so far,
    as if uninterrupted: the state it would lose at the splice, where the next engine takes the
    tokens kept as part of its prompt (None: nothing is lost).

    What carries over: greedy and unseeded sampling, ``max_tokens`` and ``min_tokens`` (counted
    down by the tokens kept), ``logprobs`` and top logprobs, ``n`` (each unfinished choice goes on),
    ``logit_bias``, allowed and stop token ids, and the repetition penalty (vLLM applies it to the
    prompt's tokens and the answer's alike)."""
    lost = []
    if params.structured_outputs is not None:
        lost.append("structured output (its grammar would start over mid-answer)")
    if params.stop:
        lost.append("stop strings (text held back to match them, and a match across the splice, would be lost)")
    if params.frequency_penalty or params.presence_penalty:
        lost.append("frequency or presence penalties (they count the answer's tokens, which would become prompt)")
    if params.bad_words:
        lost.append("bad words (matched against the answer's own tokens)")
    if params.thinking_token_budget is not None:
        lost.append("a thinking-token budget (it counts the answer's own tokens)")
    if params.seed is not None and params.temperature > _GREEDY_TEMPERATURE:
        lost.append("a seeded sample (the seed's random stream cannot be resumed)")
    if params.extra_args:
        lost.append("vllm_xargs (what a custom logits processor keeps is unknown)")
    return "; ".join(lost) or None


def why_chat_stream_not_continued(request, reasoning_parser: str | None) -> str | None:
    """Why a chat request (vLLM's ``ChatCompletionRequest``) cannot go on on another engine: vLLM
    parses a stream's reasoning and tool calls as it goes, from the answer's first token, and the
    next engine's parser would start over mid-message. An answer that is not streamed is parsed
    whole at its end, the tokens kept included: it goes on."""
    if not request.stream:
        return None
    if reasoning_parser:
        return f"a chat stream parsed for reasoning ({reasoning_parser}: the parser would start over mid-message)"
    if request.tools and request.tool_choice != "none":
        return "a chat stream parsed for tool calls (the parser would start over mid-message)"
    return None


def _empty_output(request_id: str):
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=None, prompt_logprobs=None,
                         outputs=[], finished=True)  # fmt: skip


async def _go_on(
    generate, prompt, sampling_params, request_id: str, kwargs: dict, resumed: CallTrack, version: str | None
):
    """Each unfinished choice of ``resumed`` run from its prompt and tokens so far, its outputs as
    the choice's own (the prompt's logprobs were given already; the weight spans count the tokens
    kept, sampled by ``version``: the front goes on only on an engine with the same weights)."""
    from ..vllm_api import merge_async_iterators

    runs, indexes = [], []
    for index in range(resumed.n):
        kept = resumed.choices.get(index)
        if kept is not None and kept.finish_reason is not None:
            continue
        done = [] if kept is None else kept.token_ids
        params = copy.copy(sampling_params)
        params.n = 1
        params.prompt_logprobs = None
        if params.max_tokens is not None:
            params.max_tokens = max(1, params.max_tokens - len(done))
        params.min_tokens = max(0, params.min_tokens - len(done))
        extended = {k: v for k, v in dict(prompt).items() if k != "prompt"}
        extended["prompt_token_ids"] = list(resumed.prompt_token_ids) + list(done)
        runs.append(generate(extended, params, f"{request_id}-continued-{index}", **kwargs))
        indexes.append(index)
    async for run, out in merge_async_iterators(*runs):
        for output in out.outputs:
            output.index = indexes[run]
            kept = resumed.choices.get(output.index)
            output.weight_versions = _after(output.weight_versions, len(kept.token_ids) if kept else 0, version)
        out.prompt_token_ids = resumed.prompt_token_ids
        out.prompt_logprobs = None
        yield out


def continued_frame(frame: str, track: RequestTrack, first: bool) -> str | None:
    """An event of a stream that goes on here, as the caller's stream has it: its id and creation
    time, usage counting the tokens generated before, and (``first``: the first event sent) where
    it went on. None: an event the caller had already (a chat stream's opening role)."""
    if not frame.startswith("data: {"):
        return frame
    event = orjson.loads(frame[len("data: ") :])
    choices = event.get("choices") or []
    if first and choices and all(_opening(choice.get("delta")) for choice in choices):
        return None
    for key in ("id", "created"):
        if track.resumed.get(key) is not None:
            event[key] = track.resumed[key]
    usage = event.get("usage")
    if usage:
        before = kept_tokens(track)
        usage["completion_tokens"] += before
        usage["total_tokens"] += before
    if first:
        event["skyinfer_continued"] = continued_note(track)
    return "data: " + orjson.dumps(event).decode() + "\n\n"


def _opening(delta: dict | None) -> bool:
    return isinstance(delta, dict) and "role" in delta and not delta.get("content")


def _after(spans: list | None, kept: int, version: str | None) -> list | None:
    """Weight spans over a choice's tokens here, counted after the ``kept`` ones sampled by ``version``."""
    from ..vllm_api import WeightVersionSpan

    if spans is None:
        return None
    moved = [WeightVersionSpan(span.version, span.start + kept, span.end + kept) for span in spans]
    if kept and version is not None:
        if moved and moved[0].version == version:
            moved[0] = WeightVersionSpan(version, 0, moved[0].end)
        else:
            moved.insert(0, WeightVersionSpan(version, 0, kept))
    return moved


def finished_choices(track: RequestTrack) -> frozenset[int]:
    """The choices (numbered across prompts, as the stream numbers them) that ended before the
    request went on here: none for a request of its own."""
    if track.resumed is None:
        return frozenset()
    return frozenset(
        index + number * call["n"]
        for number, call in enumerate(track.resumed["calls"])
        for index, choice in ((int(i), c) for i, c in call["choices"].items())
        if choice["finish_reason"] is not None
    )


def kept_tokens(track: RequestTrack) -> int:
    """The tokens the request had generated before it went on here."""
    return sum(CallTrack.from_json(call).tokens for call in track.resumed["calls"])


def continued_note(track: RequestTrack) -> dict:
    """Where the request went on: the engine that died, and how many of its tokens were kept."""
    return {"from_engine": track.resumed.get("from_engine"), "tokens_kept": kept_tokens(track)}


def marker(track: RequestTrack) -> bytes:
    """The last chunk of a stream whose engine died: the record, for the front."""
    return CONTINUE_MARKER + track.record() + b"\n\n"
