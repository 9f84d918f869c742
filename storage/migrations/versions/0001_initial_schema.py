"""Initial schema: sources, series, samples and rollups, requests, alerts, runs, saved plans."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('alerts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('rule', sa.String(length=200), nullable=False),
    sa.Column('series', sa.String(length=400), nullable=False),
    sa.Column('state', sa.String(length=10), nullable=False),
    sa.Column('ts_ms', sa.BigInteger(), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('threshold', sa.Float(), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_alerts_ts_ms'), ['ts_ms'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('started_ms', sa.BigInteger(), nullable=False),
    sa.Column('finished_ms', sa.BigInteger(), nullable=True),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('summary', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_started_ms'), ['started_ms'], unique=False)

    op.create_table('samples',
    sa.Column('series_id', sa.Integer(), nullable=False),
    sa.Column('ts_ms', sa.BigInteger(), nullable=False),
    sa.Column('value', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('series_id', 'ts_ms'),
    sqlite_with_rowid=False
    )
    op.create_table('samples_1h',
    sa.Column('series_id', sa.Integer(), nullable=False),
    sa.Column('ts_ms', sa.BigInteger(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('total', sa.Float(), nullable=False),
    sa.Column('min', sa.Float(), nullable=False),
    sa.Column('max', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('series_id', 'ts_ms'),
    sqlite_with_rowid=False
    )
    op.create_table('samples_1m',
    sa.Column('series_id', sa.Integer(), nullable=False),
    sa.Column('ts_ms', sa.BigInteger(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('total', sa.Float(), nullable=False),
    sa.Column('min', sa.Float(), nullable=False),
    sa.Column('max', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('series_id', 'ts_ms'),
    sqlite_with_rowid=False
    )
    op.create_table('saved_plans',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_ms', sa.BigInteger(), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('sources',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=40), nullable=False),
    sa.Column('url', sa.Text(), nullable=True),
    sa.Column('token_ref', sa.String(length=200), nullable=True),
    sa.Column('dollars_per_hour', sa.Float(), nullable=True),
    sa.Column('created_ms', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('requests',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('source_id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('ts_ms', sa.BigInteger(), nullable=False),
    sa.Column('ttft_ms', sa.Float(), nullable=True),
    sa.Column('tpot_ms', sa.Float(), nullable=True),
    sa.Column('e2e_ms', sa.Float(), nullable=True),
    sa.Column('itl_ms', sa.JSON(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('output_tokens', sa.Integer(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ),
    sa.ForeignKeyConstraint(['source_id'], ['sources.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_requests_run_id'), ['run_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_source_id'), ['source_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_ts_ms'), ['ts_ms'], unique=False)

    op.create_table('series',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('source_id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=400), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('unit', sa.String(length=40), nullable=True),
    sa.ForeignKeyConstraint(['source_id'], ['sources.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key')
    )
    with op.batch_alter_table('series', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_series_source_id'), ['source_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('series', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_series_source_id'))

    op.drop_table('series')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_requests_ts_ms'))
        batch_op.drop_index(batch_op.f('ix_requests_source_id'))
        batch_op.drop_index(batch_op.f('ix_requests_run_id'))

    op.drop_table('requests')
    op.drop_table('sources')
    op.drop_table('saved_plans')
    op.drop_table('samples_1m')
    op.drop_table('samples_1h')
    op.drop_table('samples')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_started_ms'))

    op.drop_table('runs')
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alerts_ts_ms'))

    op.drop_table('alerts')
