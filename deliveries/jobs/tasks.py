"""Django's Tasks API on the job machinery: a ``TASKS`` backend that makes every ``@task``
a background job, with a job's row written in the caller's transaction, its lease,
retries, entity lock and dead state (docs/jobs.md, "Django's Tasks API").

    TASKS = {"default": {"BACKEND": "deliveries.jobs.tasks.JobsBackend"}}

It works with ``django.tasks`` (Django 6.0 and later) and, before it, with the
``django-tasks`` backport (``pip install 'trusty-webhooks[tasks]'``, and ``django_tasks``
in ``INSTALLED_APPS``). Without either this module still imports, and the backend says
what to install when it is built.

How a task maps onto a job: its type is the task's module path (``billing.tasks.sync``),
its payload ``{"args": [...], "kwargs": {...}}``, its priority, queue and ``run_after``
the job's ``priority``, ``queue`` and ``run_at``. ``run_jobs`` runs it: a worker that
claims a type it has not registered imports the module first
(``background.registry.find_job_type``), and the ``@task`` there registers the type
(``JobsBackend.validate_task``). A ``TaskResult``'s id is the job's id, and
``get_result`` reads it back from the job's rows.
"""

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from inspect import iscoroutinefunction
from uuid import UUID

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from deliveries.core.retry import RetryPolicy
from deliveries.core.text import MAX_JSON_DEPTH, json_problem

from .background import JOB_TYPES, Fail, JobType, current_job, enqueue_job
from .models import Job, JobOutcome, JobState
from .selectors import job_with_runs

try:  # Django 6.0 and later
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued
    from django.utils.json import normalize_json
except ImportError:
    try:  # the django-tasks backport
        from django_tasks import TaskContext, TaskResult, TaskResultStatus
        from django_tasks import exceptions as _exceptions
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued
        from django_tasks.utils import normalize_json

        # 0.12 spells them with an "Error" suffix; its next release as Django does.
        InvalidTask = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
        InvalidTaskBackend = (
            getattr(_exceptions, "InvalidTaskBackend", None) or _exceptions.InvalidTaskBackendError
        )
    except ImportError:
        BaseTaskBackend = None

MISSING = (
    "deliveries.jobs.tasks.JobsBackend needs Django's Tasks framework: Django 6.0 or "
    "later, or the django-tasks backport (pip install 'trusty-webhooks[tasks]')."
)

# The backend's OPTIONS and their defaults. A retry schedule of None is the shared one
# (DELIVERY_RETRY_SCHEDULE, DELIVERY_RETRY_JITTER), as for @job.
OPTION_DEFAULTS = {
    "MAX_ATTEMPTS": 5,
    "RETRY_SCHEDULE": None,
    "RETRY_JITTER": None,
    "TIMEOUT": 60.0,
    "RESULT_MAX_BYTES": 64 * 1024,
}

# A job's state as a task's status: pending (never run, or waiting for its next
# attempt) is READY, as the framework defines it ("ready to be executed again").
STATUS = {
    JobState.PENDING: "READY",
    JobState.RUNNING: "RUNNING",
    JobState.DONE: "SUCCESSFUL",
    JobState.DEAD: "FAILED",
}
# The runs that ran (or may have run) the function: they are the task's attempts.
ATTEMPTED = {o for o in JobOutcome.values if o != JobOutcome.RELEASED}
# The runs that failed: each is one of the task's errors.
FAILED = ATTEMPTED - {JobOutcome.DONE}
# What JSON holds, exactly (not a subclass: an IntEnum comes back an int).
JSON_TYPES = (dict, list, str, int, float, bool, type(None))


class ResultRefused(Fail):
    """A task's return value that cannot be kept (not JSON, or larger than the
    backend's ``RESULT_MAX_BYTES``): the job ends dead at once, since running the task
    again would return the same. Its side effects have happened."""


def task_options(
    *,
    max_attempts: int | None = None,
    timeout: float | None = None,
    lock: Callable[..., str] | None = None,
):
    """What ``@task(max_attempts=…, timeout=…, lock=…)`` says on the backport, for
    Django's own ``@task``, which passes no other keyword arguments to the backend: put it
    under ``@task``. ``lock`` takes the task's arguments and gives the entity key. A value
    given to ``@task`` as well wins."""
    given = {"max_attempts": max_attempts, "timeout": timeout, "lock": lock}

    def mark(fn: Callable) -> Callable:
        fn._job_options = {name: value for name, value in given.items() if value is not None}
        return fn

    return mark


