"""The stateless per-record operators: map, filter, flat_map, map_batches, and the
timestamp/watermark assigner. Each keeps no keyed state; the assigner keeps only
its watermark generator."""

from __future__ import annotations

from typing import Any, Callable, List

import pyarrow as pa

from ..errors import NonRetryableError, not_records, refuse_non_records
from ..io.events import MAX_WATERMARK, MIN_WATERMARK, WATERMARK_ACTIVE, WATERMARK_IDLE, Watermark
from .base import Operator, UserFunctionError, _mono_ms, batch_of, rows_of


class MapOperator(Operator):
    def __init__(self, uid: str, name: str, fn: Callable[[Any], Any]) -> None:
        super().__init__(uid, name)
        self.fn = fn

    def process(self, records: List[Any]) -> List[Any]:
        fn, records = self.fn, rows_of(records)
        try:
            return [fn(r) for r in records]
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc


class FilterOperator(MapOperator):
    def process(self, records: List[Any]) -> List[Any]:
        fn, records = self.fn, rows_of(records)
        try:
            return [r for r in records if fn(r)]
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc


class FlatMapOperator(MapOperator):
    def process(self, records: List[Any]) -> List[Any]:
        fn, records = self.fn, rows_of(records)
        out: List[Any] = []
        try:
            for r in records:
                produced = fn(r)
                if produced.__class__ is dict or produced.__class__ is str:
                    raise not_records(produced, self.where(), "the flat_map function")
                try:
                    out.extend(produced)
                except TypeError:
                    refuse_non_records(produced, self.where(), "the flat_map function")
                    raise
        except NonRetryableError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc
        return out


class MapBatchesOperator(MapOperator):
    """``fn(pyarrow.RecordBatch) -> RecordBatch``: records that are dicts become a
    batch (columns by key); a RecordBatch buffer passes as it is, and the result
    goes on as a batch (operators that need rows convert it when they get it)."""

    def process(self, records: Any) -> Any:
        if not len(records):
            return []
        batch = self._call(batch_of, records)
        result = self._call(self.fn, batch)
        if isinstance(result, pa.Table):
            batches = result.combine_chunks().to_batches()
            return batches[0] if batches else []
        if not isinstance(result, pa.RecordBatch):
            raise UserFunctionError(f"{self.where()}: map_batches must return a RecordBatch, got {type(result)}")
        return result


class TimestampsAndWatermarksOperator(Operator):
    """``assign_timestamps_and_watermarks(strategy)``: reads each buffer's event times
    (vectorised on Arrow batches), keeps the strategy's generator up to date, and
    replaces the watermarks from upstream with its own, polled periodically by the
    task. Only the maximum watermark (end of input) from upstream goes through.
    Records pass unchanged."""

    generates_watermarks = True

    def __init__(self, uid: str, name: str, strategy: Any) -> None:
        super().__init__(uid, name)
        self.strategy = strategy
        self.timestamps = strategy.require_timestamps("assign_timestamps_and_watermarks")
        self._generator: Any = None
        self._sent = MIN_WATERMARK
        self._idle = False

    def open(self) -> None:
        self._generator = self.strategy.create_generator(_mono_ms())

    def process(self, records: Any) -> Any:
        if len(records):
            try:
                ts = self.timestamps.of_buffer(records)
            except NonRetryableError as exc:
                raise type(exc)(f"{self.where()}: {exc}") from None
            self._generator.on_timestamps(ts, _mono_ms())
        return records

    def poll_watermark(self, now_mono_ms: int) -> List[Any]:
        generator = self._generator
        if generator is None:
            return []
        if generator.check_idle(now_mono_ms):
            if self._idle:
                return []
            self._idle = True
            return [WATERMARK_IDLE]
        out: List[Any] = []
        if self._idle:
            self._idle = False
            out.append(WATERMARK_ACTIVE)
        watermark = generator.current
        if watermark > self._sent:
            self._sent = watermark
            out.append(Watermark(watermark))
        return out

    def process_watermark(self, watermark: int) -> List[Any]:
        if watermark == MAX_WATERMARK:
            self._sent = MAX_WATERMARK
        return super().process_watermark(watermark)
