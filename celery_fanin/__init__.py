"""celery-fanin: a fan-in for Celery that runs its successor exactly once, whatever its children end in."""

from .exceptions import (
    BatchClosed,
    BatchNotFinished,
    BatchNotFound,
    BatchNotOpen,
    ChordHeaderFailed,
    FanInDatabaseError,
    FanInDepthExceeded,
    FanInError,
    FanInNotConfigured,
    InvalidArguments,
    InvalidFanIn,
)
from .extension import FanIn
from .outcome import BatchOutcome, ChildResult
from .producer.chord import FanInChord, chord
from .producer.group import FanInGroup, fan_in_group
from .producer.result import BatchStatus, FanInResult
from .producer.schedule import fan_in_schedule
from .protocol import (
    BatchState,
    ChildState,
    CompensationState,
    OnDeadline,
    OnLost,
    OutcomePayload,
    SagaState,
    SagaStepState,
    SuccessorKind,
    SuccessorState,
)
from .sagas import SagaResult, SagaStatus, compensated, manual, saga

__all__ = [
    "BatchClosed",
    "BatchNotFinished",
    "BatchNotFound",
    "BatchNotOpen",
    "BatchOutcome",
    "BatchState",
    "BatchStatus",
    "ChildResult",
    "ChildState",
    "ChordHeaderFailed",
    "CompensationState",
    "FanIn",
    "FanInDatabaseError",
    "FanInDepthExceeded",
    "FanInChord",
    "FanInError",
    "FanInGroup",
    "FanInNotConfigured",
    "FanInResult",
    "InvalidArguments",
    "InvalidFanIn",
    "OnDeadline",
    "OnLost",
    "OutcomePayload",
    "SagaResult",
    "SagaState",
    "SagaStatus",
    "SagaStepState",
    "SuccessorKind",
    "SuccessorState",
    "chord",
    "compensated",
    "fan_in_group",
    "fan_in_schedule",
    "manual",
    "saga",
]

__version__ = "0.1.0"
