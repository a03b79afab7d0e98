"""The django-q2 tasks: sign and POST one payload; or do nothing but say so (noop)."""

import os

from bench.peers.common import mark_done, post_sync

RECEIVER = os.environ.get("PEER_RECEIVER_URL", "") + "/hook"


def deliver(data: dict, msg_id: str) -> None:
    post_sync(RECEIVER, data, msg_id)


def noop(seq: int) -> None:
    mark_done(seq)
