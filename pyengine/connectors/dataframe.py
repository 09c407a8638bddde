"""A Spark DataFrame as a replayable source.

A restore must replay exactly the rows a checkpoint had not yet covered, so the
source reads files by position: the DataFrame's own parquet files when it is a
plain scan of them (read in place, nothing copied), else a parquet copy written
when the job starts, in the job's checkpoint directory (``_sources/``). A run that
resumes the job (``execute(resume="auto")``) reads the same copy, so positions
keep their meaning; the copy is deleted when the job finishes."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import pyarrow as pa

from ..storage.filesystem import resolve
from .base import Source
from .files import FileSource

__all__ = ["DataFrameSource"]

log = logging.getLogger(__name__)


class DataFrameSource(Source):
    """Rows of a (batch) Spark DataFrame, as Arrow batches; see the module docstring."""

    def __init__(self, df: Any, name: str, path: Optional[str] = None) -> None:
        # By type, not hasattr: a streaming DataFrame's ``write`` raises rather than
        # being missing.
        if not type(df).__module__.startswith("pyspark.") or type(df).__name__ != "DataFrame":
            raise TypeError(f"from_dataframe takes a Spark DataFrame, got {type(df).__name__}")
        if df.isStreaming:
            raise TypeError(
                "from_dataframe takes a batch DataFrame; this one is streaming (spark.readStream): "
                "read the same input as a batch (spark.read...), or feed a running job from "
                "Structured Streaming's foreachBatch"
            )
        self._df: Any = df
        self.name = name
        self.path = path  # where to copy to; by default the job directory's _sources/
        self.copied: Optional[str] = None  # the copy this source made, deleted when the job finishes
        self._files: Optional[FileSource] = None
        self.schema: Optional[pa.Schema] = _arrow_schema(df)

    def __getstate__(self) -> Dict[str, Any]:  # to Spark executors: the files, not the DataFrame
        state = self.__dict__.copy()
        state["_df"] = None
        return state

    def prepare(self, job_dir: str) -> None:
        """On the driver, when a run starts: find the files to read (see the module docstring)."""
        if self._files is not None:
            return
        files = _scanned_parquet_files(self._df)
        if files:
            candidate = FileSource(files, "parquet")
            if candidate.schema.names == list(self._df.columns):
                self._files = candidate
                return
        target = self.path or f"{job_dir.rstrip('/')}/_sources/{self.name}"
        if target.startswith("memory://"):  # Spark cannot write there: a local directory instead
            import tempfile

            target = f"{tempfile.mkdtemp(prefix='pyengine-sources-')}/{self.name}"
        fs, root, _ = resolve(target)
        if fs.get_file_info(f"{root}/_SUCCESS").type.name != "File":
            log.info("copying DataFrame %r to %s so that a restore can replay it", self.name, target)
            self._df.write.mode("overwrite").parquet(target)
        else:
            log.info("reading DataFrame %r from the copy a run of this job made: %s", self.name, target)
        self.copied = target
        self._files = FileSource(target, "parquet")

    def cleanup(self) -> None:
        """Deletes the copy once no checkpoint needs it (the job finished)."""
        if self.copied is not None:
            fs, root, _ = resolve(self.copied)
            try:
                fs.delete_dir(root)
            except OSError as exc:
                log.warning("could not delete the DataFrame copy %s: %s", self.copied, exc)

    def restore_split_state(self, subtask: int, parallelism: int, state: Any) -> None:
        """An attempt starts: the files' source opens them again (``FileSource``)."""
        if self._files is not None:
            self._files.restore_split_state(subtask, parallelism, state)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if self._files is None:
            raise RuntimeError(f"DataFrame source {self.name!r} was not prepared: run it with env.execute()")
        return self._files.read(subtask, parallelism, position, n)


def _scanned_parquet_files(df: Any) -> Optional[List[str]]:
    """The parquet files of a DataFrame that is only a scan of them (no filter,
    projection or join), else None. Spark Connect DataFrames have no plan to look at:
    None (they are copied)."""
    try:
        plan = df._jdf.queryExecution().optimizedPlan().toString().strip()
    except Exception:
        return None
    if "\n" in plan or not plan.startswith("Relation") or not plan.rstrip().endswith("parquet"):
        return None
    try:
        files = [str(f) for f in df.inputFiles()]
    except Exception:
        return None
    # Local files only: Spark's names for remote stores (s3a://, abfss://) are not
    # pyarrow's, so those DataFrames are copied.
    from urllib.parse import unquote, urlparse

    if not files or not all(f.startswith("file:") for f in files):
        return None
    return sorted(unquote(urlparse(f).path) for f in files)


def _arrow_schema(df: Any) -> Optional[pa.Schema]:
    """The DataFrame's schema in Arrow terms, for checking columns when the job is built."""
    try:
        from .tws_schema import spark_arrow_schema

        return spark_arrow_schema(df.schema)
    except Exception:
        return None
