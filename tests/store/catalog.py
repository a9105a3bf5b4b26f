"""A database's celery-fanin schema as text, read from pg_catalog: what `store/sql/schema.sql` must reproduce.

One line per table (with its storage options), column (in order: type, NOT NULL, default), constraint, index,
sequence, view (its query as `pg_get_viewdef` prints it, and its columns) and function (its whole definition, as
`pg_get_functiondef` prints it: arguments, result, language, volatility, security, configuration and body).
Grants and ownership are left out: they are the deployment's (docs/how-to/grants.sql). `fanin_migrations` is the
migrator's bookkeeping, not the schema.
"""

from __future__ import annotations

import psycopg

_TABLES = """
SELECT c.relname, coalesce(array_to_string(c.reloptions, ','), '')
  FROM pg_class c
 WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' AND c.relname LIKE 'fanin%'
   AND c.relname <> 'fanin_migrations'
 ORDER BY c.relname
"""
_COLUMNS = """
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       coalesce(pg_get_expr(d.adbin, d.adrelid), ''), coalesce(a.attcollation::regcollation::text, '')
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' AND c.relname LIKE 'fanin%'
   AND c.relname <> 'fanin_migrations' AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY c.relname, a.attnum
"""
_CONSTRAINTS = """
SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
  FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
 WHERE c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'fanin%' AND c.relname <> 'fanin_migrations'
 ORDER BY c.relname, k.conname
"""
_INDEXES = """
SELECT i.tablename, i.indexname, i.indexdef
  FROM pg_indexes i
 WHERE i.schemaname = 'public' AND i.tablename LIKE 'fanin%' AND i.tablename <> 'fanin_migrations'
 ORDER BY i.tablename, i.indexname
"""
_SEQUENCES = """
SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmin, s.seqmax, s.seqcycle,
       coalesce(o.relname || '.' || a.attname, '')
  FROM pg_sequence s
  JOIN pg_class c ON c.oid = s.seqrelid
  LEFT JOIN pg_depend d ON d.objid = c.oid AND d.classid = 'pg_class'::regclass AND d.deptype = 'a'
  LEFT JOIN pg_class o ON o.oid = d.refobjid
  LEFT JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
 WHERE c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'fanin%'
 ORDER BY c.relname
"""
_VIEWS = """
SELECT c.relname, coalesce(array_to_string(c.reloptions, ','), ''), pg_get_viewdef(c.oid)
  FROM pg_class c
 WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('v', 'm') AND c.relname LIKE 'fanin%'
 ORDER BY c.relname
"""
_VIEW_COLUMNS = """
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod)
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
 WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('v', 'm') AND c.relname LIKE 'fanin%'
   AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY c.relname, a.attnum
"""
_FUNCTIONS = """
SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
  FROM pg_proc p
 WHERE p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'fanin%'
 ORDER BY 1
"""


def describe(url: str) -> list[str]:
    """The schema of the database at `url` (a libpq URL), one sorted, comparable line per object."""
    lines: list[str] = []
    with psycopg.connect(url) as conn:
        for name, options in conn.execute(_TABLES):
            lines.append(f"table {name} ({options})")
        for table, column, type_, notnull, default, collation in conn.execute(_COLUMNS):
            null = "NOT NULL" if notnull else "NULL"
            lines.append(f"column {table}.{column} {type_} {null} default={default!r} collate={collation!r}")
        for table, name, definition in conn.execute(_CONSTRAINTS):
            lines.append(f"constraint {table}.{name} {definition}")
        for table, name, definition in conn.execute(_INDEXES):
            lines.append(f"index {table}.{name} {definition}")
        for row in conn.execute(_SEQUENCES):
            lines.append("sequence " + " ".join(str(v) for v in row))
        for name, options, definition in conn.execute(_VIEWS):
            lines.append(f"view {name} ({options})")
            lines.extend(f"  {line}" for line in definition.rstrip().splitlines())
        for view, column, type_ in conn.execute(_VIEW_COLUMNS):
            lines.append(f"view column {view}.{column} {type_}")
        for signature, definition in conn.execute(_FUNCTIONS):
            lines.append(f"function {signature}")
            lines.extend(f"  {line}" for line in definition.rstrip().splitlines())
    return lines
