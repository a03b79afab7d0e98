"""The hot path's raw SQL runs through this cursor.

Django's psycopg backend binds parameters on the client (psycopg's ``ClientCursor``),
which quotes every element of a 200-id array into the query text in Python. The claim,
lease and record statements pass such arrays, so they use server-side binding instead: the
ids travel as one typed parameter. Same connection, same transaction as the ORM.
"""

from contextlib import contextmanager

import psycopg
from django.db import connection


@contextmanager
def bound_cursor():
    """A server-side-binding cursor on Django's current PostgreSQL connection."""
    connection.ensure_connection()
    with psycopg.Cursor(connection.connection) as cursor:
        yield cursor
