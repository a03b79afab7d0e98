"""Every setting of the apps, as a host writes it in settings.py or the standalone service
reads it from the environment: each obvious Python form of its type reads as that type,
anything else is one system-check error (deliveries.E040) naming the setting and the type
it got, never the value (which may be a secret)."""

import re
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.checks import ERROR
from django.core.checks.registry import registry
from django.core.exceptions import ImproperlyConfigured

from deliveries.core import conf as deliveries_conf
from deliveries.core.conf import MISTYPED, UNKNOWN_IN_NAMESPACE, SettingTypeError, read_setting
from deliveries.core.encryption import configured_keys
from ingest import conf as ingest_conf
from ingest.conf import settings as app

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {**deliveries_conf.DEFAULTS, **ingest_conf.DEFAULTS}
UNITS = {**deliveries_conf.UNITS, **ingest_conf.UNITS}
NAMES = sorted(DEFAULTS)
SECRET = "s3cr3t-do-not-print"
KEY = "0Cqf1mXb3cbh1bEeLx4x3QEVz3Y2eAq3_1Yf9xL2mS4="


def accepted(default, unit):
    """(what a host may write, what the apps read) for a setting of this default."""
    if isinstance(default, tuple):
        if default and isinstance(default[0], float):
            return [
                ([5, 300.5], (5.0, 300.5)),
                ((5,), (5.0,)),
                ("5, 300.5", (5.0, 300.5)),
                ([Decimal("1.5"), "2"], (1.5, 2.0)),
                ([unit * 300], (300.0,)),
                ([], ()),
                ("", ()),
            ]
        return [
            (["a", " b "], ("a", "b")),
            (("a",), ("a",)),
            ("a, b", ("a", "b")),
            ("a", ("a",)),  # one value, not its characters
            (b"a,b", ("a", "b")),
            ([b"a", "", " "], ("a",)),
            ([], ()),
        ]
    if isinstance(default, dict):
        return [({"a": "1"}, {"a": "1"}), ({}, {})]
    if isinstance(default, bool):
        return [
            (True, True),
            (False, False),
            ("true", True),
            (" No ", False),
            (1, True),
            (0, False),
        ]
    if isinstance(default, int):
        forms = [(7, 7), ("7", 7), (" 7 ", 7), (7.0, 7), (Decimal("7"), 7)]
        return forms + ([(unit * 7, 7)] if unit else [])
    if isinstance(default, float):
        forms = [(2.5, 2.5), (2, 2.0), ("2.5", 2.5), (Decimal("2.5"), 2.5)]
        return forms + ([(unit * 2.5, 2.5)] if unit else [])
    return [("x", "x"), (" x\n", "x"), (b"x", "x")]


def refused(default, unit):
    """Values of no form of the setting's type."""
    common = [{SECRET: 1}, object()]
    if isinstance(default, dict):
        return [object(), 5, [SECRET], True, SECRET]
    if isinstance(default, tuple):
        if default and isinstance(default[0], float):
            return [*common, 5, {5.0}, [SECRET], [True], [5, None], [float("nan")]]
        return [*common, 5, {SECRET}, [5], [[SECRET]], [b"\xff" + SECRET.encode()]]
    if isinstance(default, bool):
        return [*common, SECRET, 2, [], 0.5]
    if isinstance(default, int):
        forms = [*common, SECRET, 2.5, True, [], float("nan"), "1e400"]
        return forms + ([unit / 2] if unit else [timedelta(seconds=7)])
    if isinstance(default, float):
        forms = [*common, SECRET, True, float("nan"), float("-inf"), [], 10**400]
        return forms + ([] if unit else [timedelta(seconds=2)])
    return [*common, 5, [SECRET], True, b"\xff" + SECRET.encode()]


def app_messages():
    """What the apps' system checks (deploy ones included) say now."""
    checks = registry.get_checks(include_deployment_checks=True)
    ours = [c for c in checks if c.__module__.split(".")[0] in {"deliveries", "ingest"}]
    return [message for check in ours for message in check(app_configs=None)]


@pytest.mark.parametrize("name", NAMES)
def test_every_setting_reads_each_obvious_form_of_its_type(settings, name):
    default, unit = DEFAULTS[name], UNITS.get(name)
    for written, read in accepted(default, unit):
        setattr(settings, name, written)
        assert getattr(app, name) == read, (name, written)
        assert type(getattr(app, name)) is type(read), (name, written)
    setattr(settings, name, None)  # settings.py's os.environ.get() of an unset variable
    assert getattr(app, name) == default
    delattr(settings, name)
    assert getattr(app, name) == default


@pytest.mark.parametrize("name", NAMES)
def test_every_setting_refuses_what_is_no_form_of_its_type_with_one_check_error(settings, name):
    default, unit = DEFAULTS[name], UNITS.get(name)
    for written in refused(default, unit):
        setattr(settings, name, written)
        messages = app_messages()
        about = [m for m in messages if name in m.msg]
        assert [(m.id, m.level) for m in about] == [(MISTYPED, ERROR)], (name, written, messages)
        assert [m for m in messages if m.level >= ERROR] == about, (name, written)
        assert "docs/install.md" in about[0].hint
        assert SECRET not in about[0].msg, "the value is never shown"
        assert re.search(r"takes .+; got ", about[0].msg), about[0].msg
        with pytest.raises(ImproperlyConfigured, match=re.escape(f"{name}: ")) as raised:
            getattr(app, name)
        assert MISTYPED in str(raised.value)
    delattr(settings, name)
    assert not [m for m in app_messages() if m.id == MISTYPED]


