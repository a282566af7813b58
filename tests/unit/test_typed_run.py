"""A run travels above the repositories as `tether.domain.Run` (and its read models), never as a
database row: no annotation in the orchestrator's and admission's modules outside their
repositories names SQLAlchemy's `Row`, and none types a run `Any`. The read models are built
from a row's mapping with every column their callers read."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tether.db.schema import attempts, run_events, runs, usage_turns
from tether.domain import Attempt, LoggedEvent, PricedTurn, Run

ROOT = Path(__file__).resolve().parents[2]
# The modules above the repositories: the orchestrator's own (its repositories are a package
# of their own) and admission's but its repository.
ABOVE = ["services/orchestrator/*.py", "services/admission/*.py"]
REPOSITORIES = {"services/admission/repository.py", "services/admission/schedule_repository.py"}
# What a run or a row of one is called where it is passed.
RUN_NAMES = {"run", "runs", "row", "rows", "previous", "leased", "current"}


def untyped_runs(root: Path) -> list[str]:
    """Every annotation above the repositories, under `root`, that names `Row` or types a run
    `Any`: "path:line: name: annotation"."""
    found = []
    for pattern in ABOVE:
        for path in sorted(root.glob(pattern)):
            where = path.relative_to(root).as_posix()
            if where in REPOSITORIES:
                continue
            tree = ast.parse(path.read_text(), where)
            found += [f"{where}:{line}: {name}: {text}" for line, name, text in _flagged(tree)]
    return found


def _flagged(tree: ast.Module) -> list[tuple[int, str, str]]:
    flagged = []
    for name, annotation in _annotations(tree):
        if _names_row(annotation) or (name in RUN_NAMES and _is_any(annotation)):
            flagged.append((annotation.lineno, name, ast.unparse(annotation)))
    return flagged


def _annotations(tree: ast.Module) -> list[tuple[str, ast.expr]]:
    """(what is annotated, its annotation): arguments, returns (as `name()`) and fields."""
    found: list[tuple[str, ast.expr]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            found += [(a.arg, a.annotation) for a in every if a and a.annotation]
            if node.returns is not None:
                found.append((f"{node.name}()", node.returns))
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            name = target.id if isinstance(target, ast.Name) else ast.unparse(target)
            found.append((name, node.annotation))
    return found


def _names_row(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body  # a quoted annotation
    return any(
        (isinstance(node, ast.Name) and node.id == "Row")
        or (isinstance(node, ast.Attribute) and node.attr == "Row")
        for node in ast.walk(annotation)
    )


def _is_any(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation).strip("'\"")
    return text in {"Any", "typing.Any", "Any | None", "Optional[Any]"}


def test_no_row_or_any_typed_run_above_the_repositories() -> None:
    assert untyped_runs(ROOT) == []


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("def f(run: Row[Any]) -> None: ...", ["run: Row[Any]"]),
        ("async def f() -> Sequence[sqlalchemy.engine.Row[Any]]: ...", ["f(): Sequence"]),
        ("class C:\n    run: 'Row[Any] | None'", ["run: 'Row[Any] | None'"]),
        ("def f(previous: Any) -> None: ...", ["previous: Any"]),
        ("def f(payload: Any, run: Run) -> Run: ...", []),
    ],
)
def test_the_walk_flags_rows_and_untyped_runs(source: str, flagged: list[str]) -> None:
    """The walk finds what it looks for, in every place an annotation stands."""
    found = [f"{name}: {text}" for _, name, text in _flagged(ast.parse(source))]
    assert len(found) == len(flagged)
    assert all(f.startswith(prefix) for f, prefix in zip(found, flagged, strict=True))


@pytest.mark.parametrize(
    ("model", "table", "extra"),
    [
        # `config` is the routing decision whole, as releases before routings kept it: read
        # through `routing_of`, never off the run.
        (Run, runs, {"config"}),
        # Nor the seq of its run.started, which the run's log reads from its row.
        (Attempt, attempts, {"event_seq"}),
        # A turn is read with the attempt it belongs to; its id orders it and is not shown, nor
        # the seq of its usage.updated (which the event's reader fills the turn in by).
        (PricedTurn, usage_turns, {"id", "run_id", "event_seq"}),
        (LoggedEvent, run_events, set()),
    ],
)
def test_each_read_model_carries_its_tables_columns(
    model: type, table: object, extra: set[str]
) -> None:
    columns = {c.name for c in table.c}  # type: ignore[attr-defined]
    fields = set(model.__dataclass_fields__)
    assert fields - {"attempt"} <= columns
    assert columns - fields == extra


def test_a_run_is_built_from_a_rows_mapping_whatever_else_the_row_carries() -> None:
    values = {name: f"v-{name}" for name in Run.__dataclass_fields__}
    values["created_at"] = datetime(2024, 1, 2, tzinfo=UTC)
    run = Run.from_row({**values, "routing_ms": 1.5, "lease_held": True})
    assert run.run_id == "v-run_id"
    assert run.created_at == values["created_at"]
    assert {name: getattr(run, name) for name in Run.__dataclass_fields__} == values
    with pytest.raises(AttributeError):
        run.status = "completed"  # type: ignore[misc]
