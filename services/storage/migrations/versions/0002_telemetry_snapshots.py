"""telemetry_snapshots: worker readings over time

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "telemetry_snapshots",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("pool", sa.String(32), nullable=False),
        sa.Column("device_kind", sa.String(16), nullable=False),
        sa.Column("utilization", sa.Float, nullable=False),
        sa.Column("temperature_c", sa.Float, nullable=True),
        sa.Column("acceptance_rate", sa.Float, nullable=True),
        sa.Column("latency_p99_ms", sa.Float, nullable=True),
        sa.Column("num_sessions", sa.Integer, nullable=False),
        sa.Column("queue_depth", sa.Integer, nullable=False),
        sa.Column("routing_version", sa.Integer, nullable=False),
    )
    op.create_index("ix_telemetry_snapshots_created_at", "telemetry_snapshots", ["created_at"])
    op.create_index("ix_telemetry_snapshots_worker_id", "telemetry_snapshots", ["worker_id"])


def downgrade() -> None:
    op.drop_table("telemetry_snapshots")
