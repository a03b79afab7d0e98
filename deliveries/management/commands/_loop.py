"""Shared options for the loop commands."""


def add_loop_arguments(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--once", action="store_true", help="Do one unit of work and exit (cron).")
    group.add_argument(
        "--until-idle",
        action="store_true",
        help="Exit once nothing is due or in flight for this loop (tests, batch jobs).",
    )
