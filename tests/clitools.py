"""The `celery fanin` commands as a user can type them, found by walking the command group (so that a test over
"every command" covers one added later without anyone listing it)."""

from __future__ import annotations

import click

from celery_fanin.cli import fanin


def leaf_commands(group: click.Group = fanin, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command under `group` by its path (`("saga", "ack")`)."""
    found: dict[tuple[str, ...], click.Command] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(leaf_commands(command, (*prefix, name)))
        else:
            found[(*prefix, name)] = command
    return found
