-- celery-fanin schema, version 17: every runtime write to a counter, a batch's state, a successor or the outbox
-- goes through a function that runs with its owner's rights.
--
-- Version 14 made the counting functions SECURITY DEFINER, but the producer still raised a streamed batch's
-- counters, the relay still rewrote counters and states in its recovery and inserted successor and outbox rows,
-- and the worker still updated its successor's row: each with direct column grants. Here each of those writes
-- becomes a function with the checks of its own path (a lost child must be overdue, an expired one past its
-- expiry, a successor's run fenced to its number or its pre-assigned task id, a successor created only for a
-- finished root, from the batch's own row), so that docs/how-to/grants.sql gives the runtime roles EXECUTE on
-- these and no UPDATE on fanin_batches, fanin_children, fanin_successors or fanin_outbox, and no INSERT on the
-- last two. Each function is one statement of the path it replaces or fewer (a streamed chunk's counters: three
-- statements become one); the terminal report and the children's COPY are unchanged.

-- The batch's one successor, of `kind`, and its outbox row, from the batch's own row, once (a no-op the second
-- time); only for a root in a state that runs that kind. Returns the new outbox row's id (NOTIFY sent), or NULL.
CREATE FUNCTION fanin_ensure_successor(p_batch uuid, p_kind text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_outbox bigint;
BEGIN
    WITH succ AS (
        INSERT INTO fanin_successors (batch_id, step, task_id, kind)
        SELECT b.id, b.step, b.successor_task_id, p_kind FROM fanin_batches b
         WHERE b.id = p_batch AND b.parent_id IS NULL
           AND ((p_kind = 'then' AND b.state IN ('complete', 'partial', 'failed_threshold'))
                OR (p_kind = 'on_failure' AND b.state = 'failed_threshold' AND b.on_failure_message IS NOT NULL)
                OR (p_kind = 'on_expire' AND b.state IN ('expired', 'cancelled') AND b.on_expire_message IS NOT NULL))
        ON CONFLICT (batch_id, step) DO NOTHING
        RETURNING batch_id, step
    ), out AS (
        INSERT INTO fanin_outbox (batch_id, step) SELECT batch_id, step FROM succ RETURNING id
    )
    SELECT id INTO v_outbox FROM out;
    IF v_outbox IS NOT NULL THEN
        PERFORM pg_notify('fanin_outbox', v_outbox::text);
    END IF;
    RETURN v_outbox;
END
$$;

-- A streamed chunk's counters (store/batches.py, add_children): each open leaf of the root waits for its new
-- children, the root for its direct ones and its new leaves; the producer's lease is renewed. Leaves are locked in
-- id order before the root, the order of every terminal report. False if the root is no longer open.
CREATE FUNCTION fanin_add_children(p_root uuid, p_leaves uuid[], p_counts integer[], p_total integer,
                                   p_direct integer, p_digest bytea)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_total < 0 OR p_direct < 0 OR EXISTS (SELECT 1 FROM unnest(p_counts) n WHERE n IS NULL OR n < 0) THEN
        RAISE EXCEPTION 'fanin_add_children: counts must not be negative' USING ERRCODE = '22023';
    END IF;
    IF cardinality(p_leaves) > 0 THEN
        PERFORM 1 FROM fanin_batches WHERE id = ANY(p_leaves) AND parent_id = p_root ORDER BY id FOR UPDATE;
        UPDATE fanin_batches b SET planned = b.planned + p.n, remaining = b.remaining + p.n
          FROM unnest(p_leaves, p_counts) AS p(id, n)
         WHERE b.id = p.id AND b.parent_id = p_root;
    END IF;
    UPDATE fanin_batches
       SET planned = planned + p_total, remaining = remaining + p_direct, digest = p_digest, producer_seen_at = now()
     WHERE id = p_root AND state = 'open';
    RETURN FOUND;
END
$$;

-- Children with idx < p_upto are on the broker or need not be (NULL: all of them so far); never moves back.
CREATE FUNCTION fanin_mark_published(p_batch uuid, p_upto integer)
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_batches SET published_upto = coalesce(p_upto, planned)
     WHERE id = p_batch AND published_upto < coalesce(p_upto, planned)
$$;

-- A deadline (or a cancel) applied to an open or running root, once (store/recovery.py, expire_batch): its
-- unfinished children are abandoned, its counters set from the child rows under the locks every report takes
-- (children, leaves, root), and its successor (proceed), its on_expire, or a nested batch's outer child's failure
-- follows. No row when the batch was not an open or running root (or, for a deadline, was not due).
CREATE FUNCTION fanin_expire_batch(p_batch uuid, p_reason text, p_proceed boolean)
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
        PERFORM fanin_record_terminal(h.parent_task_id, 'failed', NULL, NULL, NULL, v_exc_type,
                                      format('nested batch %s was %s', p_batch,
                                             CASE WHEN p_reason = 'cancel' THEN 'cancelled'
                                                  ELSE 'abandoned at its deadline' END));
    END IF;
    RETURN QUERY SELECT CASE WHEN v_proceed THEN 'proceed' ELSE 'abandon' END, v_abandoned, v_created, v_state;
END
$$;

-- A streamed batch whose input raised, cancelled by its producer: only while the batch is still open.
CREATE FUNCTION fanin_cancel_open(p_batch uuid)
RETURNS TABLE (on_deadline text, abandoned text[], successor_created boolean, state text)
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM fanin_batches t WHERE t.id = p_batch AND t.state = 'open' AND t.parent_id IS NULL)
    THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM fanin_expire_batch(p_batch, 'cancel', false);
END
$$;

-- Recompute one batch's counters from its child rows (and leaves) and repair what disagrees (store/recovery.py,
-- reconcile_batch); `problems` is empty when all was right, NULL when there is no such batch.
CREATE FUNCTION fanin_reconcile_batch(p_batch uuid, OUT problems text[], OUT actions text[])
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    c record;
    v_token integer;
    v_finish boolean;
    v_state text;
    v_kind text;
