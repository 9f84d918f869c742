"""Database set-up: the default SQLite location, WAL and busy timeout, migrations at start."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

BUSY_TIMEOUT_MS = 5000
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


class StorageError(Exception):
    """A database problem a user can act on; the message is one sentence naming the database."""


def data_dir() -> Path:
    """The folder holding the default database (SERVESCOPE_DATA_DIR overrides the user's)."""
    override = os.environ.get("SERVESCOPE_DATA_DIR")
    if override:
        return Path(override)
    from platformdirs import user_data_dir

    return Path(user_data_dir("servescope", appauthor=False))


def default_url() -> str:
    """The SQLite URL used when the user names no database."""
    return f"sqlite:///{data_dir() / 'servescope.db'}"


def display_url(url: str | sa.URL) -> str:
    """The URL with any password masked, for messages."""
    return make_url(url).render_as_string(hide_password=True)


def describe_error(exc: BaseException, url: str | sa.URL) -> str:
    """Turn a driver error into one sentence saying what happened and what to do."""
    text = str(getattr(exc, "orig", None) or exc).lower()
    where = display_url(url)
    if "locked" in text or "busy" in text:
        return f"The database {where} is locked by another program; close it or use another --db."
    if "full" in text or "no space" in text:
        return (f"The database {where} is full (disk space or size limit); free space or point "
                "--db at another location.")
    if "unable to open" in text or "could not connect" in text or "connection refused" in text:
        return f"Cannot open the database {where}; check the path or the server address."
    if "readonly" in text or "read-only" in text:
        return f"The database {where} is read-only; use a writable location."
    return f"The database {where} failed: {str(getattr(exc, 'orig', None) or exc).strip()}."


def _sqlite_pragmas(busy_timeout_ms: int):
    def apply(dbapi_conn, _record) -> None:
        # WAL lets the GUI read while the writer writes; the busy timeout rides out short locks
        # instead of failing at once; NORMAL sync is durable at each WAL commit, enough here.
        cur = dbapi_conn.cursor()
        _enter_wal(cur, busy_timeout_ms)
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    return apply


def _enter_wal(cur, busy_timeout_ms: int) -> None:
    """Turn the file to WAL, waiting out other programs doing the same for the busy timeout.

    Two connections turning a new file to WAL at once both hold a read lock and want the
    write lock; SQLite sees the deadlock and answers "locked" at once instead of calling the
    busy handler, so the app and `servescope record` started together on a fresh file could
    fail. The other one is done within milliseconds: retry until the busy timeout."""
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def create_db_engine(url: str | sa.URL, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> Engine:
    """An Engine for any SQLAlchemy URL; SQLite gets WAL, a busy timeout and its folder made."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return sa.create_engine(parsed, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(parsed, connect_args={"check_same_thread": False,
                                                    "timeout": busy_timeout_ms / 1000})
    event.listen(engine, "connect", _sqlite_pragmas(busy_timeout_ms))
    return engine


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    lock = engine.dialect.name == "sqlite" and not _at_head(engine, cfg)
    with engine.begin() as conn:
        if lock:
            # Two programs opening one new file at once (the app and `servescope record`) would
            # both find no schema and both create it, one failing on "table already exists":
            # pysqlite runs DDL outside a transaction. An immediate transaction takes the write
            # lock first, so the second waits (busy timeout), then finds the schema at head.
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def _at_head(engine: Engine, cfg) -> bool:
    """Whether the schema is already at the newest revision (then opening writes nothing, and
    a read-only file opens as before)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_heads()
    return set(current) == set(ScriptDirectory.from_config(cfg).get_heads())


@dataclass
class Database:
    """An open, migrated database: its engine and a session factory."""

    engine: Engine
    url: str

    def __post_init__(self) -> None:
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session committed on success and rolled back on error."""
        with self._sessions.begin() as s:
            yield s

    def close(self) -> None:
        self.engine.dispose()


def open_database(url: str | None = None, *, run_migrations: bool = True,
                  busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> Database:
    """Open (creating and migrating) the database at `url`, by default the user's SQLite file."""
    url = url or default_url()
    try:
        engine = create_db_engine(url, busy_timeout_ms)
        if run_migrations:
            migrate(engine)
    except sa.exc.ArgumentError as exc:
        raise StorageError(f"{url!r} is not a database URL; use e.g. sqlite:///path.db.") from exc
    except sa.exc.SQLAlchemyError as exc:
        raise StorageError(describe_error(exc, url)) from exc
    return Database(engine, display_url(url) if "@" in str(url) else str(url))
