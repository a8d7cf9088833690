"""files, batches and their lines; usage records name the batch a line belonged to

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer, "sqlite")
TIMES = ("created", "in_progress", "expires", "finalizing", "completed", "failed", "expired", "cancelling",
         "cancelled")


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(40)))
    op.create_table(
        "files",
        sa.Column("seq", BigId, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(40), nullable=False, unique=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
    )
    op.create_index("ix_files_tenant_seq", "files", ["tenant_id", "seq"])
    op.create_table(
        "batches",
        sa.Column("seq", BigId, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(40), nullable=False, unique=True),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON),
        sa.Column("errors", sa.JSON),
        sa.Column("output_file_id", sa.String(40)),
        sa.Column("error_file_id", sa.String(40)),
        *(sa.Column(f"{t}_at", sa.Integer) for t in TIMES),
    )
    op.create_index("ix_batches_tenant_seq", "batches", ["tenant_id", "seq"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), sa.ForeignKey("batches.id"), primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("request_id", sa.String(160)),
        sa.Column("status_code", sa.Integer),
        sa.Column("response", sa.Text),
        sa.Column("ended_at", sa.Integer),
    )
    op.create_index("ix_batch_lines_state", "batch_lines", ["batch_id", "state"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("batch_id")
