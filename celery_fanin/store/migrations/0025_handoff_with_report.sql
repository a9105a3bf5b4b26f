-- celery-fanin schema, version 25: the report that hands a worker its successor returns that successor with it.
--
-- fanin_handed_off(batch) is what the worker's `handed_off` read returned, as one jsonb array: the batch's
-- outbox rows handed to this session (unsent, not yet due for the relay), each with its batch's and successor's
-- columns. The worker's report statement calls it when the report created a successor, so the worker that
-- publishes it needs no second round trip between its report's commit and the publish. It is VOLATILE so that,
-- called after the report function in the same statement, it takes a new snapshot and sees the rows that function
-- inserted (a join or CTE of the same statement would not); PL/pgSQL so that its plan is kept for the session (a
-- SQL function's is made again at every call, which cost a report more than the read it replaces).
CREATE FUNCTION fanin_handed_off(p_batch uuid)
RETURNS jsonb
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (
        SELECT coalesce(jsonb_agg(to_jsonb(h) ORDER BY h.outbox_id), '[]'::jsonb)
          FROM (SELECT o.id AS outbox_id, o.batch_id AS outbox_batch_id, o.step AS outbox_step,
                       o.attempts AS outbox_attempts,
                       b.id, b.step, b.state, b.planned, b.remaining, b.succeeded, b.failed, b.published_upto,
                       b.successor_task_id, b.successor_name, b.successor_message, b.successor_content_type,
                       b.successor_content_encoding, b.created_at, b.completed_at, b.deadline_at, b.on_expire_message,
                       b.on_expire_content_type, b.on_expire_content_encoding, b.on_failure_message,
                       b.on_failure_content_type, b.on_failure_content_encoding,
                       extract(epoch FROM b.child_timeout) AS child_timeout_seconds, b.round, b.retry_of,
                       b.refused_reports,
                       s.task_id AS s_task_id, s.state AS s_state, s.runs AS s_runs, s.duplicates AS s_duplicates,
                       s.exc_type AS s_exc_type, s.exc_message AS s_exc_message, s.started_at AS s_started_at,
                       s.finished_at AS s_finished_at, s.kind AS s_kind
                  FROM fanin_outbox o
                  JOIN fanin_batches b ON b.id = o.batch_id
                  LEFT JOIN fanin_successors s ON s.batch_id = o.batch_id AND s.step = o.step
                 WHERE o.batch_id = p_batch AND o.sent_at IS NULL AND o.available_at > now()) h);
END
$$;

-- As every function: its owner's rights, the search path pinned, PUBLIC's EXECUTE revoked. The worker's report
-- statement calls it, so every role that may report may call it from now on (grants.sql grants it too): a
-- database whose roles were granted before this migration keeps its workers reporting without running grants.sql
-- again first.
DO $$
DECLARE
    r regrole;
BEGIN
    EXECUTE format('ALTER FUNCTION fanin_handed_off(uuid) SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp',
                   current_schema());
    REVOKE EXECUTE ON FUNCTION fanin_handed_off(uuid) FROM PUBLIC;
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_report_terminal(text, uuid, integer, text, text, bytea, text, text, text, text,
                                                   timestamptz, integer, text)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION fanin_handed_off(uuid) TO %s', r);
    END LOOP;
END
$$;
