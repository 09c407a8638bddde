"""Errors a user of pyengine catches, in one place.

``JobFailedError`` is what ``execute()`` raises when a job fails (as Flink's
``JobExecutionException``); ``NonRetryableError`` marks a failure that no restart
can fix, so runners fail the job at once instead of spending ``restart_attempts``
(Flink's ``SuppressRestartsException``)."""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Optional, Sequence, TypeVar

__all__ = [
    "ColumnNotFoundError",
    "JobFailedError",
    "KeySelectorError",
    "NonRetryableError",
    "OutputInUseError",
    "OutputTypeError",
    "UnhashableKeyError",
]


class NonRetryableError(Exception):
    """A failure that a restart cannot fix (a misspelt column, a record a sink refuses
    by its type, a directory another job writes): the job fails without restarting."""


class ColumnNotFoundError(NonRetryableError, ValueError):
    """A column a step needs is not in the records. Raised when the job is built if
    the stream's schema is known, else at run time: either way no restart can fix
    it, so the job fails at once."""


class UnhashableKeyError(NonRetryableError, TypeError):
    """A key of a type with no stable hash (a list, a dict, an object): keys must hash
    the same in every process and run, and a restart would meet the same key again."""


class KeySelectorError(RuntimeError):
    """``key_by``'s function raised on a record: the message names the step it feeds and
    the record. Retried as a user function's failure is (the function may depend on
    something outside the record); its cause is the function's exception."""


class OutputInUseError(NonRetryableError):
    """A sink's output (or a checkpoint storage) that another run uses or owns; the
    message names that run and the ways out."""


class OutputTypeError(NonRetryableError, TypeError):
    """A function returned one record (a dict) or a string where it returns what it
    emits: emitted as they are, a dict's keys or a string's characters would be the
    records. Yield each record, or return a list of them."""


def not_records(produced: Any, where: str, call: str) -> OutputTypeError:
    """The error for ``produced``, what ``call`` returned (a dict or a str, or
    something that is not iterable at all)."""
    if not hasattr(produced, "__iter__"):
        name = type(produced).__name__
        return OutputTypeError(
            f"{where + ': ' if where else ''}{call} returned {produced!r:.60} ({'an' if name[0] in 'aeiou' else 'a'} "
            f"{name}), which is not records: yield each record (or return a list of them, or nothing)"
        )
    what = "keys" if produced.__class__ is dict else "characters"
    return OutputTypeError(
        f"{where + ': ' if where else ''}{call} returned a {type(produced).__name__}, whose {what} would be "
        f"emitted one by one as records; yield each record (or return a list of them): yield {produced!r:.60}"
    )


def refuse_non_records(produced: Any, where: str, call: str) -> None:
    """Where ``out.extend(produced)`` raised TypeError: ``not_records``'s error if
    ``produced`` is not iterable at all (``return 5``), raised from here; else nothing,
    and the caller re-raises the TypeError (a generator's own). Kept off the per-record
    path: the extend is tried first, and this runs only when it fails."""
    if not hasattr(produced, "__iter__"):
        raise not_records(produced, where, call) from None


class JobFailedError(Exception):
    """``execute()`` of a job that ended FAILED: ``result`` is its ``JobResult``, and the
    user's exception is ``__cause__`` (with its traceback) and ``cause``."""

    def __init__(self, message: str, result: Any = None, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.result = result
        self.cause = cause


def is_non_retryable(exc: Optional[BaseException]) -> bool:
    """True when ``exc`` or anything in its cause/context chain is a ``NonRetryableError``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, NonRetryableError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


T = TypeVar("T")


def unknown_keyword(call: str, keyword: str, known: Sequence[str]) -> TypeError:
    """The error for ``keyword``, which ``call`` does not take: Python's own words, then
    the closest keyword it does take ("did you mean"), else the ones it takes. A typo
    in a setting (``paralellism=2``) otherwise only says what is wrong, not what is right."""
    close = difflib.get_close_matches(keyword, list(known), n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {close[0]!r}?"
    else:
        hint = f"it takes {', '.join(known)}" if known else "it takes no keyword arguments"
    return TypeError(f"{call} got an unexpected keyword argument {keyword!r}; {hint}")


def suggest_keywords(target: T) -> T:
    """Makes an unknown keyword to ``target`` (a class: its own ``__init__``; or a
    function) raise ``unknown_keyword``'s TypeError, with a "did you mean". The
    signature stays as written (``functools.wraps``), so editors and type checkers see
    the real parameters, not ``**kwargs``; a function that takes ``**kwargs`` is left
    alone, as is every call whose keywords are all known (the check is a set lookup
    per keyword, before the call)."""
    if isinstance(target, type):
        init = target.__dict__.get("__init__")
        if init is not None and callable(init):
            type.__setattr__(target, "__init__", _checked(init, target.__qualname__ + "()"))
        return target
    if callable(target):
        qualname = getattr(target, "__qualname__", getattr(target, "__name__", "the call"))
        return _checked(target, qualname + "()")  # type: ignore[return-value]
    raise TypeError(f"suggest_keywords applies to a class or a function, not {target!r}")


def _checked(fn: Callable[..., Any], call: str) -> Callable[..., Any]:
    if getattr(fn, "__pe_keywords_checked__", False):
        return fn
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return fn
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known = tuple(p.name for p in parameters[1:] if p.kind in keywords) if parameters else ()
    if parameters and parameters[0].kind in keywords and parameters[0].name not in ("self", "cls"):
        known = (parameters[0].name, *known)  # a plain function: its first parameter is a keyword too
    accepted = frozenset(known) | {p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY}

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for keyword in kwargs:
            if keyword not in accepted:
                raise unknown_keyword(call, keyword, known)
        return fn(*args, **kwargs)

    checked.__pe_keywords_checked__ = True  # type: ignore[attr-defined]
    return checked
