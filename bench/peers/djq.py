"""Peer: django-q2, with its ORM broker (``--broker orm``) or its Redis broker
(``--broker redis``), ``qcluster`` as the worker."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers import common


def main() -> int:
    parser = common.arguments(__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=("orm", "redis"), default="orm")
    args = parser.parse_args()
    env = common.peer_env(
        DJANGO_SETTINGS_MODULE="bench.peers.djq_settings",
        PEER_DB_URL=args.db_url,
        DJQ_BROKER=args.broker,
        PEER_WORKERS=str(args.processes),
        PEER_RECEIVER_URL=args.receiver,
        PEER_REDIS_URL=common.REDIS_URL,
    )
    os.environ.update(env)
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import transaction
    from django_q.brokers import get_broker
    from django_q.tasks import async_task

    call_command("migrate", "django_q", verbosity=0)

    def reset() -> None:
        if args.broker == "orm":
            from django_q.models import OrmQ

            OrmQ.objects.all().delete()
        else:
            import redis

            redis.Redis.from_url(common.REDIS_URL).flushdb()  # only the bench's own db

    broker = get_broker()

    task = {"post": "bench.peers.djq_tasks.deliver", "noop": "bench.peers.djq_tasks.noop"}

    def enqueue(n: int) -> None:
        for start in range(0, n, 1000):
            with transaction.atomic():
                for i in range(start, min(n, start + 1000)):
                    kwargs = common.job_arguments(args.workload, i)
                    async_task(task[args.workload], **kwargs, broker=broker)
        if args.broker == "orm":  # statistics for the filled queue, as the service's run does
            from django.db import connection

            with connection.cursor() as cursor:
                cursor.execute("ANALYZE django_q_ormq")

    qcluster = [sys.executable, "-m", "django", "qcluster"]
    return common.drive(
        f"django-q2-{args.broker}",
        args,
        reset=reset,
        enqueue=enqueue,
        workers=[qcluster],
        env=env,
        settings={k: v for k, v in settings.Q_CLUSTER.items() if k != "redis"},
    )


if __name__ == "__main__":
    sys.exit(main())
