-- celery-fanin schema, version 30: what operators did from the dashboard (`fanin dashboard --allow-actions`: retry
-- failed, cancel, seal, rerun), who and when, whether it was done, refused or failed (issue 40). Kept when batches
-- are pruned: it is a record of people's actions, not of the batch.

CREATE TABLE fanin_operator_actions (
    id       bigserial,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text NOT NULL,
    action   text NOT NULL,
    batch_id uuid NOT NULL,
    outcome  text NOT NULL,
    detail   text,
    CONSTRAINT fanin_operator_actions_pkey PRIMARY KEY (id),
    CONSTRAINT fanin_operator_actions_action_check CHECK (action IN ('retry-failed', 'cancel', 'seal', 'rerun')),
    CONSTRAINT fanin_operator_actions_outcome_check CHECK (outcome IN ('done', 'refused', 'error'))
);
CREATE INDEX fanin_operator_actions_batch ON fanin_operator_actions (batch_id, at);

-- fanin_record_action(text,text,uuid,text,text)
CREATE FUNCTION fanin_record_action(p_actor text, p_action text, p_batch uuid, p_outcome text, p_detail text)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO fanin_operator_actions (actor, action, batch_id, outcome, detail)
    VALUES (left(p_actor, 200), p_action, p_batch, p_outcome, left(p_detail, 2000))
    RETURNING id INTO v_id;
    RETURN v_id;
END
$$;

-- Definer rights, the search path pinned, PUBLIC's EXECUTE revoked; granted to the roles that may cancel a batch
-- (the operator's commands run as the relay's role). The roles that read the successors may read the record.
DO $$
DECLARE
    r regrole;
    f text := 'fanin_record_action(text, text, uuid, text, text)';
BEGIN
    EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, %I, pg_temp', f,
                   current_schema());
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_proc p, aclexplode(p.proacl) a
              WHERE p.oid = 'fanin_expire_batch(uuid, text, boolean)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', f, r);
    END LOOP;
    FOR r IN SELECT DISTINCT a.grantee::regrole
               FROM pg_class c, aclexplode(c.relacl) a
              WHERE c.oid = 'fanin_successors'::regclass
                AND a.privilege_type = 'SELECT' AND a.grantee <> 0 AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT SELECT ON fanin_operator_actions TO %s', r);
    END LOOP;
END
$$;
