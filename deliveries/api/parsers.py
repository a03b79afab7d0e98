"""Request bodies the API can take: JSON held to ``deliveries.core.text.json_problem``."""

from rest_framework import exceptions, parsers, serializers

from ..core.text import MAX_JSON_DEPTH, json_problem

# A JSON field's value sits one level inside the body's own object.
FIELD_MAX_DEPTH = MAX_JSON_DEPTH - 1


def checked_json(parse):
    """``parse()``'s JSON, or ``ParseError`` when it is too deep or holds what the
    database refuses. Deep enough to exhaust the recursion limit, the parser itself
    raises RecursionError, which no JSON library turns into a ValueError."""
    try:
        data = parse()
    except RecursionError:
        raise exceptions.ParseError(
            f"JSON parse error - the body is nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    problem = json_problem(data)
    if problem:
        raise exceptions.ParseError(f"JSON parse error - the body {problem}")
    return data


class StrictJSONParser(parsers.JSONParser):
    """DRF's JSON parser (``NaN`` and ``Infinity`` already refused), and then the body
    checked: a 400 ``parse_error`` in the one error shape instead of a 500 later."""

    def parse(self, stream, media_type=None, parser_context=None):
        parse = super().parse
        return checked_json(lambda: parse(stream, media_type, parser_context))


class StrictJSONField(serializers.JSONField):
    """A JSON field held to the same rule. A form-encoded or multipart body carries its
    JSON as a string, which this field parses itself, past the body parser."""

    def to_internal_value(self, data):
        try:
            value = super().to_internal_value(data)
        except RecursionError:
            raise serializers.ValidationError(
                f"This value is nested deeper than {FIELD_MAX_DEPTH} levels."
            ) from None
        problem = json_problem(value, max_depth=FIELD_MAX_DEPTH)
        if problem:
            raise serializers.ValidationError(f"This value {problem}.")
        return value
