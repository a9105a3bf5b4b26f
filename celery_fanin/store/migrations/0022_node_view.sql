-- celery-fanin schema, version 22: `fanin_nodes`, a batch as the operator commands and the dashboard show it.
--
-- One row per batch (a root, a leaf, a retry round): its own columns, its counts in children with those of its
-- unfinished leaves added (but for a `fail_up` leaf's failures, which are in its root's `failed` already:
-- migration 0012), its current successor's state, and, for a nested batch, the index of the outer child it
-- stands for. The node statements of store/sql/queries.sql (`node`, `node_leaves`, `node_descendants`,
-- `node_rounds`, `list_batches`) read it instead of each repeating the join.
--
-- A plain view, no aggregate outside the lateral join: the planner inlines it, so a statement's filter on a
-- batch column walks the same index as before and the leaves are summed only for the rows it returns. It reads
-- with its owner's rights, so docs/how-to/grants.sql grants SELECT on it only to the roles that may read the
-- three tables it joins.

CREATE VIEW fanin_nodes AS
SELECT b.id, b.step, b.state, b.planned,
       b.succeeded + coalesce(l.succeeded, 0) AS succeeded, b.failed + coalesce(l.failed, 0) AS failed,
       b.created_at, b.completed_at, b.deadline_at, b.successor_name, s.state AS successor_state, b.key,
       b.parent_id, b.parent_task_id, b.lineage, b.depth, b.round, b.retry_of, c.idx AS child_index, b.app_name
  FROM fanin_batches b
  LEFT JOIN LATERAL (
        SELECT sum(x.succeeded) AS succeeded, sum(x.failed) FILTER (WHERE NOT x.fail_up) AS failed
          FROM fanin_batches x
         WHERE x.parent_id = b.id AND x.state IN ('open', 'running')
  ) l ON true
  LEFT JOIN fanin_successors s ON s.batch_id = b.id AND s.step = b.step
  LEFT JOIN fanin_children c ON c.task_id = b.parent_task_id;
