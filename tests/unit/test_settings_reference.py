"""README.md's configuration reference is the one the settings classes make: every setting of
every service, its default and its environment variable. It fails while README.md is stale;
`make docs` rewrites it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether.settings import PlatformSettings
from tether.stack import reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_reference_is_what_the_settings_classes_say() -> None:
    readme = reference.README.read_text()
    assert reference.rewritten(readme) == readme, (
        "README.md's configuration reference is stale: run `make docs` and commit README.md"
    )


def test_every_service_and_the_embedded_stack_are_in_it() -> None:
    found = {c.__module__ for c in reference.settings_classes()}
    services = {
        f"services.{p.parent.name}.settings" for p in (ROOT / "services").glob("*/settings.py")
    }
    assert services <= found
    assert "tether.stack.settings" in found
    text = reference.reference()
    for cls in reference.settings_classes():
        for name, info in cls.model_fields.items():
            if name not in PlatformSettings.model_fields:
                for env in reference.env_names(cls, name, info):
                    assert f"`{env}`" in text, env


def test_a_setting_without_a_description_is_refused() -> None:
    class Careless(PlatformSettings):
        model_config = SettingsConfigDict(env_prefix="TETHER_CARELESS_")

        knob: int = Field(3)

    with pytest.raises(ValueError, match="knob has no description"):
        reference._table(Careless, ["knob"])
