-- A bound for a replaced successor (issue 38): `fanin_replaced_timeout` seconds after its replacement's carrier was
-- due (handed over, or its run's lease lapsed), the relay records the successor failed (`ReplacementLost`), so that
-- its batch and a nested batch's outer child end. A carrier that arrives later is refused, as any copy of a final
-- successor is. No bound unless the setting is given (the replacement is the user's canvas: Celery publishes it and
-- the broker redelivers it).

-- fanin_fail_lost_replacement(uuid,text,double precision,text)
CREATE FUNCTION fanin_fail_lost_replacement(p_batch uuid, p_step text, p_timeout double precision, p_message text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent_task_id text;
BEGIN
    -- A live carrier run renews its lease, so only a carrier that never came or whose run died (its lease lapsed)
    -- is past the bound; the row's lock orders this against the carrier's own admission and end.
    UPDATE fanin_successors s
       SET state = 'failed', exc_type = 'ReplacementLost', exc_message = left(p_message, 2000), state_at = now(),
           finished_at = now(), lease_until = NULL
      FROM fanin_batches b
     WHERE s.batch_id = p_batch AND s.step = p_step AND b.id = s.batch_id
       AND s.carrier IS NOT NULL AND s.state IN ('replaced', 'running')
       AND coalesce(s.lease_until, s.state_at) < now() - make_interval(secs => greatest(p_timeout, 0))
 RETURNING b.parent_task_id INTO v_parent_task_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_parent_task_id IS NOT NULL THEN
        PERFORM fanin_record_terminal_v2(v_parent_task_id, 'failed', NULL, NULL, NULL, 'ReplacementLost',
                                         left(p_message, 2000), NULL, NULL, NULL);
    END IF;
    RETURN true;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked; granted to the roles that may republish a
-- stalled successor (the relay's), so that a relay granted before this migration goes on without grants.sql.
DO $$
DECLARE
    r regrole;
BEGIN
    EXECUTE format('ALTER FUNCTION fanin_fail_lost_replacement(uuid, text, double precision, text) '
                   'SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', current_schema());
    REVOKE EXECUTE ON FUNCTION fanin_fail_lost_replacement(uuid, text, double precision, text) FROM PUBLIC;
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_republish_successor(uuid, text, double precision, double precision)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION fanin_fail_lost_replacement(uuid, text, double precision, text) '
                       'TO %s', r);
    END LOOP;
END
$$;
