"""`@tool`: a tool from an async function, its input schema derived from the type hints.

    @tool(risk=RiskCategory.PUBLISH, writes_externally=True)
    async def create_ticket(
        ctx: ToolContext, title: Annotated[str, "One line: what is wrong"], priority: Priority
    ) -> str:
        \"\"\"Opens a support ticket and returns its id.\"\"\"

The parameters other than the context become the input: each needs a type hint pydantic
understands (str, int, float, bool, enums, `Literal`, lists, dicts, pydantic models, `X | None`
with a default); `Annotated[T, "text"]` or `Annotated[T, Field(description=...)]` describes one
to the model, a default makes it optional. The schema is pydantic's own (`create_model` over the
signature, extra properties forbidden), with `$ref`s inlined and titles dropped, and it is
checked at decoration as the worker checks every schema, so a type the validator cannot enforce
fails at import, not on a call. A parameter annotated `ToolContext` receives the call's context.

The function receives its arguments as pydantic made them (model instances, enum members) and
returns a `str` (the text the model reads), a `ToolOutput`, or anything JSON-able (a pydantic
model, a dict: shown as JSON, kept as the result's `data` when it is an object).

On a method, `@tool` makes a tool per instance (the class form, for tools with state such as a
client): `tools_of(obj)` lists them. `Toolkit` is the provider a package's `tether.tools` entry
point names.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Annotated, Any, get_args, get_origin, overload

import pydantic
from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic_core import to_jsonable_python

from tether.tools.base import RiskCategory, Tool, ToolContext, ToolError, ToolOutput, ToolSpec
from tether.tools.schema import InputSchema

# The Messages API's rule for a tool's name.
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
DEFAULT_TIMEOUT_S = 30.0
# Keywords whose values are subschemas (one, a list, or a map of names to them); the rest of a
# schema object is data (`default`, `enum`, `examples`) and is copied as it is.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties")

Handler = Callable[[ToolContext, dict[str, Any]], Awaitable[ToolOutput]]


class ToolDefinition:
    """A tool from parts: its spec (name, description, input schema, risk, `writes_externally`,
    timeout) and an async handler `(ctx, input) -> ToolOutput`. What `@tool` makes, and what a
    tool source that is not a Python function (an MCP server) builds directly."""

    def __init__(self, spec: ToolSpec, handler: Handler) -> None:
        self.spec = spec
        self._handler = handler

    async def run(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        """Do the work for an input already validated against `spec.input_schema`."""
        return await self._handler(ctx, input)

    def __repr__(self) -> str:
        return f"<tool {self.spec.name}>"


class FunctionTool(ToolDefinition):
    """A tool made by `@tool`; calling it calls the function itself."""

    def __init__(
        self,
        fn: Callable[..., Awaitable[Any]],
        spec: ToolSpec,
        model: type[BaseModel],
        context_param: str | None,
    ) -> None:
        self.fn = fn
        self.input_model = model
        self._context_param = context_param
        super().__init__(spec, self._invoke)

    def __call__(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self.fn(*args, **kwargs)

    def __get__(self, instance: object, owner: type | None = None) -> FunctionTool:
        """On an instance, the tool bound to it (the class form)."""
        if instance is None:
            return self
        return FunctionTool(
            partial(self.fn, instance), self.spec, self.input_model, self._context_param
        )

    async def _invoke(self, ctx: ToolContext, input: dict[str, Any]) -> ToolOutput:
        try:
            parsed = self.input_model.model_validate(input)
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors()
            )
            raise ToolError(f"invalid input for tool {self.spec.name}: {problems}") from None
        kwargs = {name: getattr(parsed, name) for name in type(parsed).model_fields}
        if self._context_param is not None:
            kwargs[self._context_param] = ctx
        return as_output(await self.fn(**kwargs))


@overload
def tool(fn: Callable[..., Awaitable[Any]], /) -> FunctionTool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    risk: RiskCategory | str = RiskCategory.READ,
    writes_externally: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Callable[[Callable[..., Awaitable[Any]]], FunctionTool]: ...


def tool(
    fn: Callable[..., Awaitable[Any]] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    risk: RiskCategory | str = RiskCategory.READ,
    writes_externally: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> FunctionTool | Callable[[Callable[..., Awaitable[Any]]], FunctionTool]:
    """Make a tool of an async function (see the module docstring), bare or with arguments.

    - `name`: what the model calls it (default: the function's name); letters, digits, `_`, `-`.
    - `description`: what the model reads to decide when to call it (default: the docstring).
    - `risk`: its policy class; any but `read` needs an approval or a standing grant to run.
    - `writes_externally`: every call goes through the effects record under an idempotency key
      (`ctx.idempotency_key`, which the tool passes to the external system); a retried call with
      the same key replays the recorded result instead of firing again.
    - `timeout_s`: the call fails with `tool_timeout` (and is cancelled) past this.

    Raises TypeError or ValueError at decoration for what would fail later: a sync function, a
    parameter without a type hint, `*args`, no description, a schema the validator cannot
    enforce whole (e.g. a `datetime`, whose format it does not check: take a `str`).
    """

    def make(function: Callable[..., Awaitable[Any]]) -> FunctionTool:
        return _make(
            function,
            name=name,
            description=description,
            risk=RiskCategory(risk),
            writes_externally=writes_externally,
            timeout_s=timeout_s,
        )

    return make if fn is None else make(fn)


def _make(
    fn: Callable[..., Awaitable[Any]],
    *,
    name: str | None,
    description: str | None,
    risk: RiskCategory,
    writes_externally: bool,
    timeout_s: float,
) -> FunctionTool:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"@tool needs an async function; {fn.__qualname__} is not one")
    tool_name = name or fn.__name__
    if not NAME.match(tool_name):
        raise ValueError(f"tool name {tool_name!r} must match {NAME.pattern}")
    text = description if description is not None else inspect.getdoc(fn)
    if not text:
        raise ValueError(f"tool {tool_name} needs a description: pass description= or a docstring")
    if timeout_s <= 0:
        raise ValueError(f"tool {tool_name}: timeout_s must be positive")
    model, context_param = input_model(fn, tool_name)
    schema = input_schema(model)
    InputSchema(schema, f"{tool_name}.input_schema")  # fails here, not on the first call
    spec = ToolSpec(
        name=tool_name,
        description=text,
        input_schema=schema,
        risk=risk,
        timeout_s=timeout_s,
        writes_externally=writes_externally,
    )
    return FunctionTool(fn, spec, model, context_param)


def input_model(
    fn: Callable[..., Awaitable[Any]], tool_name: str
) -> tuple[type[BaseModel], str | None]:
    """The pydantic model of `fn`'s input parameters, and the name of its context parameter."""
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except NameError as exc:
        raise TypeError(f"tool {tool_name}: a type hint cannot be resolved ({exc})") from exc
    fields: dict[str, Any] = {}
    context_param: str | None = None
    parameters = list(inspect.signature(fn).parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]  # a method: the instance is bound when the tool is read
    for param in parameters:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {tool_name}: parameter {param.name} must be named (no *, **, /)")
        hint = hints.get(param.name)
        if hint is ToolContext:
            context_param = param.name
            continue
        if hint is None:
            raise TypeError(f"tool {tool_name}: parameter {param.name} has no type hint")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (_described(hint), default)
    model = create_model(f"{tool_name}_input", __config__=ConfigDict(extra="forbid"), **fields)
    return model, context_param


def _described(hint: Any) -> Any:
    """`Annotated[T, "text"]` as `Annotated[T, Field(description="text")]`."""
    if get_origin(hint) is not Annotated:
        return hint
    base, *metadata = get_args(hint)
    kept = [Field(description=m) if isinstance(m, str) else m for m in metadata]
    return Annotated[(base, *kept)] if kept else base


def input_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON Schema as the model is shown it: `$ref`s inlined, titles dropped."""
    schema = model.model_json_schema()
    definitions: Mapping[str, Any] = schema.get("$defs", {})
    flat = _inline(schema, definitions, ())
    flat.setdefault("properties", {})
    return flat


def _inline(
    schema: Mapping[str, Any], defs: Mapping[str, Any], seen: tuple[str, ...]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = ref.removeprefix("#/$defs/")
        if target in seen or target not in defs:
            raise TypeError(f"tool input cannot be recursive or refer outside itself ({ref})")
        out.update(_inline(defs[target], defs, (*seen, target)))
    for key, value in schema.items():
        if key in ("$ref", "$defs", "title"):
            continue
        if key in _ONE and isinstance(value, Mapping):
            out[key] = _inline(value, defs, seen)
        elif key in _LIST and isinstance(value, list):
            out[key] = [_inline(v, defs, seen) if isinstance(v, Mapping) else v for v in value]
        elif key in _NAMED and isinstance(value, Mapping):
            out[key] = {n: _inline(v, defs, seen) for n, v in value.items()}
        else:
            out[key] = value
    return out


def as_output(value: Any) -> ToolOutput:
    """What a tool function returned, as the output the model reads."""
    if isinstance(value, ToolOutput):
        return value
    if isinstance(value, str):
        return ToolOutput(value)
    if value is None:
        return ToolOutput("")
    plain = to_jsonable_python(value)
    return ToolOutput(
        json.dumps(plain, ensure_ascii=False), data=plain if isinstance(plain, dict) else None
    )


def tools_of(instance: object) -> list[Tool]:
    """The tools an object's `@tool` methods make, bound to it (the class form)."""
    found: dict[str, Tool] = {}
    for klass in reversed(type(instance).__mro__):
        for attribute, value in vars(klass).items():
            if isinstance(value, FunctionTool):
                found[attribute] = getattr(instance, attribute)
    return list(found.values())


class Toolkit:
    """A `ToolProvider`: what a package's `tether.tools` entry point names.

    `Toolkit(tool_a, tool_b)` offers those tools; `factory`, when given, is called with the
    worker's `TETHER_TOOL_...` settings and adds the tools it returns (for tools configured from
    them: a base URL, a region).
    """

    def __init__(
        self, *tools: Tool, factory: Callable[[Mapping[str, str]], Iterable[Tool]] | None = None
    ) -> None:
        self._tools = tools
        self._factory = factory

    def tools(self, settings: Mapping[str, str]) -> Sequence[Tool]:
        """The tools, the factory's built from `settings`."""
        made = [] if self._factory is None else list(self._factory(settings))
        return [*self._tools, *made]