def json_refusal(value, where: str) -> str | None:
    """Why ``value`` would not come back from a JSON round trip as it is, or from
    PostgreSQL's jsonb (``text.json_problem``: NUL, lone surrogates, NaN, depth), or None.
    Only dicts with string keys, lists, strings, ints, floats, booleans and None are
    kept; a tuple comes back a list, a subclass as its base. Iterative and bounded by
    depth, so a cycle ends too."""
    stack = [(value, where, 1)]
    while stack:
        item, at, depth = stack.pop()
        kind = type(item)
        if kind not in JSON_TYPES:
            return f"{at} is a {kind.__qualname__}"
        if depth > MAX_JSON_DEPTH:
            return f"{where} is nested deeper than {MAX_JSON_DEPTH} levels"
        if kind is dict:
            for key, child in item.items():
                if type(key) is not str:
                    return f"{at} has the key {key!r}, a {type(key).__qualname__}"
                stack.append((child, f"{at}[{key[:40]!r}]", depth + 1))
        elif kind is list:
            stack.extend((child, f"{at}[{i}]", depth + 1) for i, child in enumerate(item))
    problem = json_problem(value)
    return f"{where} {problem}" if problem else None


if BaseTaskBackend is None:

    class JobsBackend:
        """Stands in for the backend where Django's Tasks framework is absent."""

        def __init__(self, alias: str, params: dict) -> None:
            raise ImproperlyConfigured(MISSING)