BEGIN
    SELECT t.id, t.step, t.state, t.planned, t.remaining, t.succeeded, t.failed, t.parent_id,
           t.on_failure_message IS NOT NULL AS has_on_failure
      INTO b FROM fanin_batches t WHERE t.id = p_batch FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    problems := '{}';
    actions := '{}';
    WITH direct AS (
        SELECT count(*) AS created,
               count(*) FILTER (WHERE x.state IN ('pending', 'started')) AS open,
               count(*) FILTER (WHERE x.state = 'succeeded') AS succeeded,
               count(*) FILTER (WHERE x.state NOT IN ('pending', 'started', 'succeeded')) AS failed
          FROM fanin_children x WHERE x.batch_id = p_batch
    ), leaves AS (
        -- a `fail_up` leaf has handed its failures to the root as they were counted, finished or not
        SELECT coalesce(sum(l.planned), 0) AS created,
               count(*) FILTER (WHERE l.state IN ('open', 'running')) AS open,
               coalesce(sum(l.succeeded) FILTER (WHERE l.state NOT IN ('open', 'running')), 0) AS succeeded,
               coalesce(sum(l.failed) FILTER (WHERE l.state NOT IN ('open', 'running') OR l.fail_up), 0) AS failed
          FROM fanin_batches l WHERE l.parent_id = p_batch
    )
    SELECT direct.created + leaves.created AS created, direct.open + leaves.open AS open,
           direct.succeeded + leaves.succeeded AS succeeded, direct.failed + leaves.failed AS failed
      INTO c FROM direct, leaves;
    IF c.created <> b.planned THEN
        problems := problems || format('planned %s children but %s rows exist', b.planned, c.created);
    END IF;
    -- An open batch (or leaf) holds its producer's token and never finishes here.
    v_token := CASE WHEN b.state = 'open' THEN 1 ELSE 0 END;
    IF b.state IN ('open', 'running') AND c.created = b.planned THEN
        IF (b.remaining, b.succeeded, b.failed) <> (c.open + v_token, c.succeeded, c.failed) THEN
            problems := problems || format(
                'counter says remaining=%s succeeded=%s failed=%s, children say remaining=%s succeeded=%s failed=%s',
                b.remaining, b.succeeded, b.failed, c.open + v_token, c.succeeded, c.failed);
            actions := actions || 'counters recomputed from child rows'::text;
        END IF;
        v_finish := c.open = 0 AND v_token = 0;
        IF v_finish THEN
            IF cardinality(problems) = 0 THEN
                problems := problems || 'all children are terminal but the batch was still running'::text;
            END IF;
            actions := actions || 'batch finished'::text;
        END IF;
        IF cardinality(problems) > 0 THEN
            -- Leave one unit for fanin_settle to take, so that finishing goes the way a last report's would.
            UPDATE fanin_batches t
               SET remaining = c.open + v_token + CASE WHEN v_finish THEN 1 ELSE 0 END,
                   succeeded = c.succeeded, failed = c.failed
             WHERE t.id = p_batch;
            IF v_finish THEN
                PERFORM fanin_settle(p_batch, 0, 0);
            END IF;
        END IF;
    END IF;
    SELECT t.state INTO v_state FROM fanin_batches t WHERE t.id = p_batch;
    IF b.parent_id IS NULL AND v_state IN ('complete', 'partial', 'failed_threshold') THEN
        v_kind := CASE WHEN v_state = 'failed_threshold' AND b.has_on_failure THEN 'on_failure' ELSE 'then' END;
        IF fanin_ensure_successor(p_batch, v_kind) IS NOT NULL THEN
            IF NOT EXISTS (SELECT 1 FROM unnest(actions) a WHERE a LIKE '%successor%') THEN
                problems := problems || format('batch is %s but had no successor', v_state);
            END IF;
            actions := actions || 'successor and outbox row inserted'::text;
        ELSE
            INSERT INTO fanin_outbox (batch_id, step)
            SELECT s.batch_id, s.step FROM fanin_successors s
             WHERE s.batch_id = p_batch AND s.step = b.step AND s.state = 'pending'
               AND NOT EXISTS (SELECT 1 FROM fanin_outbox o WHERE o.batch_id = s.batch_id AND o.step = s.step)
            ON CONFLICT (batch_id, step) DO NOTHING;
            IF FOUND THEN
                problems := problems || 'successor had no outbox row'::text;
                actions := actions || 'outbox row inserted'::text;
            END IF;
        END IF;
    END IF;
