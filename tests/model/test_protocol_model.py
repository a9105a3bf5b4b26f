"""The counting protocol checked as a model against the real database (issue 26): see machine.py for what runs.

The default budget fits CI (a few minutes on a shared 2-core machine); `pytest tests/model --model-examples N
--model-steps M` runs longer (RELIABILITY.md records the last long run).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import Phase
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import run_state_machine_as_test

from .conftest import model_budget, model_settings
from .machine import FAILURES, STATS, ProtocolMachine, SuccessorGuardMachine

CI_EXAMPLES = 40
CI_STEPS = 40


@pytest.mark.timeout(1800)
def test_protocol_model(
    scratch_db: Callable[[], str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hypothesis shrinks a failure for up to 5 minutes; each step here is a few round trips, so keep it to 2.
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 120)
    examples, steps = model_budget(request.config, CI_EXAMPLES, CI_STEPS)
    url = scratch_db()
    machine = type("Protocol", (ProtocolMachine,), {"url": url})
    STATS.clear()
    FAILURES.clear()
    try:
        run_state_machine_as_test(
            machine,
            settings=model_settings(
                examples, steps, phases=[Phase.generate, Phase.target, Phase.shrink, Phase.explain], print_blob=True
            ),
        )
    except Exception as exc:
        if FAILURES:  # what failed first, which a replay that diverged does not show
            first = FAILURES[0]
            raise AssertionError(
                f"{type(exc).__name__}: {exc}\n\nthe first error, in {first.where}:\n{first.traceback}"
            ) from exc
        raise
    print("protocol model:", examples, "examples of up to", steps, "steps;", dict(sorted(STATS.items())))


@pytest.mark.timeout(900)
def test_successor_guard_model(
    scratch_db: Callable[[], str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run guard alone (`SuccessorGuardMachine`): copies of a successor's message, replacements and their
    carriers, main-process events about copies, holders that die, forged takeovers and the stall scan."""
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 120)
    examples, steps = model_budget(request.config, CI_EXAMPLES, CI_STEPS)
    machine = type("Guard", (SuccessorGuardMachine,), {"url": scratch_db()})
    STATS.clear()
    FAILURES.clear()
    run_state_machine_as_test(
        machine, settings=model_settings(examples, steps, phases=[Phase.generate, Phase.shrink], print_blob=True)
    )
    print("successor guard model:", examples, "examples of up to", steps, "steps;", dict(sorted(STATS.items())))
    assert STATS["runs admitted"] and STATS["end_run committed"], "the guard's machine admits and ends runs"