else:

    @dataclass(frozen=True, slots=True, kw_only=True)
    class JobsTask(Task):
        """A task of ``JobsBackend``: Django's ``Task`` with what only a job has.

        ``max_attempts``, ``timeout`` and ``lock`` come from ``@task(...)`` on the
        backport (or ``task_options``); ``tenant_id``, ``idempotency_key`` and
        ``deadline`` from ``using_job`` for the next ``enqueue``."""

        max_attempts: int | None = None
        timeout: float | None = None
        lock: Callable[..., str] | None = None
        tenant_id: object = None
        idempotency_key: str | None = None
        deadline: datetime | None = None

        def using_job(self, *, tenant=None, idempotency_key=None, deadline=None):
            """A copy that enqueues with a job's own options, as ``using`` does with the
            framework's: ``tenant`` (a tenant, anything with a UUID ``id``, or its id: the
            claim's fairness and the REST progress route), ``idempotency_key`` (a second
            enqueue with it returns the first job's result) and ``deadline`` (never
            started after it). None leaves a value as it is."""
            changes = {
                "tenant_id": getattr(tenant, "id", tenant),
                "idempotency_key": idempotency_key,
                "deadline": deadline,
            }
            return replace(self, **{k: v for k, v in changes.items() if v is not None})

    class JobsBackend(BaseTaskBackend):
        """Django's Tasks on the product's background jobs (the module's docstring)."""

        task_class = JobsTask
        supports_defer = True
        supports_async_task = True
        supports_get_result = True
        supports_priority = True

        def __init__(self, alias: str, params: dict) -> None:
            super().__init__(alias, params)
            self.problems: list[str] = []
            options = {**OPTION_DEFAULTS}
            for name, value in (self.options or {}).items():
                if name not in OPTION_DEFAULTS:
                    self.problems.append(f"unknown option {name!r}")
                options[name] = value
            self.max_attempts = options["MAX_ATTEMPTS"]
            self.timeout = options["TIMEOUT"]
            self.result_max_bytes = options["RESULT_MAX_BYTES"]
            self.retry = None
            if not (type(self.max_attempts) is int and self.max_attempts >= 1):
                self.problems.append("MAX_ATTEMPTS must be a whole number, at least 1")
            if self.timeout is not None and not _positive(self.timeout):
                self.problems.append("TIMEOUT must be positive seconds, or None (no limit)")
            if not (type(self.result_max_bytes) is int and self.result_max_bytes >= 0):
                self.problems.append("RESULT_MAX_BYTES must be a whole number of bytes")
            if options["RETRY_SCHEDULE"] is not None or options["RETRY_JITTER"] is not None:
                self.retry = self._policy(options["RETRY_SCHEDULE"], options["RETRY_JITTER"])
            # What a task's job type takes from the backend (validate_task compares it).
            self.effective = (
                alias,
                self.max_attempts,
                self.timeout,
                self.retry,
                self.result_max_bytes,
            )

        def _policy(self, schedule, jitter):

            shared = RetryPolicy.from_settings()
            try:
                return replace(
                    shared,
                    schedule=shared.schedule if schedule is None else tuple(map(float, schedule)),
                    jitter=shared.jitter if jitter is None else float(jitter),
                )
            except (TypeError, ValueError) as exc:
                self.problems.append(f"RETRY_SCHEDULE / RETRY_JITTER: {exc}")
                return None

        def check(self, **kwargs) -> Iterable[checks.CheckMessage]:
            """A misconfigured backend fails the system checks (``deliveries.E050``)."""
            for problem in self.problems:
                yield checks.Error(
                    f"TASKS[{self.alias!r}] OPTIONS: {problem}.", id="deliveries.E050"
                )

        # --- Defining: each task registers its job type --------------------------------

        def validate_task(self, task) -> None:
            """The framework's rules, then the job's: every task of this backend (at
            ``@task``, and at each ``using``) registers its type, so a module that defines
            tasks registers them on import, in the web process and in ``run_jobs``."""
            if self.problems:
                raise InvalidTaskBackend(f"TASKS[{self.alias!r}] OPTIONS: {self.problems[0]}")
            super().validate_task(task)
            name = task.module_path
            known = JOB_TYPES.get(name)
            if known is not None and getattr(known.fn, "task", None) is None:
                raise InvalidTask(f"{name!r} is the name of a @job type already")
            # Registered again when the backend's options changed (its TASKS entry was
            # replaced, as override_settings does): the type follows the backend that
            # validated the task last. Each thread has a backend instance of its own,
            # with equal options: those are compared, not the instances.
            if (
                known is None
                or known.fn.task.func is not task.func
                or known.fn.options != self.effective
            ):
                JOB_TYPES[name] = self._job_type(task)

        def _job_type(self, task) -> JobType:
            options = getattr(task.func, "_job_options", {})

            def pick(name: str, default):
                value = getattr(task, name, None)
                return options.get(name, default) if value is None else value

            max_attempts = pick("max_attempts", self.max_attempts)
            timeout = pick("timeout", self.timeout)
            lock = pick("lock", None)
            if not (type(max_attempts) is int and max_attempts >= 1):
                raise InvalidTask("max_attempts must be a whole number, at least 1")
            if timeout is not None and not _positive(timeout):
                raise InvalidTask("timeout must be positive seconds")
            if lock is not None and not callable(lock):
                raise InvalidTask("lock must be a function of the task's arguments")
            fn = _runner(task)
            fn.options = self.effective
            return JobType(
                name=task.module_path,
                fn=fn,
                queue=task.queue_name,
                priority=task.priority,
                max_attempts=max_attempts,
                timeout=timeout,
                retry=self.retry,
                lock=None if lock is None else (lambda args, kwargs: lock(*args, **kwargs)),
                keep_result=self.keep_result,
            )

        # --- Enqueueing -------------------------------------------------------------

        def enqueue(self, task, args, kwargs):
            """Write the task's job in the caller's transaction (a rollback leaves
            nothing) and return its ``TaskResult``, READY, whose id is the job's. Arguments
            that would not survive a JSON round trip unchanged raise ``TypeError``, as the
            framework does for those JSON cannot hold, and nothing is written."""
            self.validate_task(task)
            args, kwargs = list(args), dict(kwargs)
            refusal = json_refusal(args, "args") or json_refusal(kwargs, "kwargs")
            if refusal:
                raise TypeError(f"Task arguments must come back from JSON unchanged: {refusal}.")
            job, created = enqueue_job(
                task.module_path,
                {"args": args, "kwargs": kwargs},
                run_at=task.run_after,
                deadline=task.deadline,
                idempotency_key=task.idempotency_key,
                tenant=task.tenant_id,
                priority=task.priority,
                queue=task.queue_name,
            )
            # Not created: the first job of the idempotency key, as it stands now.
            result = self.result_of(job, [], task) if created else self.get_result(str(job.id))
            task_enqueued.send(type(self), task_result=result)
            return result

        # --- Results --------------------------------------------------------------

        def get_result(self, result_id):
            """The ``TaskResult`` of a task's job, read from its row and runs. An id that
            is no job, or a job that is not a task's (a @job's, or a task this process
            cannot import), raises ``TaskResultDoesNotExist``."""

            try:
                job_id = UUID(str(result_id))
            except ValueError:
                raise TaskResultDoesNotExist(result_id) from None
            found = job_with_runs(job_id)
            if found is None:
                raise TaskResultDoesNotExist(result_id)
            job, runs = found
            task = self.task_of(job)
            if task is None:
                raise TaskResultDoesNotExist(f"{result_id} is not the job of a task")
            return self.result_of(job, runs, task)

        @staticmethod
        def task_of(job: Job):
            """The task a job runs, found by its type (the task's module path), with the
            job's priority and queue; None when the type names no task."""
            try:
                task = import_string(job.type)
            except Exception:  # no such module or name, or a module that fails to import
                return None
            if not isinstance(task, Task):
                return None
            try:
                return replace(task, priority=job.priority, queue_name=job.queue)
            except InvalidTask:  # a queue the backend no longer lists: the task as defined
                return task

        def result_of(self, job: Job, runs: list, task) -> "TaskResult":
            """A ``TaskResult`` from a job's row and its runs (oldest first)."""
            attempted = [run for run in runs if run.outcome in ATTEMPTED]
            # Since the last replay (which starts ``attempts`` again from 0): the latest
            # runs, less the one running now, which has no run row yet.
            running = job.state == JobState.RUNNING
            recorded = max(job.attempts - running, 0)
            workers = [str(r.run_id or "") for r in attempted[len(attempted) - recorded :]]
            if running:
                workers.append("")  # this claim's worker, recorded when it ends
            result = TaskResult(
                task=task,
                id=str(job.id),
                status=TaskResultStatus[STATUS[job.state]],
                enqueued_at=job.created_at,
                started_at=attempted[0].started_at if attempted else job.started_at,
                finished_at=job.finished_at,
                last_attempted_at=job.started_at,
                args=job.payload.get("args", []),
                kwargs=job.payload.get("kwargs", {}),
                backend=self.alias,
                errors=[
                    TaskError(
                        exception_class_path=run.error_class or "builtins.Exception",
                        traceback=run.error,
                    )
                    for run in runs
                    if run.outcome in FAILED
                ],
                worker_ids=workers,
            )
            if job.state == JobState.DONE:
                object.__setattr__(result, "_return_value", job.result)
            return result

        def keep_result(self, value) -> str:
            """A return value as the JSON text stored on the job ("" for None). One JSON
            cannot hold, or larger than ``RESULT_MAX_BYTES``, raises ``ResultRefused``."""
            if value is None:
                return ""
            try:
                value = normalize_json(value)  # as the framework does: a tuple is a list
            except (TypeError, ValueError) as exc:
                raise ResultRefused(f"the return value is not JSON: {exc}") from None
            if refusal := json_refusal(value, "the return value"):
                raise ResultRefused(f"the return value is not JSON: {refusal}")
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            size = len(text.encode())
            if size > self.result_max_bytes:
                raise ResultRefused(
                    f"the return value is {size} bytes, more than RESULT_MAX_BYTES "
                    f"({self.result_max_bytes})"
                )
            return text

    def _runner(task) -> Callable:
        """The job function of a task: called with the payload (``args``, ``kwargs``), a
        coroutine for an async task (run on the worker's loop)."""

        def arguments(args: list, kwargs: dict) -> list:
            return [_context(task, args, kwargs), *args] if task.takes_context else args

        if iscoroutinefunction(task.func):

            async def run(args, kwargs):
                return await task.func(*arguments(args, kwargs), **kwargs)

        else:

            def run(args, kwargs):
                return task.func(*arguments(args, kwargs), **kwargs)

        run.task = task
        return run

    def _context(task, args: list, kwargs: dict) -> "TaskContext":
        """The ``context`` of a task that takes it: its result as it runs, whose
        ``attempt`` is the job's (1 on the first run)."""
        running = current_job()
        now = timezone.now()
        result = TaskResult(
            task=task,
            id=str(running.id),
            status=TaskResultStatus.RUNNING,
            enqueued_at=None,
            started_at=now,
            finished_at=None,
            last_attempted_at=now,
            args=args,
            kwargs=kwargs,
            backend=task.backend,
            errors=[],
            # The workers of earlier attempts are in the job's runs, not read here.
            worker_ids=[""] * (running.attempt - 1) + [str(running.run_id or "")],
        )
        return TaskContext(task_result=result)


def _positive(seconds) -> bool:
    return type(seconds) in (int, float) and 0 < seconds < math.inf
