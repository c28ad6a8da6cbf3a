"""A request whose engine dies goes on on another engine, from where it was: the engine's side, what
a running request generated (its record, answered if the EngineCore dies) and going on from another
engine's record. docs/architecture.rst ("Inside an engine") says how."""

from __future__ import annotations

import contextvars
import copy
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import attrs
import orjson

from ..engine_wire import CONTINUE_FIELD, CONTINUE_MARKER, NOT_CONTINUED_FIELD
from ..vllm_api import (
    ChatCompletionRequest,
    CompletionOutput,
    CompletionRequest,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    WeightVersionSpan,
)

__all__ = [
    "RequestTrack",
    "begin",
    "continued_frame",
    "finished_choices",
    "marker",
    "note_request",
    "track_outputs",
    "why_chat_stream_not_continued",
    "why_not_continued",
    "why_request_not_continued",
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
    # Which weights sampled which tokens: vLLM gives the spans with a choice's last output; a record
    # gives those of the tokens kept.
    weight_versions: list[WeightVersionSpan] | None = None

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

    def spans(self, starts: list[tuple[str, int]] | None) -> list[WeightVersionSpan] | None:
        """Which weights sampled each token so far: the spans given, else those of ``starts`` (the
        (version, first token) pairs vLLM's output processor noted as the tokens came), up to the
        tokens kept here. None where they do not cover exactly those tokens."""
        spans = self.weight_versions
        if spans is None:
            begun = [(version, start) for version, start in starts or () if start < len(self.token_ids)]
            ends = [start for _, start in begun[1:]] + [len(self.token_ids)]
            spans = [WeightVersionSpan(version, start, end) for (version, start), end in zip(begun, ends)]
        covered = 0
        for span in spans:
            if span.start != covered:
                return None
            covered = span.end
        return spans if covered == len(self.token_ids) else None

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

    def as_json(self, starts: list[tuple[str, int]] | None) -> dict:
        spans = self.spans(starts)
        return {
            "token_ids": self.token_ids,
            "text": "".join(self.texts),
            "logprobs": _logprobs_json(self.logprobs),
            "cumulative_logprob": self.cumulative_logprob,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "weight_versions": None if spans is None else [[s.version, s.start, s.end] for s in spans],
        }

    @classmethod
    def from_json(cls, data: dict) -> ChoiceTrack:
        spans = data["weight_versions"]
        return cls(
            list(data["token_ids"]),
            [data["text"]],
            _logprobs_from_json(data["logprobs"]),
            data["cumulative_logprob"],
            data["finish_reason"],
            data["stop_reason"],
            None if spans is None else [WeightVersionSpan(version, start, end) for version, start, end in spans],
        )


@attrs.define
class CallTrack:
    """One call of vLLM's ``generate``: one prompt, ``n`` choices."""

    n: int
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    choices: dict[int, ChoiceTrack] = attrs.Factory(dict)
    # Per choice, the list of (version, first token) vLLM's output processor appends to as the
    # choice's tokens come (``_version_starts``), while it runs.
    version_starts: dict[int, list[tuple[str, int]]] = attrs.Factory(dict)

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
            "choices": {str(i): c.as_json(self.version_starts.get(i)) for i, c in self.choices.items()},
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
    # Of a stream that goes on here: the choices (numbered as the stream numbers them) whose first
    # chunk the caller had, and where a choice's ``text_offset`` goes on (completions with logprobs).
    begun: frozenset[int] = frozenset()
    text_offsets: dict[int, int] = attrs.Factory(dict)

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
        calls = [call.as_json() for call in self.calls]
        lost = [self.not_continued] if self.not_continued is not None else []
        if any(choice["weight_versions"] is None for call in calls for choice in call["choices"].values()):
            lost.append("which weights sampled its tokens so far is not known here")
        if lost:
            head[NOT_CONTINUED_FIELD] = "; ".join(lost)
        return orjson.dumps({**head, "calls": calls})


def begin(payload: dict, from_front: bool) -> RequestTrack:
    """Start keeping what this request generates; ``payload`` loses the record it goes on from.
    The record is taken only from the front (``from_front``: the request carries its header, which
    the front never passes on from a caller); a caller's is dropped, as the front drops one whose
    name it finds in a body's bytes (a name spelled with JSON escapes gets past that check).
    Checked whole here: a malformed one is a ValueError, a 400."""
    resumed = payload.pop(CONTINUE_FIELD, None)
    track = RequestTrack(resumed=resumed if from_front else None)
    if track.resumed is not None:
        try:
            kept = list(_kept_choices(track))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{CONTINUE_FIELD} is skyinfer's own, and this one is malformed: {exc!r}") from None
        track.begun = frozenset(index for index, choice in kept if choice.token_ids)
    _TRACK.set(track)
    return track


def note_request(track: RequestTrack, request: Any, state: Any) -> None:
    """What the request's own fields (vLLM's parsed request; ``state``: vLLM's serving state) mean
    for going on: why it cannot, if it cannot; and, for a completion stream with logprobs that goes
    on here, where each kept choice's ``text_offset`` goes on (the next engine's stream counts from
    0): after its kept tokens' strings, as vLLM's completion stream counts them."""
    track.not_continued = why_request_not_continued(
        request,
        state.args.structured_outputs_config.reasoning_parser,
        state.vllm_config.model_config.hf_config.model_type,
    )
    if track.resumed is None or not isinstance(request, CompletionRequest):
        return
    if request.stream and request.logprobs is not None:
        serving = state.openai_serving_completion
        for index, choice in _kept_choices(track):
            if choice.token_ids:
                counted = serving._create_completion_logprobs(
                    token_ids=choice.token_ids,
                    top_logprobs=choice.logprobs,
                    num_output_top_logprobs=request.logprobs,
                    tokenizer=serving.renderer.tokenizer,
                    return_as_token_id=request.return_tokens_as_token_ids,
                )
                track.text_offsets[index] = counted.text_offset[-1] + len(counted.tokens[-1])


def _version_starts(engine_client: Any, request_id: str) -> dict[int, list[tuple[str, int]]]:
    """Per choice of a running request, vLLM's own list of (version, first token) of the weights
    that sampled its tokens, which its output processor appends to as they come (vLLM gives the
    spans only with a choice's last output; the record of an engine that dies needs them before)."""
    processor = engine_client.output_processor
    states = (processor.request_states.get(i) for i in processor.external_req_ids.get(request_id, ()))
    return {state.request_index: state.weight_version_starts for state in states if state is not None}


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
            outputs = _go_on(generate, prompt, sampling_params, request_id, kwargs, resumed)
        last = None
        async for out in outputs:
            call.observe(out)
            if resumed is None and not call.version_starts:
                call.version_starts = _version_starts(engine_client, request_id)
            if final_only:
                last = out
            else:
                yield out
        if final_only:
            yield call.gathered(last)

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


def why_request_not_continued(request: Any, reasoning_parser: str | None, model_type: str) -> str | None:
    """Why a request (vLLM's parsed request) cannot go on on another engine, for what vLLM's serving
    layer does with it: beam search calls ``generate`` once per beam per step, calls a record cannot
    be matched to; a stream's ``echo`` would be echoed again by the next engine; and a chat stream
    may be parsed as it goes (``why_chat_stream_not_continued``)."""
    lost = []
    if getattr(request, "use_beam_search", False):
        lost.append("beam search (a generate call per beam per step, which cannot be resumed)")
    if getattr(request, "stream", False) and getattr(request, "echo", False):
        lost.append("echo in a stream (the next engine would echo the prompt again mid-answer)")
    if isinstance(request, ChatCompletionRequest):
        lost.append(why_chat_stream_not_continued(request, reasoning_parser, model_type))
    return "; ".join(reason for reason in lost if reason) or None


def why_chat_stream_not_continued(request, reasoning_parser: str | None, model_type: str | None = None) -> str | None:
    """Why a chat request (vLLM's ``ChatCompletionRequest``) cannot go on on another engine: vLLM
    parses a stream's reasoning and tool calls as it goes, from the answer's first token (a gpt-oss
    model's, ``model_type``, always: Harmony), and the next engine's parser would start over
    mid-message. An answer that is not streamed is parsed whole at its end, the tokens kept
    included: it goes on."""
    if not request.stream:
        return None
    if model_type == "gpt_oss":
        return "a gpt-oss chat stream (parsed by Harmony as it goes: the parser would start over mid-message)"
    if reasoning_parser:
        return f"a chat stream parsed for reasoning ({reasoning_parser}: the parser would start over mid-message)"
    if request.tools and request.tool_choice != "none":
        return "a chat stream parsed for tool calls (the parser would start over mid-message)"
    return None


async def _go_on(generate, prompt, sampling_params, request_id: str, kwargs: dict, resumed: CallTrack):
    """Each unfinished choice of ``resumed`` run from its prompt and tokens so far, its outputs as
    the choice's own (the prompt's logprobs were given already; the weight spans go on from the
    kept tokens'). With every choice finished, one output with no tokens: the prompt's, which the
    stream's usage counts."""
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
    if not runs:
        yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=resumed.prompt_token_ids,
                            prompt_logprobs=None, outputs=[], finished=True)  # fmt: skip
        return
    async for run, out in merge_async_iterators(*runs):
        for output in out.outputs:
            output.index = indexes[run]
            kept = resumed.choices.get(output.index)
            output.weight_versions = _joined([] if kept is None else kept.weight_versions, output.weight_versions)
        out.prompt_token_ids = resumed.prompt_token_ids
        out.prompt_logprobs = None
        yield out


