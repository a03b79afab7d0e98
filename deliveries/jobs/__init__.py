"""The job machinery: what every kind of queued work shares. Outbound deliveries
(``deliveries``) and an inbound event's processing (``ingest``) are two kinds on it;
each keeps its own table and state rules, and uses only this interface:

- enqueue in the caller's transaction: ``outbox.outbox_write`` (any database) or
  ``outbox.outbox_insert_sql`` (a CTE of a PostgreSQL statement that makes the jobs
  enqueued), keyed by ``outbox.message_key``;
- register a kind and what the shared loops call for it: ``kinds.register``;
- carry messages: ``broker`` (``get_broker``, ``Message``, ``publish``, ``receive``,
  ``acknowledge``) and the relay that publishes the outbox to it, ``relay.relay_tick``;
- lock an entity: ``locks.entity_lock_acquire``, ``entity_locks_acquire``,
  ``entity_lock_release`` (``RELEASE_SQL`` inside a statement of the caller's);
- run a loop: ``loop.run_loop``, ``loop.recorded_run``, ``loop.Heartbeat``,
  ``loop.StopFlag``, and the one retry rule for database errors (``loop.Backoff``,
  ``loop.with_db_retry``);
- wake a loop: ``wakeup.notify`` and ``wakeup.Listener`` (PostgreSQL LISTEN/NOTIFY;
  behind a pooler in transaction mode on the direct ``DATABASE_LISTEN_URL``, else polling:
  ``connections``, with the pooler's checks and the processes' connection counts);
- ids, raw SQL and crash points: ``ids.uuid7``, ``sql.bound_cursor``,
  ``faults.crash_point``.

The host's own background jobs are a third kind, ``job``, with their own table (``Job``,
``JobRun``): ``background`` (``job``, ``enqueue``, ``Retry``, ``Fail``, ``current_job``)
is the host's interface, ``runner`` the ``run_jobs`` worker, ``job_queries`` their
statements and the only module that changes a job's state (docs/jobs.md). The committed
job row is the queue entry: no outbox, relay or broker between them. Around them:
``recurring`` (``RecurringJob`` rows enqueued by the scheduler's sweep, their cron read
by ``cron``), ``services`` (the operators' replay and cancel, audited through the writer
the deliveries app registers), ``selectors`` (a job's progress), ``admin`` and
``metrics`` (whose gauges the deliveries app registers with its scrape).

Its own fast-path statements (the broker's, the locks' and the relay's) are in
``queries``, each once by name with its ORM spelling beside it (``sql.Statement``).

Its models (the outbox, the database broker's queue, entity locks and loop runs) are
this app's (label ``trusty_jobs``) and keep their tables' names.

Nothing here imports the products' modules (``deliveries``' models, state machine and
services, or ``ingest``); only the package's settings (``deliveries.core.conf``), tracing, the
text rules (``deliveries.core.text``, for masking secrets in a job's traceback), the
time-zone rule (``deliveries.core.timezones``, a recurring job's zone) and, when a job's retry
is computed, the shared ``deliveries.core.retry.RetryPolicy``.
The kinds register themselves from their AppConfig.ready. (Modules are imported by
name; this package's ``__init__`` imports nothing, as Django loads it before the models
are ready.)
"""