END
$$;

-- Stop a batch that passed its failure threshold (store/recovery.py, abandon_after_threshold): its unfinished
-- children are abandoned and its counters reach zero; returns their task ids, for the caller to revoke.
CREATE FUNCTION fanin_abandon_after_threshold(p_batch uuid)
RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_abandoned text[];
    v_remaining integer;
BEGIN
    WITH a AS (
        UPDATE fanin_children c
           SET state = 'abandoned', finished_at = now(), exc_type = 'FailureThresholdPassed',
               exc_message = 'the batch passed max_failures before this child finished'
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
           AND c.state IN ('pending', 'started')
           AND EXISTS (SELECT 1 FROM fanin_batches r WHERE r.id = p_batch AND r.state = 'failed_threshold')
     RETURNING c.task_id
    )
    SELECT coalesce(array_agg(a.task_id), '{}') INTO v_abandoned FROM a;
    PERFORM 1 FROM fanin_batches t WHERE t.parent_id = p_batch ORDER BY t.id FOR UPDATE;
    SELECT t.remaining INTO v_remaining FROM fanin_batches t
     WHERE t.id = p_batch AND t.state = 'failed_threshold' FOR UPDATE;
    IF NOT FOUND OR (v_remaining = 0 AND cardinality(v_abandoned) = 0) THEN
        RETURN v_abandoned;
    END IF;
    WITH leaves AS (
        UPDATE fanin_batches l
           SET state = 'failed_threshold', remaining = 0, completed_at = now(),
               succeeded = (SELECT count(*) FROM fanin_children c WHERE c.batch_id = l.id AND c.state = 'succeeded'),
               failed = (SELECT count(*) FROM fanin_children c
                          WHERE c.batch_id = l.id AND c.state NOT IN ('pending', 'started', 'succeeded'))
         WHERE l.parent_id = p_batch AND l.state IN ('open', 'running')
    ), totals AS (
        SELECT count(*) FILTER (WHERE c.state = 'succeeded') AS s,
               count(*) FILTER (WHERE c.state NOT IN ('pending', 'started', 'succeeded')) AS f
          FROM fanin_children c
         WHERE c.batch_id IN (SELECT t.id FROM fanin_batches t WHERE t.id = p_batch OR t.parent_id = p_batch)
    )
    UPDATE fanin_batches b SET remaining = 0, succeeded = totals.s, failed = totals.f
      FROM totals
     WHERE b.id = p_batch;
    RETURN v_abandoned;