def continued_frame(frame: str, track: RequestTrack, first: bool) -> str | None:
    """An event of a stream that goes on here, as the caller's stream has it: its id and creation
    time, usage counting the tokens generated before, no prompt token ids again for a choice the
    caller had them for, text offsets after the kept text's, and (``first``: the first event sent)
    where it went on. None: an event the caller had already (a chat stream's opening role)."""
    if not frame.startswith("data: {"):
        return frame
    event = orjson.loads(frame[len("data: ") :])
    choices = event.get("choices") or []
    if first and choices and all(_opening(choice.get("delta")) for choice in choices):
        return None
    for key in ("id", "created"):
        if track.resumed.get(key) is not None:
            event[key] = track.resumed[key]
    if track.begun:
        # The token route's, on its first chunk (with the prompt's multimodal placeholders).
        event.pop("prompt_token_ids", None)
        event.pop("mm_placeholders", None)
    for choice in choices:
        index = choice.get("index", 0)
        if index in track.begun and choice.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = None  # a completion choice's, on its first chunk
        logprobs = choice.get("logprobs")
        if index in track.text_offsets and isinstance(logprobs, dict) and logprobs.get("text_offset"):
            logprobs["text_offset"] = [offset + track.text_offsets[index] for offset in logprobs["text_offset"]]
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


