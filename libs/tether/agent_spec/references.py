"""What a document names outside itself, each at its JSON pointer: the tools it offers (its
own, its persona's, personas' and skills'), which the tool catalog must hold, and the models it
runs, which must have a price (the document's `prices` or the built-in price book)."""

from __future__ import annotations

from collections.abc import Iterator

from tether.agent_spec.document import AgentSpec
from tether.agent_spec.violations import Violation, pointer
from tether.pricing import DEFAULT_PRICES


def tool_references(spec: AgentSpec) -> Iterator[tuple[str, str]]:
    """(pointer, tool name) for every tool the document names, in document order."""
    doc = spec.normalised
    for index, name in enumerate(doc.get("tools", ())):
        yield pointer(["tools", index]), name
    for index, name in enumerate(doc.get("persona", {}).get("tools", ())):
        yield pointer(["persona", "tools", index]), name
    for kind in ("personas", "skills"):
        for at, bundle in enumerate(doc.get(kind, ())):
            for index, name in enumerate(bundle.get("tools", ())):
                yield pointer([kind, at, "tools", index]), name


def unpriced_models(spec: AgentSpec) -> Iterator[Violation]:
    """A violation for each model the document runs that has no price. An absent `model` is
    routing's default, which the price book holds; an empty `compaction_model` is the run's own."""
    doc = spec.normalised
    priced = set(doc.get("prices", {})) | set(DEFAULT_PRICES)
    named = [
        (pointer(["model"]), doc.get("model", "")),
        (pointer(["context", "compaction_model"]), doc.get("context", {}).get("compaction_model")),
    ]
    book = ", ".join(sorted(DEFAULT_PRICES))
    for where, model in named:
        if model and model not in priced:
            yield Violation(
                where,
                f"model {model!r} has no price: add it under /prices (US dollars per million "
                f"tokens), or use a model of the built-in price book ({book})",
            )