END
$$;

-- A lost child's redrive, once per redrive count seen, and only for a child that is overdue in a batch that
-- redrives (store/recovery.py, claim_redrive): back to pending, its timer restarted.
CREATE FUNCTION fanin_claim_redrive(p_task_id text, p_seen integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fanin_children c
       SET state = 'pending', started_at = NULL, redriven_at = now(), redrives = c.redrives + 1
      FROM fanin_batches b
     WHERE c.task_id = p_task_id AND c.state IN ('pending', 'started') AND c.redrives = p_seen
       AND b.id = c.batch_id AND b.state IN ('open', 'running') AND b.on_lost = 'redrive'
       AND c.redrives < b.max_redrives AND b.child_timeout IS NOT NULL
       AND greatest(b.created_at, c.started_at, c.redriven_at, c.eta_at) + b.child_timeout < now();
    RETURN FOUND;
END
$$;

-- An overdue child counted as `lost` (store/recovery.py, fail_lost): only past its batch's child_timeout, not
-- while a nested batch that stands for it runs, and not while it may still be redriven. True if this counted it.
CREATE FUNCTION fanin_fail_lost(p_task_id text)
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
    SELECT * INTO r FROM fanin_record_terminal(
        p_task_id, 'lost', NULL, NULL, NULL, 'ChildLost',
        format('no terminal outcome within child_timeout (%s); redrives: %s', c.timeout, c.redrives));
    RETURN r.counted;
END
$$;

-- A pending child whose message expired more than `p_grace` seconds ago, counted as revoked (store/recovery.py,
-- revoke_expired). The child row is locked and checked first. True if this counted it.
CREATE FUNCTION fanin_revoke_expired(p_task_id text, p_grace double precision)
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
    SELECT * INTO r FROM fanin_record_terminal(p_task_id, 'revoked', NULL, NULL, NULL, '_Revoked', 'expired');
    RETURN r.counted;
END
$$;

-- The relay's renewal of the lease of every open root whose publish lock a live session holds (store/recovery.py,
-- lapsed_open_batches; the lock's key is the batch id's first 64 bits, as store/batches.py takes it).
CREATE FUNCTION fanin_renew_open_batches()
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_batches b SET producer_seen_at = now()
     WHERE b.state = 'open' AND b.parent_id IS NULL
       AND EXISTS (
           SELECT 1 FROM pg_locks l
            WHERE l.granted AND l.locktype = 'advisory' AND l.objsubid = 2
              AND l.classid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 1, 8) AS bit(32))
                                        AS integer) AS oid)
              AND l.objid = CAST(CAST(CAST('x' || substr(replace(b.id::text, '-', ''), 9, 8) AS bit(32))
                                      AS integer) AS oid)
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
$$;

