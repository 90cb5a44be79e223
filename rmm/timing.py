"""The wall time of a stream's passes, without a wait for the device per pass.

Each pass's time is shared equally among the streams it ran (its rows). On a CPU the time is read with
``time.perf_counter`` as the pass ends. On a CUDA device reading it then would mean waiting for every
kernel queued so far (``torch.cuda.synchronize``) once per pass, which stops the host from queueing the
next pass while the device still runs this one. There a pass is instead bracketed by two timing events on
the device's current stream, and a stream's total is read only when it is asked for (once, at the
stream's end): the wait is then one per stream, for its last pass's end.

An event's time is when the device reaches it: a pass counts from when the device reached its start
(after the passes queued before it, or when the host recorded it if the device was idle) to when it
reached its end (after the pass's last kernel, or when the host recorded it, whichever is later). So, as
on a CPU, what the host does between passes while the device has nothing queued is not counted.
"""

from __future__ import annotations

import time

import torch


class StreamTime:
    """One stream's share of the passes it ran, in seconds (:attr:`seconds` waits for pending passes)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []  # (start, end, rows)

    def add(self, seconds: float) -> None:
        self._seconds += seconds

    def add_pending(self, start: torch.cuda.Event, end: torch.cuda.Event, rows: int) -> None:
        """A pass timed on the device, ``rows`` streams sharing it: read when :attr:`seconds` is."""
        self._pending.append((start, end, rows))

    @property
    def seconds(self) -> float:
        if self._pending:
            self._pending[-1][1].synchronize()  # the stream's passes ran in order: all have ended
            self._seconds += sum(start.elapsed_time(end) / 1e3 / rows for start, end, rows in self._pending)
            self._pending.clear()
        return self._seconds


class PassClock:
    """Times passes on ``device`` and charges each pass's rows (:class:`StreamTime`) an equal share."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type == "cuda"

    def start(self) -> float | torch.cuda.Event:
        """Marks a pass's start."""
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, start: float | torch.cuda.Event, rows: list[StreamTime]) -> None:
        """Ends the pass begun at ``start`` and charges ``rows`` a share each."""
        if not self.events:
            share = (time.perf_counter() - start) / len(rows)
            for row in rows:
                row.add(share)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        for row in rows:
            row.add_pending(start, end, len(rows))
