"""The tables, as SQLAlchemy metadata.

The migrations in `migrations/` are what create the schema; this module describes what they must produce, and
`tests/store/test_migrations.py` checks the two agree. Code reads columns by these names.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    ForeignKey,
    Integer,
    Interval,
    LargeBinary,
    MetaData,
    Table,
    Text,
    Uuid,
)

metadata = MetaData()

batches = Table(
    "fanin_batches",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("step", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("planned", Integer, nullable=False),
    Column("remaining", Integer, nullable=False),
    Column("succeeded", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("published_upto", Integer, nullable=False),
    Column("successor_task_id", Text, nullable=False),
    Column("successor_name", Text, nullable=False),
    Column("successor_message", LargeBinary, nullable=False),
    Column("successor_content_type", Text, nullable=False),
    Column("successor_content_encoding", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("completed_at", DateTime(timezone=True)),
    Column("child_timeout", Interval),
    Column("on_lost", Text, nullable=False),
    Column("max_redrives", Integer, nullable=False),
    Column("deadline_at", DateTime(timezone=True)),
    Column("on_deadline", Text, nullable=False),
    Column("max_failures", Integer),
    Column("on_expire_message", LargeBinary),
    Column("on_expire_content_type", Text),
    Column("on_expire_content_encoding", Text),
    Column("on_failure_message", LargeBinary),
    Column("on_failure_content_type", Text),
    Column("on_failure_content_encoding", Text),
)

children = Table(
    "fanin_children",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("batch_id", Uuid, ForeignKey("fanin_batches.id", ondelete="CASCADE"), nullable=False),
    Column("idx", Integer, nullable=False),
    Column("task_name", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("message", LargeBinary, nullable=False),
    Column("content_type", Text, nullable=False),
    Column("content_encoding", Text, nullable=False),
    Column("result", LargeBinary),
    Column("result_content_type", Text),
    Column("result_content_encoding", Text),
    Column("exc_type", Text),
    Column("exc_message", Text),
    Column("finished_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True)),
    Column("attempt", Integer, nullable=False),
    Column("starts", Integer, nullable=False),
    Column("worker", Text),
    Column("redrives", Integer, nullable=False),
    Column("redriven_at", DateTime(timezone=True)),
    Column("late_state", Text),
    Column("late_at", DateTime(timezone=True)),
    Column("late_reports", Integer, nullable=False),
)

successors = Table(
    "fanin_successors",
    metadata,
    Column("batch_id", Uuid, ForeignKey("fanin_batches.id", ondelete="CASCADE"), primary_key=True),
    Column("step", Text, primary_key=True),
    Column("task_id", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("runs", Integer, nullable=False),
    Column("duplicates", Integer, nullable=False),
    Column("exc_type", Text),
    Column("exc_message", Text),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("kind", Text, nullable=False),
    Column("state_at", DateTime(timezone=True), nullable=False),
)

outbox = Table(
    "fanin_outbox",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("batch_id", Uuid, ForeignKey("fanin_batches.id", ondelete="CASCADE"), nullable=False),
    Column("step", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("available_at", DateTime(timezone=True), nullable=False),
    Column("sent_at", DateTime(timezone=True)),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text),
)
