"""Admin and weight-transfer bodies as declared, typed objects (pydantic models).

One model per body or set of query parameters: parsing is the validation,
and a refusal is a ``WireError`` (400) that names the parameter, says what
was expected and what came. Unknown fields are ignored, as vLLM ignores them.

vLLM's server reads admin parameters from the query string
(``/pause?mode=keep``); some clients send them in a JSON body instead
(SkyRL's ``reset_prefix_cache`` does). Both are read: a parameter may be
given in both places as long as they agree. The front forwards the canonical
query string to every engine, which parses it with the same model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

# typing.Self is 3.11+; pydantic brings typing_extensions.
from typing_extensions import Self

from .errors import BadRequest

PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache", "scheduling"]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _header_value(what: str, header: str, *, strip: bool = False) -> AfterValidator:
    """Values that travel in a header: 1 to 256 printable ASCII characters."""
    edges = ", no spaces at either end" if strip else ""

    def check(value: str) -> str:
        printable = 0 < len(value) <= 256 and value.isascii() and value.isprintable()
        if not printable or (strip and value != value.strip()):
            raise ValueError(
                f"{what} is 1 to 256 printable ASCII characters{edges} (it travels in the {header} header)"
            )
        return value

    return AfterValidator(check)


VersionLabel = Annotated[str, _header_value("a weight version", "X-Weight-Version", strip=True)]
_session_id_check = _header_value("a session id", "X-Session-ID")
SessionId = Annotated[str, _session_id_check]


def checked_session_id(value: str, param: str) -> str:
    """A session id from a request, or a 400 naming where it came from."""
    try:
        return _session_id_check.func(value)
    except ValueError as exc:
        raise WireError(f"{param}: {exc}; got {value[:80]!r}", param) from None


def takes(model: type[WireModel]):
    """Mark a route's handler with the body or query parameters it reads: the route reference
    (docs/) lists them from here."""

    def mark(handler):
        handler.takes = model
        return handler

    return mark


class WireError(BadRequest):
    """Bad admin input; the message says what is wrong and how to fix it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param=param)

    @classmethod
    def from_validation(cls, exc: ValidationError, model: type[BaseModel], prefix: tuple = ()) -> WireError:
        first, *rest = exc.errors()
        # A union's branch shows in the location as its type ("list[...]"), a validator as "function-...".
        loc = [
            part
            for part in first["loc"]
            if not (isinstance(part, str) and ("[" in part or part.startswith("function-")))
        ]
        param = ".".join(str(part) for part in (*prefix, *loc)) or None
        reason = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            field = model.model_fields.get(str(loc[0]))
            message = f"{param} is required" + (f" ({field.description})" if field and field.description else "")
        elif not loc:  # the model's own check, across fields
            message = reason
        else:
            shown = repr(first["input"])
            message = f"{param}: {reason}; got {shown if len(shown) <= 80 else shown[:77] + '...'}"
        if rest:
            message += f" (and {len(rest)} more problem{'s' if len(rest) > 1 else ''})"
        return cls(message, param)


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    @classmethod
    def parse(cls, data: Any, prefix: tuple = ()) -> Self:
        """The model from a plain dict; ``prefix`` places it in the body for error messages."""
        if not isinstance(data, Mapping):
            where = ".".join(prefix) or "the body"
            raise WireError(f"{where} must be a JSON object, not {type(data).__name__}", ".".join(prefix) or None)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise WireError.from_validation(exc, cls, prefix) from None

    def given(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.model_fields_set}


def _query_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class QueryParams(WireModel):
    """Parameters vLLM reads from the query string, also accepted from a JSON body."""

    # Parameters given as a list: ``?tags=weights&tags=kv_cache``.
    REPEATED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_request(cls, query: Mapping[str, str], body: Mapping[str, Any] | None = None) -> Self:
        in_query = cls.parse(cls._query_values(query))
        in_body = cls.parse({k: v for k, v in (body or {}).items() if k in cls.model_fields})
        for name in in_query.model_fields_set & in_body.model_fields_set:
            said, also = getattr(in_query, name), getattr(in_body, name)
            if said != also:
                raise WireError(f"{name} is {said!r} in the query string but {also!r} in the body: give it once", name)
        return cls.model_validate({**in_body.given(), **in_query.given()})

    @classmethod
    def _query_values(cls, query: Mapping[str, str]) -> dict[str, Any]:
        getall = getattr(query, "getall", None)
        values = {}
        for name in cls.model_fields:
            given = getall(name, []) if getall else ([query[name]] if name in query else [])
            if name in cls.REPEATED:
                if given:
                    values[name] = given
            elif len(given) > 1:
                raise WireError(f"query parameter {name!r} given {len(given)} times", name)
            elif given:
                values[name] = given[0]
        return values

    def to_query(self) -> list[tuple[str, str]]:
        """Every parameter, spelled as vLLM's query string spells it."""
        pairs = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            for item in (value or ()) if name in self.REPEATED else (value,):
                pairs.append((name, _query_text(item)))
        return pairs


