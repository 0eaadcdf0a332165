"""docs/configuration.md's table of settings is the settings model's: every field of every
section has one row, with its real default, and no row names a key the model lacks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kvpubd.daemon.settings import Settings

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
# A row of the settings table: | `section.key` | default | meaning |
ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]*) \|", re.M)
# A default computed at start rather than written in the model, as the table words it.
UNSET = "unset"


def documented() -> dict[str, str]:
    """Each documented key and its default cell; a key documented twice fails."""
    rows: dict[str, str] = {}
    for key, default in ROW.findall(PAGE.read_text()):
        assert key not in rows, f"{key} has two rows"
        rows[key] = default.strip()
    assert rows, f"no settings table found in {PAGE}"
    return rows


def model_fields() -> dict[str, Any]:
    """Every setting, as `section.key`, with the pydantic field that declares it."""
    fields = {}
    for section, field in Settings.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), section
        for key, inner in model.model_fields.items():
            fields[f"{section}.{key}"] = inner
    return fields


def toml_text(value: Any) -> str:
    """A default as the table writes it: TOML's spelling, in backticks."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def real_default(key: str, field: Any) -> str:
    """What the table must say for ``key``: a computed default (a factory) with the runtime
    directory spelled as the variable it comes from; an absent one (None) as 'unset'."""
    if field.default_factory is not None:
        return toml_text(field.default_factory())
    assert field.default is not PydanticUndefined, f"{key} has no default"
    return UNSET if field.default is None else toml_text(field.default)


def test_every_setting_has_a_row_and_every_row_a_setting() -> None:
    rows, fields = documented(), model_fields()
    assert sorted(set(fields) - set(rows)) == [], "settings missing from the table"
    assert sorted(set(rows) - set(fields)) == [], "rows naming no setting"


@pytest.mark.parametrize("key", sorted(model_fields()))
def test_documented_default_is_the_real_one(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "$XDG_RUNTIME_DIR")
    documented_default = documented().get(key)
    if documented_default is None:
        pytest.fail(f"{key} is not in {PAGE.name}")
    assert documented_default == real_default(key, model_fields()[key])
