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
    """A server-side-binding cursor on Django's current PostgreSQL connection.

    psycopg's own errors are translated to Django's (``OperationalError`` for a dropped
    connection or a restarting server) and mark the connection as having failed, exactly
    as through a Django cursor: without that, the loops' "database unavailable, retry"
    path would not recognise them and a dropped connection would end the process."""
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        yield cursor