-- Seal an open root and its open leaves (store/recovery.py, seal_open_batch); with `p_grace`, only if its producer
-- was last seen longer ago than that. No row when it is not an open root (or has not lapsed).
CREATE FUNCTION fanin_seal_open(p_batch uuid, p_grace double precision)
RETURNS TABLE (planned integer, successor_created boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_leaves uuid[];
    v_planned integer;
    v_leaf uuid;
    r record;
BEGIN
    SELECT coalesce(array_agg(x.id), '{}') INTO v_leaves FROM (
        SELECT t.id FROM fanin_batches t WHERE t.parent_id = p_batch AND t.state = 'open' ORDER BY t.id FOR UPDATE
    ) x;
    SELECT t.planned INTO v_planned FROM fanin_batches t
     WHERE t.id = p_batch AND t.state = 'open' AND t.parent_id IS NULL
       AND (p_grace IS NULL OR t.producer_seen_at < now() - make_interval(secs => p_grace))
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    FOREACH v_leaf IN ARRAY v_leaves LOOP
        PERFORM fanin_seal(v_leaf);
    END LOOP;
    SELECT * INTO r FROM fanin_seal(p_batch);
    RETURN QUERY SELECT v_planned, coalesce(r.successor_created, false);
END
$$;

-- The relay's claim (store/outbox.py, claim): up to `p_limit` due, unsent outbox rows no other transaction holds
-- (only `p_ids`, when given), locked until the caller's transaction ends, each with its batch's and successor's
-- rows read by the same statement.
CREATE FUNCTION fanin_claim_outbox(p_limit integer, p_ids bigint[])
RETURNS TABLE (
    outbox_id bigint, outbox_batch_id uuid, outbox_step text, outbox_attempts integer,
    id uuid, step text, state text, planned integer, remaining integer, succeeded integer, failed integer,
    published_upto integer, successor_task_id text, successor_name text, successor_message bytea,
    successor_content_type text, successor_content_encoding text, created_at timestamptz,
    completed_at timestamptz, deadline_at timestamptz, on_expire_message bytea, on_expire_content_type text,
    on_expire_content_encoding text, on_failure_message bytea, on_failure_content_type text,
    on_failure_content_encoding text, child_timeout_seconds numeric, round integer, retry_of uuid,
    refused_reports integer,
    s_task_id text, s_state text, s_runs integer, s_duplicates integer, s_exc_type text, s_exc_message text,
    s_started_at timestamptz, s_finished_at timestamptz, s_kind text
)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT o.id, o.batch_id, o.step, o.attempts,
           b.id, b.step, b.state, b.planned, b.remaining, b.succeeded, b.failed, b.published_upto,
           b.successor_task_id, b.successor_name, b.successor_message, b.successor_content_type,
           b.successor_content_encoding, b.created_at, b.completed_at, b.deadline_at, b.on_expire_message,
           b.on_expire_content_type, b.on_expire_content_encoding, b.on_failure_message, b.on_failure_content_type,
           b.on_failure_content_encoding, extract(epoch FROM b.child_timeout), b.round, b.retry_of,
           b.refused_reports,
           s.task_id, s.state, s.runs, s.duplicates, s.exc_type, s.exc_message, s.started_at, s.finished_at, s.kind
      FROM fanin_outbox o
      LEFT JOIN fanin_batches b ON b.id = o.batch_id
      LEFT JOIN fanin_successors s ON s.batch_id = o.batch_id AND s.step = o.step
     WHERE o.sent_at IS NULL AND o.available_at <= now()
       AND (p_ids IS NULL OR o.id = ANY(p_ids))
     ORDER BY o.available_at, o.id
     LIMIT p_limit
       FOR UPDATE OF o SKIP LOCKED;
END
$$;

-- Claimed rows published: marked sent, their successors `sent` (a started successor keeps its state).
CREATE FUNCTION fanin_outbox_sent(p_ids bigint[])
RETURNS void
LANGUAGE sql AS $$
    WITH sent AS (
        UPDATE fanin_outbox SET sent_at = now(), attempts = attempts + 1
         WHERE id = ANY(p_ids)
     RETURNING batch_id, step
    )
    UPDATE fanin_successors s SET state = 'sent', state_at = now()
      FROM sent
     WHERE s.batch_id = sent.batch_id AND s.step = sent.step AND s.state = 'pending'
$$;

-- A claimed row whose publish failed: kept pending, due again after `p_delay` seconds, with the error.
CREATE FUNCTION fanin_outbox_failed(p_id bigint, p_error text, p_delay double precision)
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_outbox
       SET attempts = attempts + 1, last_error = left(p_error, 2000),
           available_at = now() + make_interval(secs => greatest(p_delay, 0))
     WHERE id = p_id AND sent_at IS NULL
$$;

-- A stalled successor's outbox row put back in line (store/successors.py, republish), checked again here.
CREATE FUNCTION fanin_republish_successor(p_batch uuid, p_step text, p_timeout double precision,
                                          p_grace double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_outbox bigint;
BEGIN
    WITH s AS (
        UPDATE fanin_successors s
           SET state = CASE WHEN s.state = 'running' THEN 'sent' ELSE s.state END,
               lease_until = NULL, state_at = now()
         WHERE s.batch_id = p_batch AND s.step = p_step
           AND ((s.state IN ('sent', 'retrying', 'requeued', 'replaced')
                 AND coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_timeout, 0)))
                OR (s.state = 'running'
                    AND coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_grace, 0))))
     RETURNING s.batch_id, s.step
    )
    UPDATE fanin_outbox o SET sent_at = NULL, available_at = now(), last_error = 'republished: stalled'
      FROM s WHERE o.batch_id = s.batch_id AND o.step = s.step
 RETURNING o.id INTO v_outbox;
    IF v_outbox IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pg_notify('fanin_outbox', v_outbox::text);
    RETURN true;
