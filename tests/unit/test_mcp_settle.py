"""How an MCP outcome meets the tool path (services.worker.mcp.tools.settle): a result returned,
a definite tool error recorded (ToolError), an unknown outcome or a call that did not run left
unrecorded (UnsettledCall) with a code the model reads."""

from __future__ import annotations

import pytest

from services.worker.mcp.outcome import McpFailure, McpOutcome, failed
from services.worker.mcp.tools import OUTCOME_UNKNOWN, settle
from tether.tools.base import ToolError, UnsettledCall


def test_a_result_is_returned_with_its_structured_content() -> None:
    output = settle(McpOutcome("done", data={"n": 1}), "desk__lookup")
    assert (output.content, output.is_error, output.data) == ("done", False, {"n": 1})


@pytest.mark.parametrize("failure", [McpFailure.TOOL_ERROR, McpFailure.REJECTED])
def test_a_definite_refusal_is_a_tool_error_the_record_keeps(failure: McpFailure) -> None:
    with pytest.raises(ToolError, match="no order 9") as raised:
        settle(failed(failure, "no order 9", definite=True), "desk__lookup")
    assert not isinstance(raised.value, UnsettledCall)


@pytest.mark.parametrize(
    "failure", [McpFailure.TIMEOUT, McpFailure.CONNECTION_LOST, McpFailure.CANCELLED]
)
def test_an_unknown_outcome_is_unsettled_and_says_the_key_is_resent(failure: McpFailure) -> None:
    with pytest.raises(UnsettledCall) as raised:
        settle(failed(failure, "no answer in 30s", definite=False), "desk__cancel")
    assert raised.value.code == OUTCOME_UNKNOWN
    assert "Whether desk__cancel ran is unknown" in str(raised.value)
    assert "same idempotency key" in str(raised.value)


@pytest.mark.parametrize(
    "failure",
    [
        McpFailure.SERVER_DOWN,
        McpFailure.PROTOCOL,
        McpFailure.REFUSED_TARGET,
        McpFailure.UNAUTHORISED,
    ],
)
def test_a_call_that_did_not_run_is_unsettled_under_its_failure_code(failure: McpFailure) -> None:
    with pytest.raises(UnsettledCall) as raised:
        settle(failed(failure, "the server is down", definite=True), "desk__lookup")
    assert raised.value.code == failure.value
    assert str(raised.value) == "the server is down (desk__lookup did not run)"