@pytest.mark.parametrize("name", NAMES)
def test_the_environment_form_of_every_setting_reads_as_the_same_python_value(monkeypatch, name):
    # The standalone service reads each setting from its environment variable.
    from project.settings import _from_env

    default, unit = DEFAULTS[name], UNITS.get(name)
    if isinstance(default, tuple):
        environ, python = ("5,300.5", [5, 300.5]) if default else ("a, b", ["a", "b"])
    elif isinstance(default, bool):
        environ, python = ("false", False) if default else ("true", True)
    elif isinstance(default, dict):
        environ, python = "a=1,b=2", {"a": "1", "b": "2"}
    elif isinstance(default, int | float):
        environ, python = str(default + 1), default + 1
    else:
        environ, python = "x", "x"
    monkeypatch.setenv(name, environ)
    from_env = read_setting(name, _from_env(name, default), default, unit)
    assert from_env == read_setting(name, python, default, unit)
    assert from_env != default
    monkeypatch.delenv(name)
    assert read_setting(name, _from_env(name, default), default, unit) == default


def test_every_setting_the_standalone_service_reads_from_its_environment_is_documented():
    source = (ROOT / "project" / "settings.py").read_text()
    from_env = set(re.findall(r"\benv\.\w+\(\s*\"([A-Z][A-Z0-9_]+)\"", source)) | set(DEFAULTS)
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", (ROOT / "docs/settings.md").read_text()))
    assert len(from_env) > len(DEFAULTS)
    assert from_env - documented == set()


def test_one_key_written_as_a_string_is_that_key_not_its_characters(settings):
    settings.SECRETS_ENCRYPTION_KEYS = KEY
    assert configured_keys() == (KEY,)
    assert [m for m in app_messages() if m.level >= ERROR] == []
    settings.SECRETS_ENCRYPTION_KEYS = KEY.encode()  # what Fernet.generate_key() returns
    assert configured_keys() == (KEY,)


def test_the_namespace_takes_only_a_dict_of_the_apps_setting_names(settings):
    settings.TRUSTY_WEBHOOKS = {"METRICS_TOKEM": SECRET, "DELIVERY_TIMEOUT": "20"}
    assert app.DELIVERY_TIMEOUT == 20.0
    messages = [m for m in app_messages() if m.level >= ERROR]
    assert [(m.id, m.msg) for m in messages] == [
        (
            UNKNOWN_IN_NAMESPACE,
            "TRUSTY_WEBHOOKS['METRICS_TOKEM'] is no setting of the installed apps.",
        )
    ]
    settings.TRUSTY_WEBHOOKS = [("METRICS_TOKEN", SECRET)]
    assert [m.id for m in app_messages() if m.level >= ERROR] == [UNKNOWN_IN_NAMESPACE]
    settings.TRUSTY_WEBHOOKS = {"DELIVERY_TIMEOUT": []}
    (message,) = [m for m in app_messages() if m.level >= ERROR]
    assert message.id == MISTYPED
    assert (
        message.msg
        == "DELIVERY_TIMEOUT takes a number (of seconds) or a datetime.timedelta; got a list."
    )


def test_every_duration_named_in_units_is_a_number_setting_of_the_apps():
    for name, unit in UNITS.items():
        default = DEFAULTS[name]
        example = default[0] if isinstance(default, tuple) else default
        assert isinstance(example, int | float) and not isinstance(example, bool), name
        assert isinstance(unit, timedelta), name
    with pytest.raises(SettingTypeError):
        read_setting("DELIVERY_RETRY_JITTER", timedelta(seconds=1), 0.2)


def test_install_md_names_the_type_of_every_list_duration_and_flag():
    page = (ROOT / "docs" / "install.md").read_text()
    section = page.split("### Settings as Python values", 1)[1].split("\n#", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")][2:]
    rows = {
        cells[0]: set(re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[2]))
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table)
    }
    unit_rows = {
        timedelta(seconds=1): "seconds",
        timedelta(days=1): "days",
        timedelta(milliseconds=1): "milliseconds",
    }
    expected = {
        "list": {n for n, d in DEFAULTS.items() if isinstance(d, tuple)},
        "flag": {n for n, d in DEFAULTS.items() if isinstance(d, bool)},
        **{row: {n for n, u in UNITS.items() if u == unit} for unit, row in unit_rows.items()},
    }
    assert set(UNITS.values()) <= set(unit_rows), "a unit with no row in install.md"
    for row, names in expected.items():
        assert rows[row] == names, row


def test_a_dict_setting_takes_a_mapping_and_nothing_else():
    assert read_setting("X", {"a": 1}, {}) == {"a": 1}
    assert read_setting("X", None, {"b": 2}) == {"b": 2}
    for written in ("a=1", [("a", 1)], 5):
        with pytest.raises(SettingTypeError, match=r"X: takes a dict; got a "):
            read_setting("X", written, {})