END
$$;

-- A successor's run admitted (store/successors.py, claim_run): only under its pre-assigned task id, and only when
-- no live run holds it. `run` is NULL when refused; `state` and `run_owner` say why.
CREATE FUNCTION fanin_claim_run(p_batch uuid, p_step text, p_task_id text, p_retries integer,
                                p_lease double precision, p_grace double precision, p_owner text,
                                p_dead_owner text)
RETURNS TABLE (run integer, attempt integer, state text, run_owner text)
LANGUAGE plpgsql AS $$
DECLARE
    v_run integer;
    v_attempt integer;
BEGIN
    UPDATE fanin_successors s
       SET state = 'running', runs = s.runs + 1, attempt = greatest(s.attempt, p_retries),
           lease_until = now() + make_interval(secs => p_lease),
           run_owner = p_owner, started_at = coalesce(s.started_at, now()), state_at = now()
     WHERE s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id
       AND (s.state IN ('pending', 'sent', 'retrying', 'requeued', 'replaced')
            OR (s.state = 'running'
                AND (coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_grace, 0))
                     OR s.run_owner = p_dead_owner)))
 RETURNING s.runs, s.attempt INTO v_run, v_attempt;
    RETURN QUERY SELECT v_run, v_attempt, s.state, s.run_owner
      FROM (SELECT 1) AS one
      LEFT JOIN fanin_successors s ON s.batch_id = p_batch AND s.step = p_step AND s.task_id = p_task_id;
END
$$;

