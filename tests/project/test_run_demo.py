"""`make run`'s banner: what a newcomer reads first names every page to open."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_demo.py"


def test_the_banner_names_the_admin_the_api_its_docs_and_schema(capsys):
    spec = importlib.util.spec_from_file_location("run_demo", SCRIPT)
    run_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_demo)

    run_demo.banner(8123, "http://127.0.0.1:8124/webhooks", {"API key": "whk_x"}, 3)

    out = capsys.readouterr().out
    for url in ("/admin/", "/api/v1/", "/api/docs/", "/api/schema/", "/healthz"):
        assert f"http://127.0.0.1:8123{url}" in out
