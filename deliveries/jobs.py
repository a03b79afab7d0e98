"""Other kinds of queued jobs that ride the same outbox, relay, broker and workers as
deliveries (an inbound event's processing, for one). ``deliveries`` never imports the
apps that register them: they register here from their ``AppConfig.ready``.

A kind registers:

- ``process(messages)``: run in a worker's database thread with the decoded broker
  messages of that kind; it leases, runs and records them, guarded like deliveries, and
  returns counts. With the database broker the worker's take has spent (deleted) the
  messages already, in the transaction that took them; with a broker that acknowledges,
  the worker acknowledges them after ``process`` returns. Either way a message can be
  gone while its job is not done (a worker that died between the take and the job's
  own lease), so ``schedule`` must recover such dispatches, as deliveries' lost-dispatch
  sweep does.
- ``schedule(now, page_size)``: run by the scheduler's sweeps (once per
  ``SCHEDULER_INTERVAL``, and again on the next pass while it reports more work); admits
  due jobs (writing their outbox rows), expires leases and recovers lost dispatches;
  returns counts and whether work remains.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from .broker import Message


@dataclass(frozen=True)
class JobKind:
    name: str
    process: Callable[[Sequence[Message]], Counter]
    schedule: Callable[[datetime, int], tuple[Counter, bool]]


KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> None:
    if kind.name == "delivery":
        raise ValueError("'delivery' is the built-in kind")
    KINDS[kind.name] = kind
