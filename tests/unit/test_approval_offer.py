"""What one approval offers, read from its run's agent's approval policy (the JSON text the
orchestrator tells for the run's pinned version): the tool's entry, else its risk category's,
else every decision; a policy of the wrong shape is the caller's mistake."""

from __future__ import annotations

import json

import pytest

from services.interactions.approvals import ApprovalOffer
from services.interactions.domain import DECISIONS
from tether.errors import InvalidArgument

POLICY = json.dumps(
    {
        "ttl_seconds": 600,
        "always_allow_scopes": ["principal"],
        "tools": {"publish_post": {"decisions": ["allow-once", "deny"], "ttl_seconds": 3600}},
        "risks": {"publish": {"decisions": ["allow-conversation", "deny"]}},
    }
)


def test_the_tools_entry_wins_over_its_category_and_the_policys_ttl() -> None:
    assert ApprovalOffer.of(POLICY, "publish_post", "publish", 86_400) == ApprovalOffer(
        ["allow-once", "deny"], ["principal"], 3600.0
    )
    assert ApprovalOffer.of(POLICY, "other_post", "publish", 86_400) == ApprovalOffer(
        ["allow-conversation", "deny"], ["principal"], 600.0
    )
    assert ApprovalOffer.of(POLICY, "send", "send_reply", 86_400).decisions == list(DECISIONS)


def test_no_scope_for_allow_always_takes_it_off_the_offer() -> None:
    offer = ApprovalOffer.of(json.dumps({"always_allow_scopes": []}), "x", "publish", 60)
    assert offer.decisions == [d for d in DECISIONS if d != "allow-always"]
    assert offer.always_allow_scopes == []


def test_without_a_policy_the_tenants_decides() -> None:
    assert ApprovalOffer.of("", "x", "publish", 86_400) == ApprovalOffer(None, None, 86_400)


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        ("not json", "not JSON"),
        ("[1]", "/approvals"),
        ('{"tools": 5}', "/approvals/tools"),
        ('{"tools": {"t": {"decisions": ["allow-once"]}}}', "/approvals/tools/t/decisions"),
        ('{"ttl_seconds": -1}', "/approvals/ttl_seconds"),
        ('{"risks": {"publish": {"decisions": "deny"}}}', "/approvals/risks/publish/decisions"),
    ],
)
def test_a_policy_of_the_wrong_shape_is_invalid_argument_naming_where(
    policy: str, named: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        ApprovalOffer.of(policy, "t", "publish", 60)
    assert named in str(refused.value) + json.dumps(refused.value.details or {})
