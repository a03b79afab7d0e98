"""Text and JSON the service can store: the rule every input path applies.

PostgreSQL refuses NUL (U+0000) in ``text`` and ``jsonb``, and a lone surrogate
(U+D800 to U+DFFF, which JSON can spell as ``"\\ud800"``) cannot be encoded as UTF-8 at
all, so either one reaching a query is a database error, not a refusal. JSON nested
thousands deep exhausts Python's recursion limit in the parser and the encoder alike.
The API's JSON parser (``deliveries.api.parsers``), its JSON fields and the inbound
receiver refuse such input here, before anything is written.
"""

import math
import re
from typing import Any

# The service's own secrets, wherever they turn up (an exception message, a traceback):
# an endpoint signing secret ``whsec_…``, an API key ``whk_…`` or a portal link's token
# ``whp_…``.
_SECRET = re.compile(r"(whsec_|whk_|whp_)[A-Za-z0-9+/=_\-]{6,}")


def mask_secrets(text: str) -> str:
    """``text`` with anything shaped like one of the service's secrets masked: the log
    formatter's second line of defence, and what a job's stored traceback goes through."""
    if "whsec_" not in text and "whk_" not in text and "whp_" not in text:
        return text
    return _SECRET.sub(lambda m: m.group(1) + "[redacted]", text)


# Levels of arrays and objects a JSON request body may nest, the body's own object
# included. .NET's default reader stops at 64, so a deeper payload would fail at many
# receivers anyway; no webhook needs more.
MAX_JSON_DEPTH = 64

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(value: str) -> str | None:
    """What makes ``value`` unstorable (``"nul"`` or ``"surrogate"``), or None."""
    if "\x00" in value:
        return "nul"
    if _LONE_SURROGATE.search(value):
        return "surrogate"
    return None


_TEXT_PROBLEMS = {"nul": "holds a NUL character", "surrogate": "holds a lone surrogate"}


def describe_text_problem(problem: str) -> str:
    return _TEXT_PROBLEMS[problem]


def json_problem(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why a parsed JSON value cannot be taken, as a phrase, or None: nested deeper than
    ``max_depth``, a key or string holding NUL or a lone surrogate, or a number that is
    no finite float (``1e999`` parses to infinity). Iterative, so no depth can make it
    recurse."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > max_depth:
                return f"is nested deeper than {max_depth} levels"
            if isinstance(item, dict):
                for key in item:
                    if problem := text_problem(key):
                        return f"has a key that {describe_text_problem(problem)}"
                children = item.values()
            else:
                children = item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, str):
            if problem := text_problem(item):
                return f"has a string that {describe_text_problem(problem)}"
        elif isinstance(item, float) and not math.isfinite(item):
            return "has a number out of range"
    return None
