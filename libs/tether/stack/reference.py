"""The configuration reference in README.md, generated from the settings classes (every setting,
its default and its environment variable) and from the tenants' retention policy.

`make docs` (`python -m tether.stack.reference`) rewrites the part of README.md between the
markers below, and the agent document's reference (`tether.stack.agent_reference`);
`tests/unit/test_settings_reference.py` fails while README.md differs from what
this writes. A settings class is found wherever a module of `libs/tether` or `services/` uses
pydantic-settings, so a new service or setting shows up without a word here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import sys
from pathlib import Path

from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from tether.retention import DAY_S, RetentionPolicy
from tether.settings import PlatformSettings
from tether.stack import agent_reference

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
BEGIN = "<!-- settings reference: `make docs` writes it from the settings classes; edit them -->"
END = "<!-- end of the settings reference -->"


def settings_modules() -> list[str]:
    """The modules that define settings classes, by their import names."""
    found = []
    paths = [
        *sorted((ROOT / "libs" / "tether").rglob("*.py")),
        *sorted((ROOT / "services").rglob("*.py")),
    ]
    for path in paths:
        relative = path.relative_to(ROOT).as_posix()
        if "/v1/" in relative or path == Path(__file__).resolve():
            continue
        source = path.read_text()
        if "pydantic_settings" not in source and "from tether.settings import" not in source:
            continue
        parts = path.relative_to(ROOT / "libs" if relative.startswith("libs/") else ROOT)
        found.append(".".join(parts.with_suffix("").parts))
    return found


def settings_classes() -> list[type[BaseSettings]]:
    """Every settings class that reads its own environment (it has an env prefix), and the
    fields every service shares (PlatformSettings) first."""
    classes: list[type[BaseSettings]] = []
    for name in settings_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseSettings)
                and value.__module__ == name
                and value.model_config.get("env_prefix")
            ):
                classes.append(value)
    return sorted(classes, key=lambda c: c.model_config.get("env_prefix", ""))


def env_names(cls: type[BaseSettings], name: str, info: FieldInfo) -> list[str]:
    """The environment variables a field is read from."""
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return [c for c in alias.choices if isinstance(c, str)]
    if isinstance(alias, str):
        return [alias]
    prefix = cls.model_config.get("env_prefix", "") or "TETHER_<SERVICE>_"
    return [(prefix + name).upper()]


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(computed at start)"
    value = info.default
    if value == "":
        return "(empty)"
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _bounds(info: FieldInfo) -> str:
    words = []
    for constraint in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            bound = getattr(constraint, attr, None)
            if bound is not None:
                words.append(f"{sign} {bound}")
    return f" Must be {' and '.join(words)}." if words else ""


def _table(cls: type[BaseSettings], names: list[str]) -> list[str]:
    lines = ["| environment variable | default | what |", "|---|---|---|"]
    for name in names:
        info = cls.model_fields[name]
        if not info.description:
            raise ValueError(f"{cls.__module__}.{cls.__name__}.{name} has no description")
        env = " or ".join(f"`{e}`" for e in env_names(cls, name, info))
        what = info.description.replace("|", "\\|") + _bounds(info)
        lines.append(f"| {env} | {_default(info)} | {what} |")
    return lines


def _title(cls: type[BaseSettings]) -> str:
    module = cls.__module__
    if module.startswith("services."):
        who = module.split(".")[1]
    else:
        who = (cls.__doc__ or cls.__name__).split("(")[0].strip().rstrip(".")
    return f"**{who}** (`{module}.{cls.__name__}`)"


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "forever"
    return f"{seconds / DAY_S:g} days (`{seconds:.0f}`)"


def retention_lines() -> list[str]:
    """The tenants' retention policy: each setting, its default and what it keeps."""
    lines = [
        "A tenant's retention policy: `tenants.policy` JSON, under `retention`, in seconds "
        "(`null`: forever); what it leaves out takes the default (`tether.retention`).",
        "",
        "| policy.retention | default | what is kept that long |",
        "|---|---|---|",
    ]
    defaults = RetentionPolicy()
    for item in dataclasses.fields(RetentionPolicy):
        kept = _duration(getattr(defaults, item.name))
        lines.append(f"| `{item.name}` | {kept} | {item.metadata['doc']} |")
    return lines


def reference() -> str:
    """The generated part of README.md, markers included."""
    lines = [
        BEGIN,
        "",
        "Every service reads the shared settings; a setting without a fixed name takes its "
        "service's prefix (`TETHER_GATEWAY_HOST`, `TETHER_WORKER_PORT`, ...).",
        "",
        "**every service** (`tether.settings.PlatformSettings`)",
        "",
        *_table(PlatformSettings, list(PlatformSettings.model_fields)),
    ]
    for cls in settings_classes():
        own = [n for n in cls.model_fields if n not in PlatformSettings.model_fields]
        lines += ["", _title(cls), "", *_table(cls, own)]
    lines += ["", *retention_lines(), "", END]
    return "\n".join(lines)


def rewritten(readme: str) -> str:
    """`readme` with its reference replaced by the current one."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no settings reference between {BEGIN!r} and {END!r}")
    return readme[:start] + reference() + readme[end + len(END) :]


def main() -> None:
    """Rewrite README.md's reference (`--check`: only say whether it is current)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md is stale")
    args = parser.parse_args()
    current = README.read_text()
    wanted = agent_reference.rewritten(rewritten(current))
    if args.check:
        sys.exit(
            0 if wanted == current else "README.md's generated references are stale: make docs"
        )
    README.write_text(wanted)


if __name__ == "__main__":
    main()