-- A refused delivery, counted (shown by `status` as the successor's duplicates).
CREATE FUNCTION fanin_count_duplicate(p_batch uuid, p_step text)
RETURNS void
LANGUAGE sql AS $$
    UPDATE fanin_successors SET duplicates = duplicates + 1 WHERE batch_id = p_batch AND step = p_step
$$;

-- A run ended without finishing the successor (store/successors.py, hand_over), fenced to its run number.
CREATE FUNCTION fanin_hand_over(p_batch uuid, p_step text, p_run integer, p_state text, p_due timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_state NOT IN ('retrying', 'requeued', 'replaced') THEN
        RAISE EXCEPTION 'fanin_hand_over: not a hand-over state: %', p_state USING ERRCODE = '22023';
    END IF;
    UPDATE fanin_successors
       SET state = p_state, lease_until = p_due, state_at = now(),
           attempt = CASE p_state WHEN 'retrying' THEN attempt + 1 WHEN 'replaced' THEN 0 ELSE attempt END
     WHERE batch_id = p_batch AND step = p_step AND runs = p_run AND state = 'running';
    RETURN FOUND;
END
$$;

-- A hand-over undone (the retry or replacement was never published), fenced to its run number.
CREATE FUNCTION fanin_take_back(p_batch uuid, p_step text, p_run integer, p_lease double precision)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE fanin_successors
       SET state = 'running', lease_until = now() + make_interval(secs => p_lease), state_at = now(),
           attempt = CASE state WHEN 'retrying' THEN greatest(attempt - 1, 0) ELSE attempt END
     WHERE batch_id = p_batch AND step = p_step AND runs = p_run AND state IN ('retrying', 'replaced');
    RETURN FOUND;
END
$$;

-- Live runs' leases extended, in one statement; returns the runs still held (the others were fenced off).
CREATE FUNCTION fanin_renew_leases(p_batches uuid[], p_steps text[], p_runs integer[], p_lease double precision)
RETURNS TABLE (batch_id uuid, step text, runs integer)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH held AS (
        UPDATE fanin_successors s
           SET lease_until = now() + make_interval(secs => p_lease)
          FROM unnest(p_batches, p_steps, p_runs) AS l(id, step, run)
         WHERE s.batch_id = l.id AND s.step = l.step AND s.runs = l.run AND s.state = 'running'
     RETURNING s.batch_id, s.step, s.runs
    )
    SELECT h.batch_id, h.step, h.runs FROM held h;
END
$$;

-- A successor moved to a final state, never left again (store/successors.py, record_state): fenced to run
-- `p_run` while it runs, or, from a worker's main process (no run in hand), to the successor's pre-assigned task id. A nested
-- batch's successor reports the outer child it stands for in the same transaction.
CREATE FUNCTION fanin_finish_successor(p_batch uuid, p_step text, p_task_id text, p_run integer, p_state text,
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
        PERFORM fanin_record_terminal(v_parent_task_id, CASE WHEN p_state = 'ignored' THEN 'succeeded' ELSE p_state END,
                                      p_result, p_rct, p_rce, p_exc_type, p_exc_message);
    END IF;
    RETURN true;
END
$$;

-- As version 14: owner's rights, search path pinned to this schema (then pg_temp), no EXECUTE for PUBLIC.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'fanin_ensure_successor(uuid, text)',
        'fanin_add_children(uuid, uuid[], integer[], integer, integer, bytea)',
        'fanin_mark_published(uuid, integer)',
        'fanin_expire_batch(uuid, text, boolean)',
        'fanin_cancel_open(uuid)',
        'fanin_reconcile_batch(uuid)',
        'fanin_abandon_after_threshold(uuid)',
        'fanin_claim_redrive(text, integer)',
        'fanin_fail_lost(text)',
        'fanin_revoke_expired(text, double precision)',
        'fanin_renew_open_batches()',
        'fanin_seal_open(uuid, double precision)',
        'fanin_claim_outbox(integer, bigint[])',
        'fanin_outbox_sent(bigint[])',
        'fanin_outbox_failed(bigint, text, double precision)',
        'fanin_republish_successor(uuid, text, double precision, double precision)',
        'fanin_claim_run(uuid, text, text, integer, double precision, double precision, text, text)',
        'fanin_count_duplicate(uuid, text)',
        'fanin_hand_over(uuid, text, integer, text, timestamptz)',
        'fanin_take_back(uuid, text, integer, double precision)',
        'fanin_renew_leases(uuid[], text[], integer[], double precision)',
        'fanin_finish_successor(uuid, text, text, integer, text, bytea, text, text, text, text)'
    ] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                       current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
