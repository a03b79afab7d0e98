"""Payloads checked against their type's JSON Schema at publish.

An ``EventType`` may carry one JSON Schema (Draft 2020-12) per payload version
(``EventTypeVersion``) and a validation mode, ``reject`` (publishing refuses the payload),
``warn`` (logs and counts it, publishes anyway) or ``off``. Publishing reads the compiled
schemas through a per-process cache: a change made in this process (the admin's
included) clears it at once; other processes see it within
``EVENT_SCHEMA_CACHE_SECONDS``.
"""

import time
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from deliveries.core.conf import settings

from .catalogue import SchemaProblem, mismatch_problem
from .models import EventType, EventTypeVersion, SchemaValidation


@dataclass(frozen=True)
class _Compiled:
    mode: str
    validators: dict[int, Draft202012Validator]


_CACHE: dict[str, tuple[float, _Compiled | None]] = {}
_CACHE_MAX = 1000  # types not in the catalogue are cached too; bounded


def forget_schemas(**_signal_kwargs) -> None:
    """Empty this process's schema cache (connected to catalogue changes)."""
    _CACHE.clear()


def _compiled(event_type: str) -> _Compiled | None:
    now = time.monotonic()
    hit = _CACHE.get(event_type)
    if hit is not None and hit[0] > now:
        return hit[1]
    found = None
    row = EventType.objects.filter(name=event_type).values_list("validation", flat=True).first()
    if row is not None and row != SchemaValidation.OFF:
        versions = EventTypeVersion.objects.filter(event_type_id=event_type).values_list(
            "version", "schema"
        )
        validators = {v: Draft202012Validator(schema) for v, schema in versions}
        found = _Compiled(row, validators) if validators else None
    ttl = settings.EVENT_SCHEMA_CACHE_SECONDS
    if ttl > 0:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[event_type] = (now + ttl, found)
    return found


def schema_problem(event_type: str, version: int, payload: Any) -> SchemaProblem | None:
    """What is wrong with ``payload`` for version ``version`` of ``event_type``, or None
    (it matches, the type is not in the catalogue, has no schema, or its mode is off)."""
    compiled = _compiled(event_type)
    if compiled is None:
        return None
    validator = compiled.validators.get(version)
    if validator is None:
        known = ", ".join(str(v) for v in sorted(compiled.validators))
        return SchemaProblem(
            event_type,
            version,
            compiled.mode,
            "$",
            f"there is no payload version {version} (versions: {known})",
            f"no payload version {version}",
            "",
        )
    try:
        error = best_match(validator.iter_errors(payload))
    except RecursionError:
        return SchemaProblem(
            event_type, version, compiled.mode, "$", "is nested too deep", "too deep", ""
        )
    if error is None:
        return None
    return mismatch_problem(event_type, version, compiled.mode, error)
