"""Cursor pagination whose cursors are checked before they reach a query.

A cursor is base64 of ``o=<offset>&r=<reverse>&p=<position>``, where the position is the
first ordering field of the last row seen. It is opaque, not signed: a client can send
anything. DRF answers a cursor it cannot decode with a 404 and passes the position to
the database as it came, where a time PostgreSQL cannot hold (an offset of -20:00) or a
position that is no number is a 500. Here every such cursor is a 400 ``invalid_cursor``
in the one error shape, and a position passes only in the form the API writes it.
"""

import re
from base64 import b64decode
from datetime import datetime, timedelta

from rest_framework import exceptions, pagination

from ..core.text import text_problem


class InvalidCursor(exceptions.APIException):
    status_code = 400
    default_code = "invalid_cursor"
    default_detail = "Invalid cursor: use the next and previous links as given."


def utc_time_position(value: str) -> str:
    """A time as ``str()`` of an aware UTC datetime writes it (the API's own); a time
    in any other zone was not written by the API."""
    parsed = datetime.fromisoformat(value)
    if parsed.utcoffset() != timedelta(0):
        raise ValueError("a cursor's time is in UTC")
    return value


_COUNT = re.compile(r"[0-9]{1,9}")


def count_position(value: str) -> str:
    """A non-negative integer that fits a PostgreSQL integer column."""
    if not _COUNT.fullmatch(value):
        raise ValueError("a cursor's count is a small non-negative integer")
    return value


class CheckedCursorPagination(pagination.CursorPagination):
    """``position`` checks the position of a cursor's first ordering field."""

    position = staticmethod(utc_time_position)

    def decode_cursor(self, request):
        try:
            # DRF's decoder skips characters outside the base64 alphabet, so "!!!" would
            # read as an empty cursor (the first page); the API's own cursors are strict.
            b64decode(request.query_params.get(self.cursor_query_param, ""), validate=True)
            cursor = super().decode_cursor(request)
        except (ValueError, exceptions.NotFound):
            raise InvalidCursor from None
        if cursor is None or cursor.position is None:
            return cursor
        try:
            self.position(cursor.position)
        except ValueError:
            raise InvalidCursor from None
        return cursor


class NewestFirst(CheckedCursorPagination):
    ordering = ("-created_at", "-id")
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 250


class NewestDeliveriesFirst(NewestFirst):
    # The listing's creation time (DeliveryViewSet.get_queryset): its indexes give a
    # tenant's or an endpoint's deliveries in this order (models.DeliveryListing).
    ordering = ("-listed_at", "-id")


def name_position(value: str) -> str:
    """An event type's name as the catalogue stores it."""
    if not value or len(value) > 200 or text_problem(value):
        raise ValueError("a cursor's name is an event type's name")
    return value


class ByName(CheckedCursorPagination):
    ordering = ("name",)
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 250
    position = staticmethod(name_position)


class AttemptPages(CheckedCursorPagination):
    ordering = ("number", "id")
    page_size = 100
    position = staticmethod(count_position)
