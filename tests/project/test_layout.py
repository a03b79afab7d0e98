"""The job machinery's boundary: it imports no product module, and the products reach
its tables and message keys only through its interface."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "deliveries" / "jobs"
# What the machinery may import of the deliveries package besides itself: the settings,
# tracing, and three pure modules the products share with it: the retry rule every kind
# retries by (deliveries.policy.RetryPolicy, for the host's background jobs), the text
# rules, whose secret masking a job's stored traceback goes through, and the time-zone
# rule a recurring job's zone is validated by (deliveries.core.timezones).
SHARED = {
    "deliveries.core.conf",
    "deliveries.core.tracing",
    "deliveries.policy",
    "deliveries.core.text",
    "deliveries.core.timezones",
}
TABLES = re.compile(r"deliveries_(outbox|queuemessage|entitylock|looprun)\b")


def imported(path: Path) -> set[str]:
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


def product_code():
    for app in ("deliveries", "ingest"):
        for path in sorted((ROOT / app).rglob("*.py")):
            if JOBS in path.parents or "migrations" in path.parts:
                continue
            yield path


def test_the_machinery_imports_no_product_module():
    reached = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in JOBS.rglob("*.py")
        for name in imported(path)
        if name.split(".")[0] in {"deliveries", "ingest"}
        and not name.startswith("deliveries.jobs")
        and name not in SHARED
        and name != "deliveries"
        and not any(name.startswith(s + ".") for s in SHARED)
    }
    assert reached == set()


def test_the_products_write_the_machinerys_tables_only_through_it():
    # The one exception is what the machinery spells for them: outbox_insert_sql and
    # RELEASE_SQL put its table names into the products' statements.
    spelled = {
        str(path.relative_to(ROOT)) for path in product_code() if TABLES.search(path.read_text())
    }
    assert spelled == set()


def test_the_message_key_is_spelled_in_one_place():
    spelling = re.compile(r"replace\(\w+::text, '-', ''\)|\.hex\}:")
    places = {
        str(path.relative_to(ROOT))
        for path in [*product_code(), *JOBS.rglob("*.py")]
        if spelling.search(path.read_text())
    }
    assert places == {"deliveries/jobs/outbox.py"}


# The places that may ask which database they are on: each uses a PostgreSQL feature that
# has no SQLite counterpart. Everywhere else a statement's two spellings are a Statement
# (deliveries.core.sql) in a queries module. Every place listed must still ask, so the
# list stays exact.
VENDOR_PLACES = {
    "deliveries/core/sql.py": "where a statement's PostgreSQL and ORM spellings part",
    "deliveries/jobs/wakeup.py": "NOTIFY and LISTEN, PostgreSQL's; elsewhere loops poll",
    "deliveries/core/prometheus.py": "the gauges' time budget is a statement_timeout",
    "deliveries/admin.py": "the paginator's count budget is a statement_timeout",
    "deliveries/checks.py": "the system check reads PostgreSQL's server settings",
    "deliveries/jobs/connections.py": "poolers, LISTEN and max_connections are PostgreSQL's",
}
VENDOR = re.compile(r"connection\.vendor|\.vendor\s*[!=]=")


def test_only_the_feature_places_ask_which_database_they_are_on():
    asking = {
        str(path.relative_to(ROOT))
        for app in ("deliveries", "ingest")
        for path in sorted((ROOT / app).rglob("*.py"))
        if "migrations" not in path.parts and VENDOR.search(path.read_text())
    }
    assert asking == set(VENDOR_PLACES)
