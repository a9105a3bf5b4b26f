-- celery-fanin schema, version 10: a successor's run is held by a lease on its row, not by a session's lock.
--
-- Until version 9 a pool process held a session-level advisory lock while it ran a successor's body. That lock
-- died with its session (a PostgreSQL restart, a failover, idle_session_timeout, a dropped TCP connection, a
-- transaction-mode pooler), after which the stall detector could start a second, concurrent run. A run is now a
-- lease: `lease_until`, renewed by a heartbeat while the body runs, and fenced by the run number `runs` (every
-- write a run makes names its run number, so a run whose lease was taken over can no longer write).
--
-- `attempt` is the Celery retry count the successor is at, so that a copy republished by the relay (a fresh
-- message whose `retries` is 0) resumes the count instead of starting it again. `run_owner` says which worker,
-- process and thread holds the lease, for operators.
--
-- The successor's states are now: pending, sent (published), running (a run holds the lease), retrying (a run
-- asked Celery to retry; `lease_until` is when the retry is due), requeued (Reject(requeue=True)), replaced
-- (Task.replace: the replacement, which has the same task id, carries the run on), and the final ones:
-- succeeded, failed, revoked, ignored (the body raised Ignore).

ALTER TABLE fanin_successors
    ADD COLUMN lease_until timestamptz,
    ADD COLUMN attempt integer NOT NULL DEFAULT 0,
    ADD COLUMN run_owner text;

-- The roles that may move a successor's state (the worker and relay roles of docs/how-to/grants.sql) may write its
-- lease too, and those that may start a run (the worker role) its attempt and owner, so that a deployment
-- upgraded before its grants are run again keeps running successors.
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS role,
               att.attname = 'runs' AS starts_runs
          FROM pg_attribute att
         CROSS JOIN LATERAL aclexplode(att.attacl) AS a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE att.attrelid = 'fanin_successors'::regclass AND att.attname IN ('state', 'runs')
           AND a.privilege_type = 'UPDATE'
    LOOP
        IF g.starts_runs THEN
            EXECUTE 'GRANT UPDATE (lease_until, attempt, run_owner) ON fanin_successors TO ' || g.role;
        ELSE
            EXECUTE 'GRANT UPDATE (lease_until) ON fanin_successors TO ' || g.role;
        END IF;
    END LOOP;
END
$grants$;
