"""Database fixtures: fresh SQLite per test; PostgreSQL when SERVESCOPE_TEST_PG_URL is set."""

from __future__ import annotations

import os

import pytest
import sqlalchemy as sa

from storage.db import Database, open_database
from storage.models import Base

PG_URL = os.environ.get("SERVESCOPE_TEST_PG_URL")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # One PostgreSQL database serves every test that uses it, each dropping its tables first:
    # under pytest-xdist they all run in one worker, one after another.
    for item in items:
        if "any_db" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("postgres"))


def _reset_postgres(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        Base.metadata.drop_all(conn)
        conn.execute(sa.text("DROP TABLE IF EXISTS alembic_version"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request, tmp_path) -> Database:
    """An open, migrated database of each kind the project supports."""
    if request.param == "postgresql":
        if not PG_URL:
            pytest.skip("SERVESCOPE_TEST_PG_URL is not set (start one with .ci/postgres.sh)")
        _reset_postgres(PG_URL)
        db = open_database(PG_URL)
    else:
        db = open_database(f"sqlite:///{tmp_path / 'test.db'}")
    yield db
    db.close()


@pytest.fixture
def sqlite_db(tmp_path) -> Database:
    """An open, migrated SQLite database in a temporary folder."""
    db = open_database(f"sqlite:///{tmp_path / 'test.db'}")
    yield db
    db.close()
