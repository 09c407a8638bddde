"""The copy of a user's function each subtask runs, and naming what in a function
cannot be copied or pickled.

Every parallel subtask runs its own copy of a job's functions, made when the job
starts (Flink deserializes one per subtask), so what one subtask sets on ``self``
never reaches another's thread. The process runner pickles the job instead; both
refuse a function that holds a lock, an open file or a client by naming the value
and its path from the step (``narrow``), not with the bare error of ``copy`` or
``pickle``."""

from __future__ import annotations

import copy
import os
import types
from typing import Any, Callable, List, Sequence, Tuple

__all__ = ["narrow", "per_subtask"]


def per_subtask(fn: Any, step: str) -> Any:
    """``fn``'s copy for one subtask of step ``step``: a ``TypeError`` naming what
    cannot be copied, and the fix, when it holds something ``copy`` refuses."""
    try:
        return copy.deepcopy(fn)
    except Exception as exc:
        where = narrow(_copies, fn, f"step {step!r}: {type(fn).__name__}")
        raise TypeError(
            f"{where} cannot be copied ({type(exc).__name__}: {exc}); every parallel subtask runs its own copy "
            "of a function, made when the job starts: create locks, open files, sockets and clients in the "
            "function's open(), not in __init__ or in what it captures"
        ) from None


def _copies(value: Any) -> bool:
    try:
        copy.deepcopy(value)
        return True
    except Exception:
        return False


def parts(value: Any) -> Sequence[Tuple[str, Any]]:
    """What ``value`` holds that copying or pickling it copies: a function's captured
    variables and the globals it names, an object's attributes, a container's items."""
    if isinstance(value, types.FunctionType):
        found: List[Tuple[str, Any]] = []
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or (), strict=False):
            try:
                found.append((f"captured variable {name!r} of {describe(value)}", cell.cell_contents))
            except ValueError:
                pass
        for name in value.__code__.co_names:
            if name in value.__globals__ and value.__module__ in ("__main__", None):
                found.append((f"global {name!r} of {describe(value)}", value.__globals__[name]))
        return found
    if isinstance(value, types.MethodType):
        return [(f"the object of {value.__func__.__qualname__}", value.__self__)]
    if isinstance(value, dict):
        return [(f"item {k!r}", v) for k, v in list(value.items())[:100]]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [(f"item {i}", v) for i, v in enumerate(list(value)[:100])]
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return [(f"attribute {k!r} of {type(value).__name__}", v) for k, v in state.items()]
    return []


def describe(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    where = f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(fn, '__qualname__', fn)!s}{where}"


def narrow(works: Callable[[Any], bool], value: Any, path: str, depth: int = 0) -> str:
    """``path`` extended down what ``value`` holds to the smallest part for which
    ``works`` (it copies, it pickles) is false."""
    if depth < 6:
        for name, part in parts(value):
            if part is value or works(part):
                continue
            return narrow(works, part, f"{path} -> {name}", depth + 1)
    return f"{path} -> {type(value).__name__} object"
