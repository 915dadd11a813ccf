"""``.env.example`` documents every setting of this service, with its default (and says why for
the few it sets for a first local run); the settings' own rules are the kit's tests."""

from pathlib import Path

import pytest
from pydantic import BaseModel

from {{ cookiecutter.package_name }}.settings import (
    Settings,
)

pytestmark = pytest.mark.unit


def settings(**values: object) -> Settings:
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


ENV_EXAMPLE = Path(__file__).resolve().parents[2] / ".env.example"
# Values the example file sets on purpose for a first local run (each explained in the file).
LOCAL_OVERRIDES = {
    "MESSAGE_BUS__ENABLE_OUTBOX",
    "MESSAGE_BUS__ENABLE_INBOX",
    "MESSAGE_BUS__SIGNING_KEYS",
    "MESSAGE_BUS__SIGNING_KEY_ID",
}


def documented_settings() -> dict[str, str]:
    lines = ENV_EXAMPLE.read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return dict(pairs)  # type: ignore[arg-type]


# Settings by a context's name (``SOURCES__<CONTEXT>__...``): documented by their pattern.
PER_CONTEXT = {"sources": ["SOURCES__<CONTEXT>__SCHEMA", "SOURCES__<CONTEXT>__DATABASE_URL"]}


def every_setting_name() -> set[str]:
    names = set()
    for section, field in Settings.model_fields.items():
        nested = field.annotation
        if section in PER_CONTEXT:
            continue
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            names |= {f"{section}__{name}".upper() for name in nested.model_fields}
        else:
            names.add(section.upper())
    return names


def test_env_example_documents_every_setting_with_its_default() -> None:
    documented = documented_settings()
    assert set(documented) == every_setting_name()
    from_example = Settings(_env_file=ENV_EXAMPLE).model_dump()  # type: ignore[call-arg]
    defaults = settings().model_dump()
    differing = {
        f"{section}__{name}".upper()
        for section, values in defaults.items()
        if isinstance(values, dict)
        for name, value in values.items()
        if from_example[section][name] != value
    }
    assert differing == LOCAL_OVERRIDES


def test_env_example_documents_the_settings_by_context_name() -> None:
    text = ENV_EXAMPLE.read_text()
    for section, patterns in PER_CONTEXT.items():
        assert section in Settings.model_fields
        for pattern in patterns:
            assert f"# {pattern}=" in text, pattern


def test_a_kit_name_this_module_re_exported_still_imports_with_a_warning_naming_its_home() -> None:
    from outbox_kit.transports.settings import MessageBusSettings

    from {{ cookiecutter.package_name }} import settings as module

    new_home = r"import MessageBusSettings from outbox_kit\.transports\.settings"
    with pytest.warns(DeprecationWarning, match=new_home):
        moved = module.MessageBusSettings
    assert moved is MessageBusSettings
    with pytest.raises(AttributeError, match="no attribute 'Nonsense'"):
        _ = module.Nonsense
