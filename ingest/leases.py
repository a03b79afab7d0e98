"""The lease one poll or backfill run holds on its source: an expiring entity lock
(``deliveries.jobs.locks``), renewed in the transaction that stores each page."""

import os
import socket
import uuid
from datetime import timedelta

from django.utils import timezone

from deliveries.jobs.locks import entity_lock_acquire, entity_lock_release
from deliveries.jobs.models import EntityLock


class LeaseLost(Exception):
    """Another process took the lease over (ours expired): this page is rolled back."""


class Lease:
    """An expiring row (``deliveries.jobs.locks``) that one process at a time holds on a poll
    source or a backfill run. Renewed in the transaction that stores each page, so a
    holder whose lease was taken over can commit nothing. A holder on this host whose
    process is gone (``kill -9``) is taken over at once instead of after the expiry."""

    def __init__(self, key: str, ttl: float) -> None:
        self.key, self.ttl = key, ttl
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"

    def acquire(self) -> bool:
        if entity_lock_acquire(key=self.key, owner=self.owner, ttl=self.ttl):
            return True
        holder = EntityLock.objects.filter(key=self.key).values_list("owner", flat=True).first()
        if holder and _dead_local_process(holder):
            expires = timezone.now() + timedelta(seconds=self.ttl)
            return bool(
                EntityLock.objects.filter(key=self.key, owner=holder).update(
                    owner=self.owner, expires_at=expires
                )
            )
        return False

    def holder(self) -> str:
        return EntityLock.objects.filter(key=self.key).values_list("owner", flat=True).first() or ""

    def renew(self) -> None:
        """Call inside the transaction that writes; raises LeaseLost."""
        if not entity_lock_acquire(key=self.key, owner=self.owner, ttl=self.ttl):
            raise LeaseLost(self.key)

    def release(self) -> None:
        entity_lock_release(key=self.key, owner=self.owner)


def _dead_local_process(owner: str) -> bool:
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
