"""What the front reads off a request body's bytes without parsing it: the ``model`` it names and
the start of its prompt (routing's inputs); a body is parsed only where its bytes do not settle it."""

from __future__ import annotations

import re
import zlib

import orjson

RESPONSES_PATH = "/v1/responses"


def json_object(body: bytes) -> dict | None:
    """The body as a JSON object, or None (its engine answers a body that is not one)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


# What may come right before a member's name (a quote after anything else is the escaped one of a
# name ending alike), what between its name and its value, and a string value with no escapes.
_BEFORE_NAME = frozenset(b"{, \t\r\n")
_NAME_SEPARATOR = re.compile(rb"\s*:\s*")
_PLAIN_STRING = re.compile(rb'"([^"\\]*)"')


def _first_member_value(body: bytes, quoted_name: bytes) -> int:
    """Where the value of the first member named ``quoted_name`` starts, at any depth; -1: none."""
    at = body.find(quoted_name)
    while at > 0:
        if body[at - 1] in _BEFORE_NAME and (separator := _NAME_SEPARATOR.match(body, at + len(quoted_name))):
            return separator.end()
        at = body.find(quoted_name, at + 1)
    return -1


def requested_model(body: bytes) -> str | None:
    """The body's ``model``, read off its bytes: the first member of that name, where its value is a
    plain string (a request's own ``model`` comes before any nested one); else the body is parsed."""
    start = _first_member_value(body, b'"model"')
    if start < 0:
        return None
    if plain := _PLAIN_STRING.match(body, start):
        try:
            return plain[1].decode()
        except UnicodeDecodeError:
            return None  # the engine refuses the body
    model = (json_object(body) or {}).get("model")
    return model if isinstance(model, str) else None


# Where a request's prompt is: by route (chat, completions, the token route, Responses), and on any
# other route in the first of these members it has.
_PROMPT_MEMBERS = (b'"messages"', b'"prompt"', b'"token_ids"', b'"input"')
_PROMPT_MEMBER_OF = {
    "/v1/chat/completions": (b'"messages"',),
    "/v1/completions": (b'"prompt"',),
    "/inference/v1/generate": (b'"token_ids"',),
    RESPONSES_PATH: (b'"input"',),
}
# What nests in a JSON value: strings (one still open at the end of the text taken to its end), and brackets.
_NESTING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]')


def prompt_group(body: bytes, prefix_chars: int, path: str = "") -> int | None:
    """A hash of the first ``prefix_chars`` bytes of the prompt's JSON text as the body carries it
    (less where the prompt ends sooner); None where there is none. CRC-32, not ``hash()``: front
    workers must agree on it, and each process salts ``hash()`` its own way."""
    for name in _PROMPT_MEMBER_OF.get(path, _PROMPT_MEMBERS):
        if (start := _first_member_value(body, name)) >= 0:
            break
    else:
        return None
    prompt = body[start : start + prefix_chars]
    if prompt[:1] not in (b'"', b"[", b"{"):
        return None  # null, or not JSON: no prompt to group by
    return zlib.crc32(prompt[: _value_end(prompt)])


def _value_end(text: bytes) -> int:
    """Where the JSON string, array or object ``text`` starts with ends; ``len(text)`` if not in it."""
    depth = 0
    for token in _NESTING.finditer(text):
        first = token[0][0]
        if first in b"[{":
            depth += 1
            continue
        if first in b"]}":
            depth -= 1
        if depth <= 0:
            return token.end()
    return len(text)
