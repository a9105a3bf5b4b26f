"""Sagas: steps that run one after another on the fan-in machinery, and compensations when one fails for good."""

from ..exceptions import InvalidSaga, SagaNotFound, SagaStateError
from .builder import Compensated, Manual, Saga, compensated, manual, saga
from .status import CompensationStatus, SagaResult, SagaStatus, StepStatus

__all__ = [
    "CompensationStatus",
    "Compensated",
    "InvalidSaga",
    "Manual",
    "Saga",
    "SagaNotFound",
    "SagaResult",
    "SagaStateError",
    "SagaStatus",
    "StepStatus",
    "compensated",
    "manual",
    "saga",
]
