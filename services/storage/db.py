"""Engine creation, waiting for the database, and migrating it to head with Alembic."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def create_db_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        # Several processes share the file: wait on locks instead of failing.
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        if parsed.database and parsed.database != ":memory:":
            event.listen(engine, "connect", _sqlite_wal)
        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, pool_pre_ping=True)


def _sqlite_wal(connection, _record) -> None:
    """A file database in WAL mode with synchronous=NORMAL: a commit appends to the log without waiting on the
    disk (the gateway commits a row per request on its hot path), readers never block the writer, and the file
    stays consistent after a crash (a power loss may forget the last commits, never corrupt the rest)."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def wait_for_db(engine: Engine, *, attempts: int = 30, delay_s: float = 1.0) -> None:
    for attempt in range(1, attempts + 1):
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            return
        except OperationalError as exc:
            if attempt == attempts:
                raise
            logger.warning("database not ready (attempt %d/%d): %s", attempt, attempts, exc.orig)
            time.sleep(delay_s)


def migrate(engine: Engine) -> None:
    """alembic upgrade head, on this engine's connection."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def init_db(url: str) -> Engine:
    engine = create_db_engine(url)
    wait_for_db(engine)
    migrate(engine)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
