"""The per-record interval join's buffers: what one key holds of one side.

Why this shape (issue #43). The join used to keep each key's side as one value,
``{timestamp: [records]}``: every checkpoint encoded every buffered record again,
the first read of a key after a checkpoint deep-copied its whole buffer (the
snapshot might still be reading it), and each cleanup timer rebuilt the buffer, so
a hot key holding thousands of records cost a rebuild of thousands per timer.

Now a side of a key is a ``SideBuffer``:

- ``times`` / ``records``: every live entry, in time order (arrival order among
  equal times), which a probe reads by bisection and a cleanup trims by dropping a
  prefix: one cleanup per key per watermark advance, in proportion to what expired;
- the entries no checkpoint has written yet: all of them while the key has no
  segment (most keys: their records expire before a checkpoint comes, or a
  checkpoint writes them once and they expire before the next), else
  ``new_times`` / ``new_records`` (also in time order). A checkpoint encodes them
  once, as one *segment* (one encoding call for all of a key's new entries) and
  adds that to the key's list state of segments in the keyed backend (a typed
  ``binary`` list: the backends write it as one Arrow column, never a Python call
  per element; the incremental backend writes only the keys that changed). A
  record is encoded at most once, and never if it expires before the next
  checkpoint;
- ``segments`` / ``segment_ends``: the bytes of the key's segments (the objects the
  backend stores, not copies) and each one's latest time, so a cleanup drops a
  segment once all of its entries expired, without decoding it.

The backend's list state is what a checkpoint and a restore see; the decoded
entries are the operator's view of it. A segment can hold entries that already
expired (until its last one does): ``load`` leaves them out, by the watermark.
Entries are never changed in place, so a read copies nothing.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["SideBuffer", "merged"]


class SideBuffer:
    """One side of one key: its live entries, those no checkpoint wrote yet, and
    the encoded segments the backend holds (see the module docstring)."""

    __slots__ = ("new_records", "new_times", "records", "segment_ends", "segments", "timer", "times")

    def __init__(self) -> None:
        self.times: List[int] = []
        self.records: List[Any] = []
        # Made only once the key has a segment: until then every live entry is new, and
        # a join over many keys makes two containers per key and side fewer, which the
        # cyclic collector would otherwise walk again and again while the state grows.
        self.new_times: Optional[List[int]] = None
        self.new_records: Optional[List[Any]] = None  # a list whenever new_times is
        self.segments: Sequence[bytes] = ()
        self.segment_ends: Sequence[int] = ()
        self.timer: Any = None  # the cleanup timer registered for this side (None: none known)

    def add(self, ts: int, record: Any) -> None:
        """A new entry (not written by any checkpoint yet)."""
        times = self.times
        if not times or ts >= times[-1]:
            times.append(ts)
            self.records.append(record)
        else:
            i = bisect_right(times, ts)
            times.insert(i, ts)
            self.records.insert(i, record)
        if not self.segments:
            return  # every live entry is new
        new = self.new_times
        if new is None:
            self.new_times = [ts]
            self.new_records = [record]
            return
        new_records = self.new_records
        assert new_records is not None
        if not new or ts >= new[-1]:
            new.append(ts)
            new_records.append(record)
        else:
            i = bisect_right(new, ts)
            new.insert(i, ts)
            new_records.insert(i, record)

    def unwritten(self) -> bool:
        """Whether some live entry is in no segment."""
        return bool(self.new_times if self.segments else self.times)

    def expire(self, last: int) -> bool:
        """Drops the entries at or before ``last``; True when a segment went (the
        key's list state must be written again)."""
        times = self.times
        if times and times[0] <= last:
            n = bisect_right(times, last)
            del times[:n]
            del self.records[:n]
        ends = self.segment_ends
        if not ends:
            return False
        new = self.new_times
        if new and new[0] <= last:
            n = bisect_right(new, last)
            del new[:n]
            del self.new_records[:n]  # type: ignore[union-attr]  # a list whenever new_times is
        if min(ends) > last:
            return False
        if max(ends) <= last:  # every written entry went: the live ones are the new ones
            self.segments = self.segment_ends = ()
            self.new_times = self.new_records = None
            return True
        kept = [i for i, end in enumerate(ends) if end > last]
        self.segments = [self.segments[i] for i in kept]
        self.segment_ends = [ends[i] for i in kept]
        return True

    def seal(self, dumps: Callable[[Any], bytes]) -> bytes:
        """The entries no checkpoint wrote yet as one segment, now part of the
        segments; the caller adds it to the key's list state."""
        if self.segments:
            assert self.new_times
            segment = dumps([self.new_times, self.new_records])
            self.segments = [*self.segments, segment]
            self.segment_ends = [*self.segment_ends, self.new_times[-1]]
        else:
            assert self.times
            segment = dumps([self.times, self.records])
            self.segments, self.segment_ends = (segment,), (self.times[-1],)
        self.new_times = self.new_records = None
        return segment

    def load(self, segments: List[bytes], loads: Callable[[bytes], Any], last_expired: int) -> None:
        """The entries of restored segments (a side with none yet), those after
        ``last_expired`` (earlier ones had been cleaned up, or would have been by now)."""
        assert not self.segments and not self.times
        times: List[int] = []
        records: List[Any] = []
        ends: List[int] = []
        for segment in segments:
            seg_times, seg_records = loads(segment)
            ends.append(seg_times[-1] if seg_times else last_expired)
            times.extend(seg_times)
            records.extend(seg_records)
        keep = [i for i, t in enumerate(times) if t > last_expired]
        self.times, self.records = merged([times[i] for i in keep], [records[i] for i in keep])
        self.segments, self.segment_ends = list(segments), ends


def merged(times: List[int], records: List[Any]) -> Any:
    """``times`` and ``records`` sorted by time, stable."""
    order = sorted(range(len(times)), key=times.__getitem__)
    return [times[i] for i in order], [records[i] for i in order]
