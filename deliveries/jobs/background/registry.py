"""The job types a process knows: ``@job`` registers a function under a type name with
how it runs (queue, priority, attempts, timeout, retry policy, entity lock, payload
version and readers); the exceptions a job raises to say how it ended."""

import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module

from django.core.serializers.json import DjangoJSONEncoder

from deliveries.core.conf import settings
from deliveries.core.retry import RetryPolicy

KIND = "job"


class Retry(Exception):
    """Raise in a job to run it again after ``after`` seconds (as a receiver's
    ``Retry-After``). The run counts as an attempt."""

    def __init__(self, after: float = 0.0, reason: str = "") -> None:
        if not 0 <= after < math.inf:
            raise ValueError("after must be finite and not negative")
        super().__init__(reason or f"retry after {after} s")
        self.after = float(after)


class Fail(Exception):
    """Raise in a job to end it dead at once with ``reason``: retrying cannot help."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownJobType(LookupError):
    """``enqueue`` of a type no ``@job`` in this process registered."""


class LeaseExpired(Exception):
    """The class recorded for a ``lost`` run: no exception was seen, the run's lease ran
    out before its worker recorded it (the worker died or hung)."""


@dataclass
class JobType:
    """What ``@job`` registered for one type name."""

    name: str
    fn: Callable
    queue: str = "default"
    priority: int = 0
    max_attempts: int = 5
    # Seconds a run may take; None: no limit (the lease is renewed while it runs).
    timeout: float | None = 60.0
    retry: "RetryPolicy | None" = None
    lock: Callable[..., str] | None = None
    version: int = 1
    # Readers of older payload versions: version -> fn(payload) -> payload of ``version``.
    readers: dict[int, Callable[[dict], dict]] = field(default_factory=dict)
    # Who to ask about it, and whether an operator may run a dead one again without a
    # second confirmation (the admin's replay, as EventType.replay_safe for deliveries).
    owner: str = ""
    replay_safe: bool = True
    # How a return value is kept: a function of it giving JSON text to store on the job
    # ("" for nothing; raising ``Fail`` ends the job dead), or None: thrown away (@job's
    # functions; a Django task's type keeps it, deliveries.jobs.tasks).
    keep_result: Callable[[object], str] | None = None

    def __post_init__(self) -> None:
        self.is_async = inspect.iscoroutinefunction(self.fn)

    @property
    def lease_seconds(self) -> float:
        """How long a claim holds the job: its timeout and a margin, for the time a
        worker takes to record the outcome after the timeout fires."""
        if self.timeout is None:
            return settings.JOBS_LEASE_MARGIN * 2  # renewed while it runs
        return self.timeout + settings.JOBS_LEASE_MARGIN

    def policy(self) -> "RetryPolicy":

        return self.retry or RetryPolicy.from_settings()

    def retry_delay(self, attempts: int) -> float | None:
        """Seconds before the next try after ``attempts`` failed, or None when spent:
        the policy's step for that attempt (its last step once past its schedule)."""
        if attempts >= self.max_attempts:
            return None
        policy = self.policy()
        if not policy.schedule:
            return 0.0
        return policy.next_delay(min(attempts, len(policy.schedule)))

    def read(self, version: int, payload: dict) -> dict:
        """The payload as this version's function takes it, or ``Unreadable``."""
        if version == self.version:
            return payload
        if version > self.version:
            raise Unreadable(f"payload version {version} is newer than {self.version}")
        while version < self.version:
            reader = self.readers.get(version)
            if reader is None:
                raise Unreadable(f"no reader for payload version {version}")
            payload, version = reader(payload), version + 1
        return payload

    def reads(self, version: int):
        """Decorator: ``@fn.reads(1) def from_v1(payload) -> dict`` turns a version 1
        payload into a version 2 one (readers chain: 1 to 2, 2 to 3...)."""
        if not 1 <= version < self.version:
            raise ValueError(f"a reader reads a version below {self.version}")

        def register(reader: Callable[[dict], dict]) -> Callable[[dict], dict]:
            self.readers[version] = reader
            return reader

        return register


class Unreadable(Exception):
    """A job this process cannot run: it goes dead with the reason, never dropped."""


JOB_TYPES: dict[str, JobType] = {}


class JobFunction:
    """A function registered with ``@job``: call it as before; ``.reads(n)`` registers
    a reader of payload version ``n``; ``.job_type`` is its registration."""

    def __init__(self, job_type: JobType) -> None:
        self.job_type = job_type
        self.reads = job_type.reads
        self.__wrapped__ = job_type.fn
        self.__name__ = getattr(job_type.fn, "__name__", job_type.name)
        self.__doc__ = job_type.fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.job_type.fn(*args, **kwargs)


def job(
    name: str,
    *,
    queue: str = "default",
    priority: int = 0,
    max_attempts: int = 5,
    timeout: float | None = 60.0,
    retry: "RetryPolicy | Mapping | None" = None,
    lock: Callable[..., str] | None = None,
    version: int = 1,
    owner: str = "",
    replay_safe: bool = True,
) -> Callable[[Callable], JobFunction]:
    """Register the decorated function as the job type ``name``. It is called with the
    payload as keyword arguments: a plain function in a thread of the worker, an
    ``async def`` on the worker's event loop. ``retry``: a ``RetryPolicy``, or its
    parameters (``{"schedule": (1, 10, 60)}``); None, the shared default
    (``DELIVERY_RETRY_*``). ``lock``: the entity key, from the payload's arguments, of an
    entity lock the job runs under (two jobs with one key never overlap). ``owner`` and
    ``replay_safe``: shown in the admin; replaying a type not replay-safe there needs a
    second confirmation."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    if timeout is not None and not 0 < timeout < math.inf:
        raise ValueError("timeout must be positive and finite, or None")
    if version < 1:
        raise ValueError("version starts at 1")
    if isinstance(retry, Mapping):
        retry = RetryPolicy(**retry)

    def register(fn: Callable) -> JobFunction:
        job_type = JobType(
            name=name,
            fn=fn,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            timeout=timeout,
            retry=retry,
            lock=lock,
            version=version,
            owner=owner,
            replay_safe=replay_safe,
        )
        JOB_TYPES[name] = job_type
        return JobFunction(job_type)

    return register


def job_type(name: str) -> JobType:
    try:
        return JOB_TYPES[name]
    except KeyError:
        raise UnknownJobType(f"no job type {name!r} is registered in this process") from None


def as_json(payload: dict) -> dict:
    """``payload`` as it reads back from its JSON (Django's encoder; no ``NaN``)."""
    return json.loads(json.dumps(payload, cls=DjangoJSONEncoder, allow_nan=False))


def find_job_type(name: str) -> JobType:
    """The registration of ``name``, for a worker: a type this process has not
    registered yet is looked for in the module its name is the path of (all but the last
    part), imported here. That is how a Django task's type is found: its name is the
    task's module path, and the module registers it on import (deliveries.jobs.tasks).
    Only a registration runs: importing a module that registers nothing under the name
    runs nothing of it. Raises ``Unreadable`` with the reason when there is none."""
    spec = JOB_TYPES.get(name)
    if spec is not None:
        return spec
    module = name.rpartition(".")[0]
    if module:
        try:
            import_module(module)
        except Exception as exc:  # a module that fails on import is the job's reason
            raise Unreadable(
                f"unknown job type {name!r}: importing {module!r} failed: "
                f"{type(exc).__name__}: {exc}"[:500]
            ) from exc
        spec = JOB_TYPES.get(name)
    if spec is None:
        raise Unreadable(f"unknown job type {name!r}")
    return spec
