"""the console: users who sign in by name and password, and each record's time per output token

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("console_users",
                    sa.Column("name", sa.String(64), primary_key=True),
                    sa.Column("role", sa.String(16), nullable=False),
                    sa.Column("password_hash", sa.String(256), nullable=False),
                    sa.Column("created_unix_s", sa.Float, nullable=False),
                    sa.Column("updated_unix_s", sa.Float, nullable=False))
    op.add_column("usage_records", sa.Column("tpot_s", sa.Float))  # nullable: records before it say nothing


def downgrade() -> None:
    op.drop_column("usage_records", "tpot_s")
    op.drop_table("console_users")
