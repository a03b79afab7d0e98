"""The hot path's raw SQL: the cursor it runs through, and ``Statement``, the one place
where a statement's PostgreSQL and SQLite spellings part.

Django's psycopg backend binds parameters on the client (psycopg's ``ClientCursor``),
which quotes every element of a 200-id array into the query text in Python. The claim,
lease and record statements pass such arrays, so they use server-side binding instead: the
ids travel as one typed parameter. Same connection, same transaction as the ORM.

Array parameters are written ``%(name)b::type[]``: they travel in binary format. In text
format psycopg writes every element into an array literal in Python, quoting and
escaping it (about 2 µs a uuid and 5 µs a timestamp); in binary, 0.2-0.4 µs an element.
A binary list must hold one Python type (floats and ints mixed are refused).
"""

import threading
from contextlib import contextmanager
from functools import partial

import psycopg
from django.db import (
    DEFAULT_DB_ALIAS,
    InterfaceError,
    NotSupportedError,
    OperationalError,
    connections,
)


@contextmanager
def bound_cursor(using: str = DEFAULT_DB_ALIAS):
    """A server-side-binding cursor on Django's current PostgreSQL connection (of the
    database ``using``).

    psycopg's own errors are translated to Django's (``OperationalError`` for a dropped
    connection or a restarting server) and mark the connection as having failed, exactly
    as through a Django cursor: without that, the loops' "database unavailable, retry"
    path would not recognise them and a dropped connection would end the process."""
    db = connections[using]
    db.ensure_connection()
    with db.wrap_database_errors, psycopg.Cursor(db.connection) as cursor:
        yield cursor


_statement_cursors = threading.local()


def statement_cursor(db):
    """The server-side-binding cursor that statements run on over ``db``'s current
    connection, kept from one statement to the next (per thread and database alias, as
    Django's connections are). A new psycopg cursor sets up its adapters and dumpers
    afresh: a third of the client CPU of a one-row insert of twenty parameters. A
    statement reads the whole answer it returns before the next one runs, so no caller
    ever sees another's rows; the last answer stays in memory until then."""
    db.ensure_connection()
    cursors = getattr(_statement_cursors, "by_alias", None)
    if cursors is None:
        cursors = _statement_cursors.by_alias = {}
    cursor = cursors.get(db.alias)
    if cursor is None or cursor.closed or cursor.connection is not db.connection:
        cursor = cursors[db.alias] = psycopg.Cursor(db.connection)
    return cursor


