"""Identifiers of the rows written at volume: time-ordered UUIDs (version 7, RFC 9562).

An event's, a delivery's and an inbound event's id starts with the millisecond it was
made, then 74 random bits. Ids made later sort later, so PostgreSQL inserts their
primary-key entries (and the ``(event, endpoint)`` uniqueness entries, and every entry a
state change rewrites) at the right-hand edge of each index, on pages already in the
cache, instead of on a random page of an index that outgrows the cache. A delivery's id
is its ``webhook-id``: receivers get one they can sort, as from the senders that use
KSUIDs or ULIDs. The creation time it carries is in the payload's own timestamps anyway;
nothing uses an id as a secret (lease tokens and API keys stay random).

Python gets ``uuid.uuid7`` in 3.14; until then, ``uuid7()`` here. ``UUID7_SQL`` is the
same layout as a PostgreSQL expression (``uuidv7()`` arrives in PostgreSQL 18): the
statements that insert many rows at once make their ids in the server.
"""

import os
import time
import uuid

_VERSION_MASK = 0xF << 76
_VERSION_7 = 0x7 << 76
_VARIANT_MASK = 0x3 << 62
_VARIANT_RFC = 0x2 << 62


def uuid7() -> uuid.UUID:
    """A version 7 UUID: 48 bits of Unix time in milliseconds, then random bits, with
    the version and variant fields set."""
    ms = time.time_ns() // 1_000_000
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~_VERSION_MASK) | _VERSION_7
    value = (value & ~_VARIANT_MASK) | _VARIANT_RFC
    return uuid.UUID(int=value)


# A random (version 4) UUID whose first six bytes are replaced by the clock's
# milliseconds and whose version field is turned from 4 (0100) into 7 (0111) by setting
# two bits (bytea bits count from the low bit of each byte: 52 and 53 are byte 6's bits
# 4 and 5). clock_timestamp(), not now(): rows made by one statement differ in time.
UUID7_SQL = (
    "encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) placing "
    "substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) "
    "FROM 3) FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid"
)
