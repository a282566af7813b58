"""`@tool`: the input schema pydantic derives from a function's type hints, judged by
`jsonschema`'s own validator (draft 2020-12) and by the worker's check (`InputSchema`); the
function receiving pydantic's values; the class form; what the decorator refuses up front."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from tether.tools import (
    RiskCategory,
    ToolContext,
    ToolDefinition,
    ToolError,
    Toolkit,
    ToolOutput,
    ToolSpec,
    tool,
    tools_of,
)
from tether.tools.schema import InputSchema, SchemaError, normalize


class Priority(Enum):
    LOW = "low"
    HIGH = "high"


class Address(BaseModel):
    street: Annotated[str, Field(description="Street and number", min_length=1)]
    postcode: str
    floor: int | None = None


@tool(risk=RiskCategory.PUBLISH, writes_externally=True, timeout_s=5)
async def ship(
    ctx: ToolContext,
    item: Annotated[str, "What to ship"],
    to: Address,
    priority: Priority = Priority.LOW,
    tags: list[str] | None = None,
    count: Annotated[int, Field(ge=1, le=10)] = 1,
    speed: Literal["slow", "fast"] = "slow",
) -> dict[str, Any]:
    """Ships an item to an address."""
    return {
        "item": item,
        "street": to.street,
        "floor": to.floor,
        "priority": priority.name,
        "tags": tags,
        "count": count,
        "speed": speed,
        "key": ctx.idempotency_key,
    }


VALIDATOR = Draft202012Validator(ship.spec.input_schema)
GOOD: dict[str, Any] = {"item": "lamp", "to": {"street": "1 Main St", "postcode": "N1"}}


def ctx(key: str | None = None) -> ToolContext:
    return ToolContext("ten_1", "run_1", "run_1", "toolu_1", key)


def test_the_spec_carries_the_arguments_and_the_docstring() -> None:
    spec = ship.spec
    assert (spec.name, spec.description) == ("ship", "Ships an item to an address.")
    assert (spec.risk, spec.writes_externally, spec.timeout_s) == (RiskCategory.PUBLISH, True, 5)
    Draft202012Validator.check_schema(spec.input_schema)
    InputSchema(spec.input_schema)  # the worker's check: every keyword enforced


def test_required_are_the_parameters_without_defaults_and_the_context_is_not_input() -> None:
    schema = ship.spec.input_schema
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["required"] == ["item", "to"]
    assert set(schema["properties"]) == {"item", "to", "priority", "tags", "count", "speed"}
    assert VALIDATOR.is_valid(GOOD)
    assert not VALIDATOR.is_valid({"item": "lamp"})
    assert not VALIDATOR.is_valid({**GOOD, "ctx": {}})
    assert not VALIDATOR.is_valid({**GOOD, "surprise": 1})


def test_annotated_descriptions_reach_the_model() -> None:
    properties = ship.spec.input_schema["properties"]
    assert properties["item"]["description"] == "What to ship"
    assert properties["to"]["properties"]["street"]["description"] == "Street and number"


def test_a_pydantic_model_argument_is_inlined_and_checked_whole() -> None:
    to = ship.spec.input_schema["properties"]["to"]
    assert "$ref" not in str(ship.spec.input_schema) and "title" not in to
    assert to["required"] == ["street", "postcode"]
    assert not VALIDATOR.is_valid({**GOOD, "to": {"street": "", "postcode": "N1"}})
    assert not VALIDATOR.is_valid({**GOOD, "to": {"postcode": "N1"}})
    assert VALIDATOR.is_valid({**GOOD, "to": {"street": "x", "postcode": "N1", "floor": None}})


def test_enums_literals_bounds_and_lists() -> None:
    properties = ship.spec.input_schema["properties"]
    assert properties["priority"]["enum"] == ["low", "high"]
    assert properties["priority"]["default"] == "low"
    assert properties["speed"]["enum"] == ["slow", "fast"]
    assert (properties["count"]["minimum"], properties["count"]["maximum"]) == (1, 10)
    assert VALIDATOR.is_valid({**GOOD, "priority": "high", "speed": "fast", "count": 10})
    assert not VALIDATOR.is_valid({**GOOD, "priority": "urgent"})
    assert not VALIDATOR.is_valid({**GOOD, "speed": "warp"})
    assert not VALIDATOR.is_valid({**GOOD, "count": 11})
    assert VALIDATOR.is_valid({**GOOD, "tags": ["a", "b"]})
    assert VALIDATOR.is_valid({**GOOD, "tags": None})
    assert not VALIDATOR.is_valid({**GOOD, "tags": ["a", 1]})


def test_an_optional_integer_arriving_as_a_float_is_normalised_to_an_int() -> None:
    # Tool calls carry numbers as doubles (protobuf Struct): 3.0 must become the int 3.
    schema = ship.spec.input_schema
    normal = normalize(schema, {**GOOD, "count": 3.0, "to": {**GOOD["to"], "floor": 2.0}})
    assert normal["count"] == 3 and type(normal["count"]) is int
    assert normal["to"]["floor"] == 2 and type(normal["to"]["floor"]) is int
    assert InputSchema(schema).violations(normal) == []
    assert InputSchema(schema).violations({**GOOD, "count": 2.5}) != []


async def test_the_function_receives_pydantic_values_and_its_dict_becomes_data() -> None:
    output = await ship.run(ctx("eff_1"), {**GOOD, "priority": "high", "tags": ["x"]})
    assert output.data == {
        "item": "lamp",
        "street": "1 Main St",
        "floor": None,
        "priority": "HIGH",
        "tags": ["x"],
        "count": 1,
        "speed": "slow",
        "key": "eff_1",
    }
    assert '"priority": "HIGH"' in output.content and not output.is_error


async def test_strings_and_outputs_pass_through_and_models_become_json() -> None:
    @tool
    async def echo(text: str) -> str:
        """Echoes."""
        return text

    @tool(description="Says where.")
    async def where() -> Address:
        return Address(street="2 Side St", postcode="E2")

    @tool(description="Fails softly.")
    async def soft() -> ToolOutput:
        return ToolOutput("nothing found", is_error=True)

    assert (await echo.run(ctx(), {"text": "hi"})) == ToolOutput("hi")
    assert echo.spec.input_schema["required"] == ["text"]
    assert (await where.run(ctx(), {})).data == {
        "street": "2 Side St",
        "postcode": "E2",
        "floor": None,
    }
    assert where.spec.input_schema == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert (await soft.run(ctx(), {})).is_error
    assert await echo(text="direct") == "direct"  # the function itself stays callable


class Counter:
    """The class form: state on the instance, a tool per method."""

    def __init__(self, start: int) -> None:
        self.value = start

    @tool(description="Adds to the counter.")
    async def add(self, by: int = 1) -> str:
        self.value += by
        return str(self.value)

    @tool(description="Reads the counter.", name="read_counter")
    async def read(self) -> str:
        return str(self.value)


async def test_the_class_form_binds_each_tool_to_its_instance() -> None:
    first, second = Counter(0), Counter(100)
    assert Counter.add.spec.input_schema["properties"] == {"by": {"type": "integer", "default": 1}}
    tools = tools_of(first)
    assert [t.spec.name for t in tools] == ["add", "read_counter"]
    await tools[0].run(ctx(), {"by": 2})
    await second.add.run(ctx(), {})
    assert (first.value, second.value) == (2, 101)
    assert (await tools[1].run(ctx(), {})).content == "2"


def test_a_toolkit_offers_its_tools_and_builds_configured_ones_from_settings() -> None:
    kit = Toolkit(ship, factory=lambda settings: tools_of(Counter(int(settings["START"]))))
    names = [t.spec.name for t in kit.tools({"START": "5"})]
    assert names == ["ship", "add", "read_counter"]


async def test_a_definition_from_parts_runs_its_handler() -> None:
    async def handler(context: ToolContext, input: dict[str, Any]) -> ToolOutput:
        return ToolOutput(f"{context.run_id}:{input['q']}")

    spec = ToolSpec("remote__search", "Searches.", {"type": "object", "properties": {}})
    assert (await ToolDefinition(spec, handler).run(ctx(), {"q": "x"})).content == "run_1:x"


class Even(BaseModel):
    n: int

    def model_post_init(self, _: Any) -> None:
        if self.n % 2:
            raise ValueError("n must be even")


class Node(BaseModel):
    children: list[Node] = []


async def test_a_pydantic_validator_refusal_is_a_tool_error_in_the_models_words() -> None:
    @tool(description="Takes an even number.")
    async def even(value: Even) -> str:
        return "ok"

    with pytest.raises(ToolError, match=r"invalid input for tool even: .*n must be even"):
        await even.run(ctx(), {"value": {"n": 3}})


def test_what_would_fail_later_fails_at_decoration() -> None:
    def sync(x: int) -> str:
        """Sync."""
        return ""

    async def undocumented(x: int) -> str:
        return ""

    async def untyped(x) -> str:  # type: ignore[no-untyped-def]
        """Untyped."""
        return ""

    async def stars(*xs: int) -> str:
        """Stars."""
        return ""

    async def when(at: datetime) -> str:
        """When."""
        return ""

    with pytest.raises(TypeError, match="async"):
        tool(sync)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="description"):
        tool(undocumented)
    with pytest.raises(TypeError, match="no type hint"):
        tool(untyped)
    with pytest.raises(TypeError, match="must be named"):
        tool(stars)
    with pytest.raises(SchemaError, match="date-time"):
        tool(when)
    with pytest.raises(ValueError, match="must match"):
        tool(name="has space")(undocumented)


def test_a_recursive_model_is_refused() -> None:
    async def tree(root: Node) -> str:
        """Tree."""
        return ""

    with pytest.raises(TypeError, match="recursive"):
        tool(tree)


async def test_the_context_carries_a_cancellation_the_tool_can_wait_on() -> None:
    context = ctx()
    waited = asyncio.ensure_future(context.cancelled.wait())
    context.cancelled.set()
    await asyncio.wait_for(waited, 1)


def test_the_package_and_its_kit_import_without_the_worker() -> None:
    probe = (
        "import sys, tether.tools, tether.testing.tools; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'services'))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]", f"tether.tools loads {loaded}"
