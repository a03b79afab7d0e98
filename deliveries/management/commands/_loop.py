"""Shared options for the loop commands."""

from deliveries.jobs.loop import settle_heap


def add_loop_arguments(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--once", action="store_true", help="Do one unit of work and exit (cron).")
    group.add_argument(
        "--until-idle",
        action="store_true",
        help="Exit once nothing is due or in flight for this loop (tests, batch jobs).",
    )


def settle_if_long_running(*, once: bool, until_idle: bool) -> None:
    """Tune the collector (``settle_heap``) for a process that keeps running: ``--once``
    and ``--until-idle`` runs (cron, tests calling the command in-process) leave it
    alone."""
    if not (once or until_idle):
        settle_heap()
