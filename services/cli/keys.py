"""`mirror-sd keys`: API keys, stored hashed, each with a priority tier."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import fail

logger = logging.getLogger(__name__)

app = typer.Typer(help="API keys (stored hashed, each with a priority tier).", no_args_is_help=True)


def _db():
    from services.config import get_settings
    from services.storage.db import init_db, session_factory

    return session_factory(init_db(get_settings().database_url))


@app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="who the key is for")] = "default",
    priority: Annotated[str, typer.Option(help="high | normal | low")] = "normal",
) -> None:
    """Create a key; it is printed once and only its hash is stored."""
    from services.storage import crud

    try:
        with _db()() as session:
            row, key = crud.create_api_key(session=session, name=name, priority=priority)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(key)
    typer.echo(f"created key {row.id} ({row.key_prefix}..., priority {row.priority}) for {name!r}", err=True)


@app.command("list")
def keys_list() -> None:
    from services.storage import crud

    with _db()() as session:
        for row in crud.list_api_keys(session=session):
            state = "revoked" if row.revoked_at else "active"
            typer.echo(f"{row.id}\t{row.key_prefix}...\t{row.priority}\t{state}\t{row.name}")


@app.command("revoke")
def keys_revoke(key_id: Annotated[int, typer.Argument()]) -> None:
    from services.storage import crud

    with _db()() as session:
        if not crud.revoke_api_key(session=session, key_id=key_id):
            fail(f"no active key with id {key_id}")
    typer.echo(f"revoked key {key_id}")
