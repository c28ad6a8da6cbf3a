"""Requests the engine refuses with a 400 before vLLM sees them: each one made vLLM answer a 500.

Both the engine's own routes and vLLM's app behind it check here, on the
plain JSON body.
"""

from __future__ import annotations

import re
from typing import Any

# vLLM's app parses bodies with Python's json, whose recursion a deeply nested body exhausts
# (RecursionError: a 500 from vLLM). No request of vLLM's nests anywhere near this deep.
MAX_JSON_DEPTH = 256
_JSON_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def nested_too_deep(body: bytes) -> str | None:
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return None  # cheap: not enough brackets to nest that deep
    depth = 0
    for token in _JSON_STRING_OR_BRACKET.finditer(body):
        bracket = token.group()
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels"
        elif bracket in (b"]", b"}"):
            depth -= 1
    return None


def constraints_conflict(payload: Any) -> str | None:
    """Why the request's sampling constraints may leave no token to sample, or None.

    With ``allowed_token_ids`` and a grammar (structured outputs, a JSON
    response format, a named or required tool), the sampler must pick a token
    of the list even where the grammar admits none of them; vLLM's grammar then
    rejects it and fails the request with a 500 (vLLM 0.32).
    """
    if not isinstance(payload, dict):
        return None
    nested = payload.get("sampling_params")  # the token route's
    response_format = payload.get("response_format")
    grammar_outside_params = (isinstance(response_format, dict) and response_format.get("type", "text") != "text") or (
        payload.get("tool_choice") not in (None, "none", "auto")
    )
    for params in (payload, nested) if isinstance(nested, dict) else (payload,):
        if params.get("allowed_token_ids") and (grammar_outside_params or params.get("structured_outputs") is not None):
            return "allowed_token_ids cannot be combined with structured outputs (a grammar may admit none of them)"
    return None
