-- celery-fanin schema, version 18: one function per name; a changed signature gets a new name (`_v2`).
--
-- From here on a function is never overloaded: a new version of a function whose arguments change is created
-- under a new name (`fanin_record_terminal_v2`), its callers move to it, and the old one is dropped once nothing
-- calls it (store/sql/schema.sql holds every function as it is now; docs/concepts/layout.md says how to change
-- one). Here:
--   fanin_record_start (version 3): unused since version 6 (starts are written by fanin_record_starts); dropped.
--   fanin_record_terminal, 7 arguments (version 3): forwarded to the 10-argument form; dropped.
--   fanin_record_terminal, 10 arguments (version 6): renamed fanin_record_terminal_v2. Its callers are all
--   functions (the recovery paths of the definer_writes migration, and a successor's hand-over to its outer
--   child); they are created again below, calling it by its new name, and given back their owner's rights and
--   pinned search path (CREATE OR REPLACE resets both).

DROP FUNCTION fanin_record_start(text, integer, text);
DROP FUNCTION fanin_record_terminal(text, text, bytea, text, text, text, text);
ALTER FUNCTION fanin_record_terminal(text, text, bytea, text, text, text, text, timestamptz, integer, text)
    RENAME TO fanin_record_terminal_v2;

CREATE OR REPLACE FUNCTION fanin_expire_batch(p_batch uuid, p_reason text, p_proceed boolean)
RETURNS TABLE (on_deadline text, abandoned text[], successor_created boolean, state text)
LANGUAGE plpgsql AS $$
DECLARE
    h record;
    v_proceed boolean;
    v_exc_type text;
    v_exc_message text;
    v_abandoned text[];
    v_state text;
    v_created boolean := false;
BEGIN
    IF p_reason = 'deadline' THEN
        v_exc_type := 'DeadlineExceeded';
        v_exc_message := 'the batch deadline passed before this child finished';
    ELSIF p_reason = 'cancel' THEN
        v_exc_type := 'Cancelled';
        v_exc_message := 'the batch was cancelled before this child finished';
    ELSE
        RAISE EXCEPTION 'fanin_expire_batch: unknown reason %', p_reason USING ERRCODE = '22023';
    END IF;
    SELECT t.on_deadline, t.on_expire_message IS NOT NULL AS has_on_expire, t.parent_task_id INTO h
      FROM fanin_batches t
     WHERE t.id = p_batch AND t.state IN ('open', 'running') AND t.parent_id IS NULL
       AND (p_reason = 'cancel' OR t.deadline_at <= now());
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_proceed := coalesce(p_proceed, p_reason = 'deadline' AND h.on_deadline = 'proceed');
    WITH a AS (
        UPDATE fanin_children c
           SET state = 'abandoned', finished_at = now(), exc_type = v_exc_type, exc_message = v_exc_message
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
           AND c.state IN ('pending', 'started')
     RETURNING c.task_id
    )
    SELECT coalesce(array_agg(a.task_id), '{}') INTO v_abandoned FROM a;
    PERFORM 1 FROM fanin_batches t WHERE t.parent_id = p_batch ORDER BY t.id FOR UPDATE;
    PERFORM 1 FROM fanin_batches t WHERE t.id = p_batch AND t.state IN ('open', 'running') FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_state := CASE WHEN v_proceed THEN 'partial' WHEN p_reason = 'cancel' THEN 'cancelled' ELSE 'expired' END;
    WITH totals AS (
        SELECT count(*) FILTER (WHERE c.state = 'succeeded') AS s,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS f
          FROM fanin_children c
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
    ), leaves AS (
        UPDATE fanin_batches l SET state = v_state, remaining = 0, completed_at = now()
         WHERE l.parent_id = p_batch AND l.state IN ('open', 'running')
    )
    UPDATE fanin_batches b
       SET state = v_state, remaining = 0, succeeded = totals.s, failed = totals.f, completed_at = now()
      FROM totals
     WHERE b.id = p_batch;
    IF v_proceed THEN
        v_created := fanin_ensure_successor(p_batch, 'then') IS NOT NULL;
    ELSIF h.has_on_expire THEN
        v_created := fanin_ensure_successor(p_batch, 'on_expire') IS NOT NULL;
    ELSIF h.parent_task_id IS NOT NULL THEN
        -- A nested batch abandoned with nothing to run: the outer child it stands for fails now.
        PERFORM fanin_record_terminal_v2(h.parent_task_id, 'failed', NULL, NULL, NULL, v_exc_type,
                                         format('nested batch %s was %s', p_batch,
                                                CASE WHEN p_reason = 'cancel' THEN 'cancelled'
                                                     ELSE 'abandoned at its deadline' END),
                                         NULL, NULL, NULL);
    END IF;
    RETURN QUERY SELECT CASE WHEN v_proceed THEN 'proceed' ELSE 'abandon' END, v_abandoned, v_created, v_state;
