"""The job machinery: what every kind of queued work shares. Outbound deliveries
(``deliveries``) and an inbound event's processing (``ingest``) are two kinds on it;
each keeps its own table and state rules, and uses only this interface:

- enqueue in the caller's transaction: ``outbox.outbox_write`` (any database) or
  ``outbox.outbox_insert_sql`` (a CTE of a PostgreSQL statement that makes the jobs
  enqueued), keyed by ``outbox.message_key``;
- register a kind and what the shared loops call for it: ``kinds.register``;
- carry messages: ``brokers`` (``get_broker``, ``Message``, ``publish``, ``receive``,
  ``acknowledge``; one module per broker) and the relay that publishes the outbox to a
  broker outside the database, ``relay.relay_tick``;
- lock an entity: ``locks.entity_lock_acquire``, ``entity_locks_acquire``,
  ``entity_lock_release`` (``RELEASE_SQL`` inside a statement of the caller's);
- run a loop: ``loop.run_loop``, ``loop.recorded_run``, ``loop.Heartbeat``,
  ``loop.StopFlag``, and the one retry rule for database errors (``loop.Backoff``,
  ``loop.with_db_retry``);
- wake a loop: ``wakeup.notify`` and ``wakeup.Listener`` (PostgreSQL LISTEN/NOTIFY;
  behind a pooler in transaction mode on the direct ``DATABASE_LISTEN_URL``, else polling:
  ``connections``, with the pooler's checks and the processes' connection counts);
- crash points: ``faults.crash_point``.

The host's own background jobs are a third kind, ``job``, with their own table (``Job``,
``JobRun``) and package, ``background`` (``job``, ``enqueue``, ``Retry``, ``Fail``,
``current_job``: the host's interface; ``state`` and ``statements``, the only modules
that change a job's state; ``worker``, ``run_jobs``). The committed job row is the queue
entry: no outbox, relay or broker between them. Around them: ``tasks`` (Django's Tasks
API on them), ``cron`` (recurring jobs' schedules), ``services`` (the operators' replay
and cancel, audited), ``selectors`` (a job's progress), ``admin`` and ``metrics``.

Its own fast-path statements (the broker's, the locks' and the relay's) are in
``statements``, each once by name with its ORM spelling beside it.

Its models (the outbox, the database broker's queue, entity locks and loop runs) are
this app's (label ``trusty_jobs``) and keep their tables' names.

It stands on the floor, ``deliveries.core``, and imports nothing else of the apps
(``tests/project/test_layout.py``). The kinds register themselves from their
AppConfig.ready. (Modules are imported by name; this package's ``__init__`` imports
nothing, as Django loads it before the models are ready.)
"""
