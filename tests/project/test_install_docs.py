"""docs/install.md's "The services you call" says what the code is: every call it shows
names a function of that module, with each parameter it shows in the function's own
order, kind (positional, keyword-only, ``**``) and default, and every parameter the
function requires. (The page's code blocks run in tests/e2e/test_host_docs.py.)"""

import ast
import inspect
import re
from datetime import timedelta
from pathlib import Path

from django.utils.module_loading import import_string

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "install.md").read_text()
SECTION = PAGE.split("## The services you call", 1)[1].split("\n## ", 1)[0]


def documented_calls() -> list[tuple[str, str]]:
    """(dotted name, parameter list) of every call in the section's tables: under
    'From `module`:', a row's first cell names calls of that module (or dotted names)."""
    calls, module = [], None
    for line in SECTION.splitlines():
        if match := re.match(r"From `([\w.]+)`", line):
            module = match.group(1)
        elif line.startswith("| `"):
            cell = line.split(" | ")[0]
            for name, params in re.findall(r"`([\w.]+)\(([^`]*)\)`", cell):
                calls.append((name if "." in name else f"{module}.{name}", params))
    return calls


def params_of(text: str) -> list[inspect.Parameter]:
    """The parameters a documented parameter list declares."""
    tree = ast.parse(f"def f({text}): pass").body[0].args
    kinds = inspect.Parameter
    found = []
    positional = tree.posonlyargs + tree.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(tree.defaults))
    for arg, default in zip(positional, defaults + tree.defaults, strict=True):
        found.append(kinds(arg.arg, kinds.POSITIONAL_OR_KEYWORD, default=_value(default)))
    for arg, default in zip(tree.kwonlyargs, tree.kw_defaults, strict=True):
        found.append(kinds(arg.arg, kinds.KEYWORD_ONLY, default=_value(default)))
    if tree.kwarg:
        found.append(kinds(tree.kwarg.arg, kinds.VAR_KEYWORD))
    return found


def _value(node):
    if node is None or node is inspect.Parameter.empty:
        return inspect.Parameter.empty
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "timedelta":
        return timedelta(**{k.arg: ast.literal_eval(k.value) for k in node.keywords})
    return ast.literal_eval(node)


def test_the_page_shows_the_calls_a_host_makes():
    names = {name for name, _ in documented_calls()}
    assert {
        "deliveries.services.publish_event",
        "deliveries.services.tenant_get_or_create",
        "deliveries.services.api_key_create",
        "deliveries.services.endpoint_create",
        "deliveries.jobs.background.enqueue",
        "deliveries.jobs.services.recurring_job_save",
    } <= names


def test_every_call_the_page_shows_has_the_functions_parameters():
    wrong = []
    for name, text in documented_calls():
        real = inspect.signature(import_string(name)).parameters
        shown = params_of(text)
        order = [p.name for p in shown]
        if order != [n for n in real if n in order]:
            wrong.append(f"{name}: {order} is not the function's order {list(real)}")
        for param in shown:
            actual = real.get(param.name)
            if actual is None or (actual.kind, actual.default) != (param.kind, param.default):
                wrong.append(f"{name}: {param} is {actual}")
        required = [
            p.name
            for p in real.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        wrong += [f"{name}: {r} is required, not shown" for r in required if r not in order]
    assert wrong == []