END
$$;

CREATE OR REPLACE FUNCTION fanin_fail_lost(p_task_id text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    c record;
    r record;
BEGIN
    SELECT x.redrives, b.child_timeout::text AS timeout INTO c
      FROM fanin_children x JOIN fanin_batches b ON b.id = x.batch_id
     WHERE x.task_id = p_task_id AND x.state IN ('pending', 'started')
       AND b.state IN ('open', 'running') AND b.child_timeout IS NOT NULL
       AND (b.on_lost = 'fail' OR x.redrives >= b.max_redrives)
       AND greatest(b.created_at, x.started_at, x.redriven_at, x.eta_at) + b.child_timeout < now()
       AND NOT EXISTS (SELECT 1 FROM fanin_batches n
                        WHERE n.parent_task_id = x.task_id AND n.state IN ('open', 'running'))
       FOR UPDATE OF x;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT * INTO r FROM fanin_record_terminal_v2(
        p_task_id, 'lost', NULL, NULL, NULL, 'ChildLost',
        format('no terminal outcome within child_timeout (%s); redrives: %s', c.timeout, c.redrives), NULL, NULL, NULL);
    RETURN r.counted;
END
$$;

CREATE OR REPLACE FUNCTION fanin_revoke_expired(p_task_id text, p_grace double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    PERFORM 1 FROM fanin_children
     WHERE task_id = p_task_id AND state = 'pending'
       AND expires_at + make_interval(secs => greatest(p_grace, 0)) < now()
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT * INTO r FROM fanin_record_terminal_v2(p_task_id, 'revoked', NULL, NULL, NULL, '_Revoked', 'expired',
                                                  NULL, NULL, NULL);
    RETURN r.counted;
END
$$;

CREATE OR REPLACE FUNCTION fanin_finish_successor(p_batch uuid, p_step text, p_task_id text, p_run integer, p_state text,
                                       p_result bytea, p_rct text, p_rce text, p_exc_type text,
                                       p_exc_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    IF p_state NOT IN ('succeeded', 'failed', 'revoked', 'ignored') THEN
        RAISE EXCEPTION 'fanin_finish_successor: not a final successor state: %', p_state USING ERRCODE = '22023';
    END IF;
    UPDATE fanin_successors s
       SET state = p_state, exc_type = p_exc_type, exc_message = p_exc_message, state_at = now(),
           result = p_result, result_content_type = p_rct, result_content_encoding = p_rce,
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND s.state NOT IN ('succeeded', 'failed', 'revoked', 'ignored')
       AND CASE WHEN p_run IS NULL THEN s.task_id = p_task_id ELSE s.runs = p_run AND s.state = 'running' END
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        -- Ignore() ended the body without an error and without a value: the outer child succeeded.
        PERFORM fanin_record_terminal_v2(v_parent_task_id,
                                         CASE WHEN p_state = 'ignored' THEN 'succeeded' ELSE p_state END,
                                         p_result, p_rct, p_rce, p_exc_type, p_exc_message, NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_expire_batch(uuid, text, boolean)',
        'fanin_fail_lost(text)',
        'fanin_revoke_expired(text, double precision)',
        'fanin_finish_successor(uuid, text, text, integer, text, bytea, text, text, text, text)'
    ] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
