"""`tether docs add|list|rm`: the tenant's knowledge documents, which its runs retrieve from."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from tether.client import TetherClient

Emit = Any


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _read(file: str) -> str:
    return sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")


def _document(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


async def cmd_add(args: argparse.Namespace, emit: Emit) -> int:
    """Upload a document: the text of FILE ('-' reads standard input)."""
    content = await asyncio.to_thread(_read, args.file)
    title = args.title or (Path(args.file).name if args.file != "-" else "")
    if not title:
        raise ValueError("--title is required when the text comes from standard input")
    async with _client(args) as client:
        response = await client.add_document(title, content)
    document = response.document
    emit(
        args,
        _document(document),
        f"document {document.document_id} {document.title!r} ({document.chars} characters)",
    )
    return 0


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the tenant's documents, newest first (every page)."""
    token = ""
    async with _client(args) as client:
        while True:
            page = await client.list_documents(page_size=200, page_token=token)
            for document in page.documents:
                emit(
                    args,
                    _document(document),
                    f"{document.document_id}  {document.chars:>6}  {document.title}",
                )
            token = page.next_page_token
            if not token:
                return 0


async def cmd_rm(args: argparse.Namespace, emit: Emit) -> int:
    """Remove a document by its id."""
    async with _client(args) as client:
        response = await client.remove_document(args.document_id)
    emit(args, {"document_id": response.document_id, "removed": True}, "removed")
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `docs` and its commands to the CLI's subparsers."""
    docs = sub.add_parser("docs", help="the tenant's knowledge documents")
    docs_sub = docs.add_subparsers(dest="docs_command", required=True)
    add = docs_sub.add_parser("add", help="upload a document (at most 64,000 characters)")
    add.add_argument("file", help="a UTF-8 text file, or - for standard input")
    add.add_argument("--title", help="title (default: the file's name)")
    listed = docs_sub.add_parser("list", help="list documents, newest first")
    rm = docs_sub.add_parser("rm", help="remove a document")
    rm.add_argument("document_id")
    for command, func in ((add, cmd_add), (listed, cmd_list), (rm, cmd_rm)):
        common(command)
        command.set_defaults(func=wrap(func))
