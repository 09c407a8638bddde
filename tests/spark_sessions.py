"""A local Spark session for one test module: ``local[slots]``, no UI, the test
environment's interpreter for Python workers, and the module's own code shipped by
value (it is not installed on the executors, as a job defined in a script is not).
Each module gets its own session, with the slots its jobs need (a barrier stage
takes one slot per subtask), stopped at the module's end."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterator, Optional


def local_spark(
    module: str, app: str, slots: int, conf: Optional[Dict[str, str]] = None, by_value: bool = True
) -> Iterator[Any]:
    """Yields the session (for a module-scoped fixture: ``yield from local_spark(...)``)."""
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    if by_value:
        cloudpickle.register_pickle_by_value(sys.modules[module])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(f"local[{slots}]").appName(app).config("spark.ui.enabled", "false")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    yield session
    session.stop()
