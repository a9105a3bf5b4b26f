-- celery-fanin: database roles, step 1 of 2. Run once, as a superuser or the database owner, before migrating.
-- Replace `fanin` in the database name with yours; give each LOGIN role a password (\password NAME in psql) or
-- whatever authentication your pg_hba.conf uses.

-- Owns the schema: `celery -A proj fanin migrate` runs as this role, and nothing else does.
CREATE ROLE fanin_owner LOGIN;
-- Creates batches and reads their status (any process that calls fan_in_group(...).apply_async()).
CREATE ROLE fanin_producer LOGIN;
-- Celery workers: record children's outcomes and run successors.
CREATE ROLE fanin_worker LOGIN;
-- The relay sidecar: publishes successors and orphaned children, recovery and reconciliation.
CREATE ROLE fanin_relay LOGIN;
-- Retention: deletes finished batches (their children, successors and outbox rows go with them).
CREATE ROLE fanin_maintenance LOGIN;
-- The dashboard (`celery -A proj fanin dashboard`): reads batches and sagas, writes nothing.
CREATE ROLE fanin_dashboard LOGIN;

-- PostgreSQL 15 and later no longer let every role create tables in the public schema.
GRANT CREATE ON SCHEMA public TO fanin_owner;
