"""`tether channels add slack --demo`: the stand-in's demo secrets without files, refused together
with the secret-file flags (a usage error, exit code 2, before anything is read or sent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tether.cli.channels import DEMO_NAME, _check_slack, _secrets
from tether.cli.main import build_parser, main
from tether.testing.slack_wire import DEMO_BOT_TOKEN, DEMO_SIGNING_SECRET


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--signing-secret-file", "s.txt"],
        ["--bot-token-file", "b.txt"],
        ["--signing-secret-file", "s.txt", "--bot-token-file", "b.txt"],
    ],
)
def test_demo_with_a_secret_file_is_a_usage_error(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["channels", "add", "slack", "--demo", "--api-base-url", "http://127.0.0.1:9/api/"]
    said = usage_error([*argv, *flags], capsys)
    assert "usage: tether channels add slack" in said
    assert "--demo uses the stand-in's demo signing secret and bot token: leave out" in said
    for flag in flags[::2]:
        assert flag in said


def test_without_demo_both_files_and_a_name_are_required(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    said = usage_error(["channels", "add", "slack", "--name", "x"], capsys)
    assert "give --signing-secret-file and --bot-token-file, or --demo" in said
    said = usage_error(
        ["channels", "add", "slack", "--name", "x", "--signing-secret-file", "s.txt"], capsys
    )
    assert "give --signing-secret-file and --bot-token-file, or --demo" in said
    files = ["--signing-secret-file", "s.txt", "--bot-token-file", "b.txt"]
    said = usage_error(["channels", "add", "slack", *files], capsys)
    assert "--name is required (without --demo)" in said


def test_demo_without_the_stand_ins_url_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    said = usage_error(["channels", "add", "slack", "--demo"], capsys)
    assert "--demo needs the Slack stand-in's URL" in said
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"gateway": "127.0.0.1:1", "api_key": "tk_x"}))
    said = usage_error(["channels", "add", "slack", "--demo", "--stack", str(stack)], capsys)
    assert "--demo needs the Slack stand-in's URL" in said


async def test_demo_takes_the_stand_ins_secrets_its_name_and_the_stacks_url(
    tmp_path: Path,
) -> None:
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"slack_api_url": "http://127.0.0.1:4321/api/"}))
    args = build_parser().parse_args(["channels", "add", "slack", "--demo", "--stack", str(stack)])
    _check_slack(args)
    assert (args.name, args.api_base_url) == (DEMO_NAME, "http://127.0.0.1:4321/api/")
    secrets = await _secrets(args)
    assert (secrets.signing_secret, secrets.bot_token) == (DEMO_SIGNING_SECRET, DEMO_BOT_TOKEN)

    own_url = ["--api-base-url", "http://127.0.0.1:9/api/"]
    named = build_parser().parse_args(
        ["channels", "add", "slack", "--demo", "--name", "mine", "--stack", str(stack), *own_url]
    )
    _check_slack(named)
    assert (named.name, named.api_base_url) == ("mine", "http://127.0.0.1:9/api/")
