"""SQL storage (SQLAlchemy 2.0, Alembic): requests, API keys, events. SQLite by default, PostgreSQL by URL."""

from services.storage.db import create_db_engine, init_db, session_factory

__all__ = ["create_db_engine", "init_db", "session_factory"]
