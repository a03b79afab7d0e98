"""The statements of the outbound kind of work, each defined once by name, in four
modules by who runs them (``admission``, ``state``, ``publish``, ``reads``): its PostgreSQL
text and, directly below it, the same effect written with the ORM for SQLite
(``deliveries.core.sql.Statement``). A statement takes the same parameters and gives
back the same shape whichever spelling runs, so admission, the state machine, publishing
and the reads beside them never ask which database they are on.

Array parameters travel in binary format (``%(name)b::type[]``, see deliveries.core.sql).
Where a statement is PostgreSQL's own work with no SQLite meaning (an advisory lock), its
ORM spelling does nothing and says why: SQLite's IMMEDIATE transactions take the write
lock at BEGIN, which serialises what the lock serialises.
"""

from ..models import DeliveryState

# The job kind of a delivery: the outbox rows written here carry it.
DELIVERY_KIND = "delivery"

PENDING = DeliveryState.PENDING
ENQUEUED = DeliveryState.ENQUEUED
LEASED = DeliveryState.LEASED
SUCCEEDED = DeliveryState.SUCCEEDED
DEAD = DeliveryState.DEAD