class Statement:
    """One statement of the hot path, defined once by name in its component's
    statements module: its PostgreSQL text, run on ``statement_cursor``, and beside it
    (``@STATEMENT.elsewhere``) the same effect written with the ORM for the other
    databases (SQLite). Calling the statement picks the spelling for the connection's
    database: this is the one place where the two differ.

    ``returns`` says what a call gives back, whichever spelling ran: ``"rows"`` (a list
    of tuples), ``"row"`` (one tuple or None), ``"count"`` (rows changed) or ``"nothing"``.
    The ORM spelling takes the same parameters and gives back the same shape.

    Two other ways to run the PostgreSQL text: ``copy_in`` (a ``COPY … FROM STDIN``
    whose parameters are the rows to copy; returns nothing) and ``bound=False`` (through
    Django's own cursor, client-side binding, counted and logged like the ORM's queries:
    for the small statements without array parameters that were written that way, such
    as the advisory locks). A call with ``using`` runs on that database alias, and its
    ORM spelling is called with ``using`` too.

    ``reconnects``: the statement is idempotent and its caller runs it in autocommit, so
    when the server has dropped the connection (a restart: it shows up on the first use
    of a persistent connection, which nothing checks beforehand) the statement is tried
    once more on a fresh connection. Inside a transaction the error is raised, as it is
    for a database without a server to lose (SQLite)."""

    RETURNS = ("rows", "row", "count", "nothing")

    def __init__(
        self,
        sql: str,
        *,
        returns: str = "rows",
        binary: bool = False,
        bound: bool = True,
        copy_in: bool = False,
        reconnects: bool = False,
    ) -> None:
        if returns not in self.RETURNS:
            raise ValueError(f"returns must be one of {self.RETURNS}")
        if copy_in and (returns != "nothing" or not bound or binary):
            raise ValueError("a COPY returns nothing and runs through bound_cursor")
        self.sql = sql
        self.returns = returns
        self.binary = binary  # results in binary format (bytea without hex encoding)
        self.bound = bound
        self.copy_in = copy_in
        self.reconnects = reconnects
        self.portable = None

    def one_statement(self, using: str | None = None) -> bool:
        """Whether a call is one statement on the database ``using`` (the PostgreSQL
        text) rather than the ORM spelling, which may take a query per row: a caller that
        batches work into a single call asks this."""
        return connections[using or DEFAULT_DB_ALIAS].vendor == "postgresql"

    def elsewhere(self, portable):
        """Decorator: the ORM spelling, for every database but PostgreSQL."""
        self.portable = portable
        return portable

    def __call__(self, params=None, *, using: str | None = None):
        db = connections[using or DEFAULT_DB_ALIAS]
        if not self.one_statement(db.alias):
            if self.portable is None:
                raise NotSupportedError("this statement has a PostgreSQL spelling only")
            if using is None:
                return self.portable(params)
            return self.portable(params, using=using)
        if self.copy_in:
            with bound_cursor(db.alias) as cursor, cursor.copy(self.sql) as copy:
                for row in params:
                    copy.write_row(row)
            return None
        if not self.bound:
            with db.cursor() as cursor:
                cursor.execute(self.sql, params)
                return self._result(cursor)
        if self.reconnects and not db.in_atomic_block:
            try:
                return self._execute(db, params)
            except (OperationalError, InterfaceError):
                db.close()
        return self._execute(db, params)

    def _execute(self, db, params):
        cursor = statement_cursor(db)
        with db.wrap_database_errors:
            cursor.execute(self.sql, params, binary=self.binary)
            return self._result(cursor)

    def _result(self, cursor):
        if self.returns == "rows":
            return cursor.fetchall()
        if self.returns == "row":
            return cursor.fetchone()
        if self.returns == "count":
            return cursor.rowcount
        return None


_SET_COMPRESSION = """
DO $$ BEGIN
    ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION {method};
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'compression method {method} is not available: {table}.{column} keeps its own';
END $$
"""


def set_compression(apps, schema_editor, *, table: str, column: str, method: str) -> None:
    """A migration step: how PostgreSQL compresses new values of ``table.column`` (a
    no-op on SQLite). A server built without ``method`` keeps the current one, with a
    notice: compression is a cost, never a reason for a migration to fail."""
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_SET_COMPRESSION.format(table=table, column=column, method=method))


def compress_with_lz4(table: str, column: str):
    """The migration operation that moves ``table.column`` from pglz to lz4, and back."""
    from django.db import migrations

    return migrations.RunPython(
        partial(set_compression, table=table, column=column, method="lz4"),
        partial(set_compression, table=table, column=column, method="pglz"),
        elidable=False,
    )


def _build_index(apps, schema_editor, *, app_label: str, model_name: str, index, add: bool):
    model = apps.get_model(app_label, model_name)
    if schema_editor.connection.vendor == "postgresql":
        sql = index.create_sql if add else index.remove_sql
        schema_editor.execute(sql(model, schema_editor, concurrently=True))
    else:
        (schema_editor.add_index if add else schema_editor.remove_index)(model, index)


def add_index_concurrently(app_label: str, model_name: str, index):
    """The migration operation that adds ``index`` to the model, and drops it again:
    CONCURRENTLY on PostgreSQL, so writes to the table go on while it builds. Its
    migration sets ``atomic = False`` (CREATE INDEX CONCURRENTLY cannot run in a
    transaction)."""
    from django.db import migrations

    where = {"app_label": app_label, "model_name": model_name, "index": index}
    return migrations.SeparateDatabaseAndState(
        state_operations=[migrations.AddIndex(model_name=model_name.lower(), index=index)],
        database_operations=[
            migrations.RunPython(
                partial(_build_index, **where, add=True),
                partial(_build_index, **where, add=False),
                elidable=False,
            )
        ],
    )
