"""Alembic environment for maintd.

Driven by :mod:`maintd.migrate`, which passes the target schema and either a live connection
(online) or an output buffer (``maintd migrate --sql``) through ``config.attributes``.
"""

from alembic import context

from maintd.db import quote_ident

config = context.config
schema = config.attributes["schema"]

if context.is_offline_mode():
    context.configure(
        url="postgresql+psycopg://",
        dialect_name="postgresql",
        literal_binds=True,
        version_table_schema=schema,
        output_buffer=config.attributes.get("output_buffer"),
        transactional_ddl=True,
        # SQL for psql: a "%" stays one (the default pyformat style would print "%%").
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        # Only when missing: PostgreSQL checks CREATE on the database before IF NOT EXISTS, and
        # the owner role (its schema made for it by a superuser) has none.
        q = quote_ident(schema)
        context.execute(f"DO $$BEGIN IF to_regnamespace('{q}') IS NULL THEN "
                        f"CREATE SCHEMA IF NOT EXISTS {q}; END IF; END$$")
        context.run_migrations()
else:
    connection = config.attributes["connection"]
    context.configure(
        connection=connection,
        version_table_schema=schema,
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()
