"""Alembic environment: runs on the connection handed over by services.storage.db.migrate."""

from alembic import context

from services.storage.tables import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through services.storage.db.migrate(engine)")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
