"""The run's domain model: parts, events, errors and endings as frozen types, and the rules on
them that the orchestrator and the worker both apply. One package, eleven rooms:

- `agents`: the agent an attempt runs as (model, system blocks, tools, MCP servers, limits,
  prices);
- `catalog`: a tool as a worker announces it and as the tool catalog keeps it;
- `channels`: where a channel run's answer goes, and its message's stored origin;
- `assignment`: what a lease hands the worker (the lease, the run's facts, the history);
- `knowledge`: a knowledge document as a list shows it;
- `outcomes`: run errors, model-turn usage, and the endings of a run (completed, failed, cancelled);
- `parts`: the transcript's typed parts and their JSON form;
- `deliveries`: a channel run's answer going out, recorded before it is sent;
- `events`: every event type, and the one constructor that builds each event's payload;
- `render`: the request a worker builds for an agent without a run or a model call;
- `progress`: what an attempt writes under its lease (a numbered batch, its completion, the
  state of a side effect's record);
- `runs`: what is read back of a run (the run, its attempts, priced turns, logged events and
  pinned routing), built once per row by the repositories;
- `rules`: which tool calls dangle, how an interrupted one is closed (and the reasons why), what
  an attempt that is over leaves superseded.

Protobuf stops at the edges: the servicers and the worker's clients convert with `tether.convert`.
Storage stops at the repositories, which read and write these types through `tether.formats` (the
stored JSON, versioned). Everything in between speaks these types; import them from here.
"""

from __future__ import annotations

from tether.domain.agents import (
    DEFAULT_BACKOFF_INITIAL_S,
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_MAX_CHILDREN,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_WAIT_S,
    AgentConfig,
    Bundle,
    ContextPolicy,
    Delegation,
    Limits,
    McpServer,
    SystemBlock,
)
from tether.domain.assignment import Assignment, EarlierRun, EndedChild, Lease, Origin
from tether.domain.catalog import CatalogedTool, ToolAnnouncement, schema_sha256
from tether.domain.channels import ChannelOrigin, ReplyTarget, origin_from_json, origin_to_json
from tether.domain.deliveries import Delivery, delivery_event, delivery_id
from tether.domain.events import (
    TERMINAL_EVENTS,
    Event,
    EventType,
    StoredEvent,
    child_completed,
    child_started,
    children_waiting,
    context_compacted,
    filled_by_reference,
    interaction_event,
    part_added,
    part_superseded,
    part_updated,
    run_cancelled,
    run_completed,
    run_failed,
    run_queued,
    run_retry_pending,
    run_started,
    stored_by_reference,
    text_delta,
    timer_fired,
    timer_set,
    tool_completed,
    tool_failed,
    tool_started,
    turn_json,
    usage_updated,
)
from tether.domain.knowledge import Document
from tether.domain.outcomes import (
    CANCELLED_BY_CALLER,
    Cancelled,
    Completed,
    Ending,
    Failed,
    ModelTurn,
    RunError,
    cancelled_error,
)
from tether.domain.parts import (
    ApprovalMarker,
    ConnectionMarker,
    Content,
    Part,
    PartKind,
    QuestionMarker,
    Role,
    Summary,
    Text,
    Thinking,
    TimerMarker,
    ToolCall,
    ToolResult,
    camel,
    camel_keys,
    content_from_json,
    content_json,
    json_doubles,
    part_from_json,
    part_json,
)
from tether.domain.progress import Batch, Completion, EffectState
from tether.domain.render import FoundDocument, Rendered, RenderJob
from tether.domain.rules import (
    Closing,
    Interruption,
    close_attempt,
    dangling_tool_calls,
    interrupted_results,
    is_whole_call,
    superseded_on_close,
)
from tether.domain.runs import AGENT_VERSION, Attempt, LoggedEvent, PricedTurn, Run, RunRouting

__all__ = [
    "AGENT_VERSION",
    "CANCELLED_BY_CALLER",
    "DEFAULT_BACKOFF_INITIAL_S",
    "DEFAULT_BACKOFF_MAX_S",
    "DEFAULT_MAX_CHILDREN",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_WAIT_S",
    "TERMINAL_EVENTS",
    "AgentConfig",
    "ApprovalMarker",
    "Assignment",
    "Attempt",
    "Batch",
    "Bundle",
    "Cancelled",
    "CatalogedTool",
    "ChannelOrigin",
    "Closing",
    "Completed",
    "Completion",
    "ConnectionMarker",
    "Content",
    "ContextPolicy",
    "Delegation",
    "Delivery",
    "Document",
    "EarlierRun",
    "EffectState",
    "EndedChild",
    "Ending",
    "Event",
    "EventType",
    "Failed",
    "FoundDocument",
    "Interruption",
    "Lease",
    "Limits",
    "LoggedEvent",
    "McpServer",
    "ModelTurn",
    "Origin",
    "Part",
    "PartKind",
    "PricedTurn",
    "QuestionMarker",
    "RenderJob",
    "Rendered",
    "ReplyTarget",
    "Role",
    "Run",
    "RunError",
    "RunRouting",
    "StoredEvent",
    "Summary",
    "SystemBlock",
    "Text",
    "Thinking",
    "TimerMarker",
    "ToolAnnouncement",
    "ToolCall",
    "ToolResult",
    "camel",
    "camel_keys",
    "cancelled_error",
    "child_completed",
    "child_started",
    "children_waiting",
    "close_attempt",
    "content_from_json",
    "content_json",
    "context_compacted",
    "dangling_tool_calls",
    "delivery_event",
    "delivery_id",
    "filled_by_reference",
    "interaction_event",
    "interrupted_results",
    "is_whole_call",
    "json_doubles",
    "origin_from_json",
    "origin_to_json",
    "part_added",
    "part_from_json",
    "part_json",
    "part_superseded",
    "part_updated",
    "run_cancelled",
    "run_completed",
    "run_failed",
    "run_queued",
    "run_retry_pending",
    "run_started",
    "schema_sha256",
    "stored_by_reference",
    "superseded_on_close",
    "text_delta",
    "timer_fired",
    "timer_set",
    "tool_completed",
    "tool_failed",
    "tool_started",
    "turn_json",
    "usage_updated",
]