def _joined(kept: list[WeightVersionSpan] | None, spans: list | None) -> list[WeightVersionSpan] | None:
    """The weight spans over a choice's tokens: ``kept`` (of the tokens kept from the engine that
    died), then ``spans`` (vLLM's, over the tokens generated here, counted after them), one span
    where the weights are the same across the splice, as an uninterrupted request has it."""
    if kept is None or spans is None:
        return None
    joined = list(kept)
    offset = kept[-1].end if kept else 0
    for span in spans:
        if joined and joined[-1].version == span.version:
            joined[-1] = WeightVersionSpan(span.version, joined[-1].start, span.end + offset)
        else:
            joined.append(WeightVersionSpan(span.version, span.start + offset, span.end + offset))
    return joined


def _kept_choices(track: RequestTrack) -> Iterator[tuple[int, ChoiceTrack]]:
    """The choices of the record this request goes on from, numbered across prompts as a stream
    numbers them."""
    for number, call in enumerate(track.resumed["calls"]):
        for index, choice in CallTrack.from_json(call).choices.items():
            yield index + number * call["n"], choice


def finished_choices(track: RequestTrack) -> frozenset[int]:
    """The choices (numbered as the stream numbers them) that ended before the request went on
    here: none for a request of its own."""
    if track.resumed is None:
        return frozenset()
    return frozenset(index for index, choice in _kept_choices(track) if choice.finish_reason is not None)


def kept_tokens(track: RequestTrack) -> int:
    """The tokens the request had generated before it went on here."""
    return sum(len(choice.token_ids) for _, choice in _kept_choices(track))


def continued_note(track: RequestTrack) -> dict:
    """Where the request went on: the engine that died, and how many of its tokens were kept."""
    return {"from_engine": track.resumed.get("from_engine"), "tokens_kept": kept_tokens(track)}


def marker(track: RequestTrack) -> bytes:
    """The last chunk of a stream whose engine died: the record, for the front."""
    return CONTINUE_MARKER + track.record() + b"\n\n"
