"""The django-q2 task: sign and POST one payload."""

import os

from bench.peers.common import post_sync

RECEIVER = os.environ.get("PEER_RECEIVER_URL", "") + "/hook"


def deliver(data: dict, msg_id: str) -> None:
    post_sync(RECEIVER, data, msg_id)
