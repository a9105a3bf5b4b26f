"""The dashboard's named statements (`celery_fanin/store/sql/dashboard.sql`), read by the store's one loader."""

from __future__ import annotations

from ..store.statements import Statement, parse, sql, statements

__all__ = ["Statement", "parse", "sql", "statements"]
