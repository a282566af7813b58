"""`tether answer`, `tether decide` and `tether connect`: resolve a paused run from a shell."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx2
from google.protobuf import json_format

from tether.client import TetherClient

Emit = Any


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _answers(pairs: list[str]) -> dict[str, list[str]]:
    answers: dict[str, list[str]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"answers are key=value; got {pair!r}")
        answers.setdefault(key, []).append(value)
    return answers


async def cmd_answer(args: argparse.Namespace, emit: Emit) -> int:
    """Show the open question, or answer it with key=value pairs."""
    async with _client(args) as client:
        if not args.answers:
            pending = await client.pending_question(args.run_id)
            if not pending.HasField("question"):
                emit(args, {"run_id": args.run_id, "question": None}, "no open question")
                return 0
            question = json_format.MessageToDict(pending.question, preserving_proto_field_name=True)
            lines = [
                f"{q['key']}: {q['prompt']}"
                + (f" [{'|'.join(q.get('options', []))}]" if q.get("options") else "")
                for q in question["questions"]
            ]
            emit(args, {"run_id": args.run_id, "question": question}, "\n".join(lines))
            return 0
        response = await client.answer(args.run_id, _answers(args.answers))
    emit(
        args,
        {
            "run_id": args.run_id,
            "interaction_id": response.interaction_id,
            "resumed": response.resumed,
        },
        f"answered {response.interaction_id}; "
        + ("run resumed" if response.resumed else "run was already queued"),
    )
    return 0


async def cmd_decide(args: argparse.Namespace, emit: Emit) -> int:
    """Decide the run's open approval."""
    async with _client(args) as client:
        response = await client.decide(args.run_id, args.decision, args.scope or "")
    emit(
        args,
        {
            "run_id": args.run_id,
            "interaction_id": response.interaction_id,
            "resumed": response.resumed,
            "grant_id": response.grant_id,
            "decision": args.decision,
        },
        f"{args.decision} recorded for {response.interaction_id}"
        + (f" (grant {response.grant_id})" if response.grant_id else ""),
    )
    return 0


async def cmd_connect(args: argparse.Namespace, emit: Emit) -> int:
    """Print the run's consent URL; `--complete` visits it as a browser would and finishes."""
    async with _client(args) as client:
        pending = await client.pending_connection(args.run_id)
        if not pending.HasField("connection"):
            emit(args, {"run_id": args.run_id, "connection": None}, "no open connection")
            return 0
        url = pending.connection.login_url
        if not args.complete:
            emit(
                args,
                {"run_id": args.run_id, "provider": pending.connection.provider, "login_url": url},
                url,
            )
            return 0
        async with httpx2.AsyncClient(timeout=10.0) as http:
            redirect = await http.get(url, follow_redirects=False)
        query = parse_qs(urlparse(redirect.headers.get("location", "")).query)
        state, code = query.get("state", [""])[0], query.get("code", [""])[0]
        if not state or not code:
            raise ValueError(
                f"the provider did not redirect back with a code (HTTP {redirect.status_code})"
            )
        done = await client.complete_connection(args.run_id, state, code)
    emit(
        args,
        {"run_id": args.run_id, "resumed": done.resumed},
        "connected; run resumed" if done.resumed else "connected (the run was already queued)",
    )
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add the three commands to the CLI's subparsers."""
    answer = sub.add_parser("answer", help="show or answer a run's open question")
    answer.add_argument("run_id")
    answer.add_argument("answers", nargs="*", help="key=value (repeat a key for several)")
    common(answer)
    answer.set_defaults(func=wrap(cmd_answer))

    decide = sub.add_parser("decide", help="decide a run's open approval")
    decide.add_argument("run_id")
    decide.add_argument(
        "decision", choices=["allow-once", "allow-conversation", "allow-always", "deny"]
    )
    decide.add_argument(
        "--scope",
        choices=["principal", "tenant", "category"],
        help="who allow-always covers (tenant policy decides what is permitted)",
    )
    common(decide)
    decide.set_defaults(func=wrap(cmd_decide))

    connect = sub.add_parser("connect", help="print (or --complete) a run's consent URL")
    connect.add_argument("run_id")
    connect.add_argument(
        "--complete",
        action="store_true",
        help="visit the URL as a browser would and complete the consent",
    )
    common(connect)
    connect.set_defaults(func=wrap(cmd_connect))
