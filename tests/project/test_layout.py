"""The house's floors, read from the code's imports (every import, a function's too):

- the floor, ``deliveries.core``: imports nothing of the apps but itself, and defines no
  model;
- the job machinery, ``deliveries.jobs``: the floor and itself;
- ``ingest``: the floor, the machinery, itself and the outbound product's services named
  in PRODUCT_SERVICES;
- the outbound product (the rest of ``deliveries``): anything of ``deliveries``, never
  ``ingest``;

and no module imports itself back, however long the way round. Beside them: the
products reach the machinery's tables and message keys only through its interface, and
only the places that use a PostgreSQL feature ask which database they are on.
docs/architecture.md, "Floors", draws the same picture.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPS = ("deliveries", "ingest")
TABLES = re.compile(r"deliveries_(outbox|queuemessage|entitylock|looprun)\b")

# What ingest uses of the outbound product, and why.
PRODUCT_SERVICES = {
    "deliveries.alerts": "incidents: the checkpoint a check counts from, their kinds",
    "deliveries.api.views": "the tenant-scoped REST view that authenticates a tenant's key",
    "deliveries.selectors": "a tenant's egress policy, for a poll source's requests",
}


def modules() -> dict[str, Path]:
    """Every module of the apps (migrations aside), by dotted name."""
    found = {}
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imported(name: str, path: Path) -> set[str]:
    """The apps' modules ``name`` imports, anywhere in it: a name imported from a module
    counts as the module, or as the submodule when it is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = ".".join(p for p in ((base if node.level else ""), node.module or "") if p)
            targets = [f"{module}.{a.name}" for a in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def floor_of(module: str) -> str:
    if module == "deliveries.core" or module.startswith("deliveries.core."):
        return "floor"
    if module == "deliveries.jobs" or module.startswith("deliveries.jobs."):
        return "machinery"
    if module.startswith("ingest"):
        return "ingest"
    return "outbound"


def allowed(importer: str, target: str) -> bool:
    floors = {
        "floor": {"floor"},
        "machinery": {"floor", "machinery"},
        "ingest": {"floor", "machinery", "ingest"},
        "outbound": {"floor", "machinery", "outbound"},
    }
    if floor_of(target) in floors[floor_of(importer)]:
        return True
    # The package itself (deliveries/__init__.py, which is empty) is everyone's.
    return target == "deliveries" or (floor_of(importer) == "ingest" and target in PRODUCT_SERVICES)


def test_every_import_stays_on_its_floor_or_goes_down():
    steps_up = sorted(
        f"{name} ({floor_of(name)}) imports {target} ({floor_of(target)})"
        for name, targets in GRAPH.items()
        for target in targets
        if not allowed(name, target)
    )
    assert steps_up == []


def test_no_module_imports_itself_back():
    """Tarjan's strongly connected components of the import graph: every one a single
    module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(GRAPH[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert circles == []


def test_the_floor_defines_no_model():
    models = {
        str(path.relative_to(ROOT))
        for name, path in MODULES.items()
        if floor_of(name) == "floor"
        and re.search(r"\(models\.Model\)|^class \w+\(Model\)", path.read_text(), re.M)
    }
    assert models == set()


def test_the_rules_see_every_kind_of_import():
    """The reader counts what it should: a relative import from a package, a function's
    import, and a name that is a submodule."""
    assert "deliveries.core.sql" in GRAPH["deliveries.statements.worker"]
    assert "deliveries.jobs.brokers" in GRAPH["deliveries.jobs.kinds"]
    assert "ingest.schemes.base" in GRAPH["ingest.schemes.stripe"]
    assert floor_of("deliveries.core.conf") == "floor"
    assert not allowed("deliveries.jobs.loop", "deliveries.models")
    assert not allowed("deliveries.core.text", "deliveries.jobs.ids")
    assert not allowed("deliveries.services", "ingest.models")
    assert not allowed("ingest.worker", "deliveries.services")


def product_code():
    for name, path in MODULES.items():
        if floor_of(name) in ("outbound", "ingest"):
            yield path


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
        for path in MODULES.values()
        if spelling.search(path.read_text())
    }
    assert places == {"deliveries/jobs/outbox.py"}


# The places that may ask which database they are on: each uses a PostgreSQL feature that
# has no SQLite counterpart. Everywhere else a statement's two spellings are a Statement
# (deliveries.core.sql) in a statements module. Every place listed must still ask, so the
# list stays exact.
VENDOR_PLACES = {
    "deliveries/core/sql.py": "where a statement's PostgreSQL and ORM spellings part",
    "deliveries/jobs/wakeup.py": "NOTIFY and LISTEN, PostgreSQL's; elsewhere loops poll",
    "deliveries/core/prometheus.py": "the gauges' time budget is a statement_timeout",
    "deliveries/core/console.py": "the paginator's count budget is a statement_timeout",
    "deliveries/checks.py": "the system check reads PostgreSQL's server settings",
    "deliveries/jobs/connections.py": "poolers, LISTEN and max_connections are PostgreSQL's",
}
VENDOR = re.compile(r"connection\.vendor|\.vendor\s*[!=]=")


def test_only_the_feature_places_ask_which_database_they_are_on():
    asking = {
        str(path.relative_to(ROOT)) for path in MODULES.values() if VENDOR.search(path.read_text())
    }
    assert asking == set(VENDOR_PLACES)
