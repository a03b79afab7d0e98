"""The service's settings for a qcluster under test, with one difference: django-q2's
guard runs the scheduler once its cycles add up to 30 s, so one cycle of 30 s makes the
guard's first pass (at start) run the due schedules, instead of half a minute later."""

from project.settings import *  # noqa: F403

Q_CLUSTER = {**Q_CLUSTER, "guard_cycle": 30}  # noqa: F405
