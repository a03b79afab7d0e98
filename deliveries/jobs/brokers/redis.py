"""django-q2's Redis broker, with batches: a page published in one ``RPUSH``, a batch
received in one round trip. Needs the extra ``trusty-webhooks[redis]`` and a relay
(``run_relay``) to publish the outbox to it."""

from collections.abc import Sequence

from django_q.brokers.redis_broker import Redis

from . import Message


class RedisBroker(Redis):
    def publish_many(self, messages: Sequence[Message]) -> None:
        # django-q2's enqueue is one RPUSH per message; one RPUSH takes them all.
        self.connection.rpush(self.list_key, *(m.encode() for m in messages))

    def receive_many(self, limit: int) -> list[tuple[object, str]]:
        got = self.dequeue() or []
        if got and limit > len(got):
            # django-q2's dequeue pops one message (BLPOP, waiting up to a second for
            # it); the rest of the batch is what is already queued, taken at once (LRANGE
            # and LTRIM in one MULTI: any Redis version, and no other consumer gets the
            # same messages).
            pipe = self.connection.pipeline()
            pipe.lrange(self.list_key, 0, limit - len(got) - 1)
            pipe.ltrim(self.list_key, limit - len(got), -1)
            more, _ = pipe.execute()
            got += [(None, payload) for payload in more]
        return got
