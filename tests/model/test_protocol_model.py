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


@pytest.mark.timeout(120)
def test_a_rerun_that_waited_on_a_successors_end_is_judged_after_that_end(scratch_db: Callable[[], str]) -> None:
    """A case CI's search found (stop 46): a held run ends its successor `failed`, an operator's rerun waits on
    that row's lock and commits right after it, before the invariant reads the database. The model must know of the
    end from the end's own commit, or it calls the rerun admitted while the successor was not final."""
    state = type("Guard", (SuccessorGuardMachine,), {"url": scratch_db()})()
    opts = {
        "max_failures": None,
        "deadline": None,
        "child_timeout": False,
        "on_lost": "fail",
        "on_expire": False,
        "on_failure": False,
        "expires": False,
    }
    STATS.clear()
    try:
        state.seed(opts=opts, n=1, start="carried")
        state.end_run(hold=True, how="failed", pick=0, stale=False, which=0)
        state.operator_rerun(hold=False, pick=0, which=0)
        state.release(commit=True, which=0)
        state.protocol_holds()
        assert STATS["reruns"] == 1, "the rerun went ahead once the run's end committed"
    finally:
        state.teardown()
