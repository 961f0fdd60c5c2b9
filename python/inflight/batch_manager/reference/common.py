"""Helpers the twins share, mirroring ``csrc/batch_manager/common.cpp`` and
``csrc/include/inflight/batch_manager/common.h``.

The C++ header owns the batch manager's enums and retention-priority constants; the twins do not
redefine them but use the bound ones from :mod:`inflight.batch_manager`. What is left here is the
state arithmetic both schedulers need: the enums' integer values (states are ordered, so windows
compare with ``>=``), their names for error messages (``to_string`` in C++) and the half-open state
window ``[until, after)`` with its validation. The helpers accept a bound enum member or a plain
integer. They hold no data.

Semantics: ``docs/batch-manager.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.batch_manager import LlmRequest

__all__ = ["check_window", "in_window", "state_name", "state_value"]


def state_value(state: Any) -> int:
    return int(state.value) if hasattr(state, "value") else int(state)


def state_name(state: Any) -> str:
    return getattr(state, "name", str(state))


def in_window(request: LlmRequest, until_state: Any, after_state: Any) -> bool:
    """State in the half-open window [until_state, after_state)."""
    return request.has_reached_state(until_state) and not request.has_reached_state(after_state)


def check_window(until_state: Any, after_state: Any) -> None:
    if state_value(until_state) >= state_value(after_state):
        raise ValueError(
            f"no_schedule_until_state ({state_name(until_state)}) must be before no_schedule_after_state "
            f"({state_name(after_state)}): the state window is empty"
        )
