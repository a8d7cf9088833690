"""Alembic environment: the store hands its connection in (config.attributes["connection"])."""
from alembic import context

from inferd.gateway.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
