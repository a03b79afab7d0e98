"""CPU the worker's per-attempt metrics cost: ``deliveries.worker._observe`` over 20,000
successful attempts to 50 endpoints in batches of 200 (no database, no network).

    DATABASE_URL=... .venv/bin/python bench/metrics_overhead.py
"""

import os
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django

django.setup()

from deliveries import state, worker  # noqa: E402
from deliveries.policy import classify  # noqa: E402

ATTEMPTS, BATCH, ENDPOINTS = 20_000, 200, 50


def main() -> None:
    endpoints = [uuid.uuid4() for _ in range(ENDPOINTS)]
    ok = classify(status=200)
    results = [
        state.AttemptResult(
            leased=state.Leased(
                uuid.uuid4(),
                uuid.uuid4(),
                endpoints[i % ENDPOINTS],
                uuid.uuid4(),
                "t",
                b"{}",
                1,
                1,
                uuid.uuid4(),
            ),
            classification=ok,
            started_at=datetime.now(UTC),
            duration_ms=3.0,
            status_code=200,
        )
        for i in range(ATTEMPTS)
    ]
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for i in range(0, ATTEMPTS, BATCH):
            worker._observe(results[i : i + BATCH])
        best = min(best, time.perf_counter() - started)
    print(f"metrics per attempt: {best / ATTEMPTS * 1e6:.2f} µs (best of 5)")


if __name__ == "__main__":
    main()