class PauseParams(QueryParams):
    mode: PauseMode = "abort"
    clear_cache: bool = True


class SleepParams(QueryParams):
    level: Annotated[int, Field(ge=0, le=2)] = 1
    mode: PauseMode = "abort"


class WakeUpParams(QueryParams):
    # None wakes everything, as in vLLM.
    tags: tuple[WakeTag, ...] | None = None
    REPEATED = ("tags",)


class ResetPrefixCacheParams(QueryParams):
    reset_running_requests: bool = False
    reset_external: bool = False


class FinishSessionParams(QueryParams):
    """``/finish_session?session_id=...`` as SkyRL's and prime-rl's clients send it."""

    # Optional here, as every query parameter (each place is parsed on its own); required by the route.
    session_id: SessionId | None = None


class AbortParams(WireModel):
    # None (or no body) aborts every request in flight; an empty list aborts none.
    request_ids: tuple[NonEmptyStr, ...] | None = None

    def to_body(self) -> dict:
        return {"request_ids": None if self.request_ids is None else list(self.request_ids)}


# -- weight transfer ----------------------------------------------------------------


class InitRequest(WireModel):
    # Checked by the transport's own model (transfer/protocol.py), then forwarded to the engines.
    init_info: dict


class StartRequest(WireModel):
    update_info: dict | None = None
    # The update's chunks are received into staging copies while the engines generate; its
    # finish swaps them in between two steps.
    staged: bool = False
    # TRL's async GRPO client sends true. Pushes are reloaded layer by layer from
    # checkpoint-format tensors; weights already in the kernels' layout cannot be.
    is_checkpoint_format: bool = True

    @model_validator(mode="after")
    def _checkpoint_format_only(self) -> Self:
        if not self.is_checkpoint_format:
            raise ValueError("is_checkpoint_format false is not supported: send the checkpoint's own tensors")
        return self


# After a push, requests that were running go on with their KV recomputed by the new weights
# ("recompute", exact), or over the KV they have ("keep": the off-policy trade-off some async
# trainers make; the response's weight spans say where the new weights began).
KvRule = Literal["recompute", "keep"]


class UpdateRequest(WireModel):
    update_info: dict
    weight_version: VersionLabel | None = None
    # A one-call push received into staging copies while the engines generate, swapped in
    # between two steps (for an update opened by /start_weight_update, its start says so).
    staged: bool = False
    kv: KvRule = "recompute"
    # Only check what the call would be refused for (nothing moves, no engine is asked): a group
    # trainer asks first, so that it does not broadcast into a push the server refuses (short of
    # a change of the fleet between the two calls).
    check_only: bool = False


# Per-tensor digests as vLLM's ``/weight_checker`` computes them (sha256 of each
# parameter's bytes, keyed by worker and vLLM's parameter name).
Checksums = dict[str, str]


class FinishRequest(WireModel):
    weight_version: VersionLabel | None = None
    # Check after the push that every engine holds the same weights (or these).
    verify: bool = False
    expected_checksums: Checksums | None = None
    kv: KvRule = "recompute"

    @property
    def verifies(self) -> bool:
        return self.verify or self.expected_checksums is not None


class WeightCheckRequest(WireModel):
    """vLLM's ``/weight_checker`` body."""

    action: Literal["checksum", "compare", "reset"]
    baseline: Checksums | None = None

    @model_validator(mode="after")
    def _compare_needs_a_baseline(self) -> Self:
        if self.action == "compare" and self.baseline is None:
            raise ValueError("action 'compare' requires a baseline object (the checksums of action 'checksum')")
        return self


class RelabelRequest(WireModel):
    """vLLM's ``/update_weight_version``: a new label for the weights the fleet serves."""

    new_version: VersionLabel


# -- LoRA adapters -------------------------------------------------------------------


class LoadAdapterRequest(WireModel):
    """vLLM's ``/v1/load_lora_adapter`` body, plus the version label the adapter then serves as."""

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr
    load_inplace: bool = False
    version: VersionLabel | None = None


class UnloadAdapterRequest(WireModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (its ``lora_int_id`` is accepted and not needed)."""

    lora_name: NonEmptyStr
    lora_int_id: int | None = None


class PushAdapterRequest(WireModel):
    """An adapter pushed over the weight-transfer group: its PEFT config, and which tensors follow."""

    lora_name: NonEmptyStr
    peft_config: dict
    update_info: dict
    version: VersionLabel | None = None
    # Only check the adapter and the group (nothing moves): a trainer asks first, so that it
    # does not broadcast into a push the server refuses (short of a change between the two calls).
    check_only: bool = False
