"""The kinds of work that ride the job machinery: each has its own table and state rules
and shares the outbox, relay, broker, workers, leases and entity locks. Outbound
deliveries are one kind (``delivery``, registered by deliveries' AppConfig.ready), an
inbound event's processing another (``inbound``, by ingest's). The machinery never
imports the apps that register kinds.

A kind registers what the shared loops call for it:

- ``process(messages)``: run in a worker's database thread with the decoded broker
  messages of that kind; it leases, runs and records them, guarded like deliveries, and
  returns counts. With the database broker the worker's take has claimed the outbox
  rows (or spent a relay's messages) already, in the transaction that took them; with a
  broker that acknowledges,
  the worker acknowledges them after ``process`` returns. Either way a message can be
  gone while its job is not done (a worker that died between the take and the job's
  own lease), so ``schedule`` must recover such dispatches, as deliveries' lost-dispatch
  sweep does. Deliveries have none: the workers' sending lanes are theirs.
- ``schedule(now, page_size)``: run by the scheduler's sweeps (once per
  ``SCHEDULER_INTERVAL``, and again on the next pass while it reports more work); admits
  due jobs (writing their outbox rows), expires leases and recovers lost dispatches;
  returns counts and whether work remains. Deliveries have none: the scheduler's
  admission and sweeps are theirs.
- ``trace_contexts(job_ids)``: the W3C traceparent each job was enqueued under, for the
  relay's spans (tracing on only); absent for a kind that keeps none.
"""

import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from .brokers import Message


@dataclass(frozen=True)
class JobKind:
    name: str
    process: Callable[[Sequence[Message]], Counter] | None = None
    schedule: Callable[[datetime, int], tuple[Counter, bool]] | None = None
    trace_contexts: Callable[[list[uuid.UUID]], dict[uuid.UUID, str]] | None = None


KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> None:
    KINDS[kind.name] = kind


def scheduled() -> Iterator[JobKind]:
    """The kinds whose scheduling the scheduler's sweeps run."""
    return (kind for kind in KINDS.values() if kind.schedule is not None)


def processed(name: str) -> JobKind | None:
    """The kind a worker hands messages named ``name`` to, if one is registered."""
    kind = KINDS.get(name)
    return kind if kind is not None and kind.process is not None else None
