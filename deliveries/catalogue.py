"""The event catalogue's rules: event-type filters with prefix wildcards, and payloads
checked against their type's JSON Schema.

A filter entry is an event type's name (``invoice.paid``) or a dotted prefix followed by
``.*`` (``invoice.*``: ``invoice.paid``, ``invoice.payment.failed``, every type under
``invoice.``). The dotted prefixes are the catalogue's groups. One rule, written here:
the PostgreSQL publish statement asks whether an endpoint's filter holds any of
``filter_patterns(event_type)`` (jsonb ``?|``), the SQLite spelling and
``Endpoint.subscribes_to`` ask ``matches``.

Schemas: what a JSON Schema and an example must be (``validate_json_schema``,
``example_problem``); the payloads published are checked against them by
``deliveries.schemas``. Pure rules: no database here.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.exceptions import ValidationError as SchemaMismatch

WILDCARD = ".*"


# --- Filters ----------------------------------------------------------------------------


def filter_patterns(event_type: str) -> list[str]:
    """The filter entries that select ``event_type``: its name and the wildcard of each
    of its dotted prefixes (``a.b.c``: ``a.b.c``, ``a.*``, ``a.b.*``)."""
    parts = event_type.split(".")
    return [event_type] + [".".join(parts[:n]) + WILDCARD for n in range(1, len(parts))]


def matches(patterns: Iterable[str], event_type: str) -> bool:
    """Whether a filter selects ``event_type`` (an empty filter selects every type)."""
    patterns = list(patterns)
    return not patterns or not set(filter_patterns(event_type)).isdisjoint(patterns)


def group_of(event_type: str) -> str:
    """The group a type is listed under: its name up to the last dot ("" for none)."""
    return event_type.rpartition(".")[0]


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` can never select a type, or None. ``*`` is allowed only as the
    last segment of a dotted prefix, because a filter that matched nothing would be a
    silent loss."""
    if not pattern or not pattern.strip():
        return "is blank"
    if pattern == "*":
        return "selects every type: leave the list empty for that"
    prefix = pattern.removesuffix(WILDCARD)
    if "*" in prefix:
        return "may hold * only as a whole last segment, as in invoice.*"
    if pattern.endswith(WILDCARD) and "" in prefix.split("."):
        return "has an empty segment before .*"
    return None


def validate_event_type_filter(patterns: Iterable[str]) -> None:
    """Refuse a filter with an entry that could never match (ValidationError naming it)."""
    problems = [f"{p!r} {problem}" for p in patterns if (problem := pattern_problem(p))]
    if problems:
        raise ValidationError([f"event type {problem}." for problem in problems])


def event_type_problem(event_type: str) -> str | None:
    """Why a published type's name is refused, or None: ``*`` is the filters' wildcard."""
    if not event_type or len(event_type) > 200:
        return "event_type must be 1 to 200 characters"
    if "*" in event_type:
        return "event_type must not hold *, the filters' wildcard"
    return None


# --- Schemas ----------------------------------------------------------------------------


def validate_json_schema(schema: Any) -> None:
    """A JSON Schema (Draft 2020-12) that can check payloads: the model's validator."""
    if not isinstance(schema, dict):
        raise ValidationError("A JSON Schema is a JSON object ({} accepts any payload).")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValidationError(
            f"Not a valid JSON Schema at {json_path(exc.absolute_path)}: {exc.message}"
        ) from None
    except RecursionError:
        raise ValidationError("The JSON Schema is nested too deep.") from None


def json_path(parts: Iterable) -> str:
    """``$.items[0].amount`` from a jsonschema error's path."""
    path = "$"
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def example_problem(schema: dict, example: Any) -> str | None:
    """Why ``example`` does not match ``schema`` (a valid schema), or None."""
    error = best_match(Draft202012Validator(schema).iter_errors(example))
    if error is None:
        return None
    problem = mismatch_problem("", 0, "", error)
    return f"The example does not match the schema: {problem.path}: {problem.message}"


@dataclass(frozen=True)
class SchemaProblem:
    """Why a payload does not match its type's schema: where, and what is wrong.

    ``message`` quotes the offending value (the caller's own data, for its error);
    ``reason`` does not, and is what a log line may carry."""

    event_type: str
    version: int
    mode: str
    path: str
    message: str
    reason: str
    schema_path: str

    def sentence(self) -> str:
        return (
            f"The payload does not match the schema of {self.event_type} version "
            f"{self.version}: {self.path}: {self.message}"
        )


def mismatch_problem(
    event_type: str, version: int, mode: str, error: SchemaMismatch
) -> SchemaProblem:
    path = list(error.absolute_path)
    message = error.message
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [name for name in error.validator_value if name not in error.instance]
        if missing:  # name the missing member's own path
            path.append(missing[0])
            message = "is required"
    schema_path = "/" + "/".join(str(p) for p in error.absolute_schema_path)
    return SchemaProblem(
        event_type=event_type,
        version=version,
        mode=mode,
        path=json_path(path),
        message=message[:500],
        reason=f"fails {error.validator!r} at {schema_path}",
        schema_path=schema_path,
    )
