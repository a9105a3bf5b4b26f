"""The database, and nothing else in celery-fanin talks SQL.

Each module holds one group of statements: `migrate` (the schema's versions), `batches` (the transactions that
carry the guarantees: create a batch, record a terminal outcome), `outbox` (claim, publish, mark sent) and
`queries` (read-only views for status, outcomes and the CLI).
"""
