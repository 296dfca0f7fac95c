"""Micro-batching: concurrent requests' inference work is gathered into one batch (bounded wait,
bounded queue) and run on the single inference thread, so the event loop never blocks and the
model sees larger, length-sorted batches (the technique of TEI and Triton's dynamic batcher)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

RunBatch = Callable[[Sequence[Any]], tuple[list[Any], dict[str, float]]]
"""items -> (one result per item, seconds spent per stage for the whole batch)."""


class Overloaded(Exception):
    """The stage's queue is full: the caller should answer 503 and let the client retry."""


class DeadlineExceeded(Exception):
    """The request's deadline passed while it waited: it is dropped before inference (504)."""


@dataclass
class Done:
    """One item's result plus where its time went."""

    result: Any
    queue_s: float
    stages: dict[str, float]
    batch_items: int


@dataclass
class _Job:
    item: Any
    size: int
    enqueued: float
    future: asyncio.Future = field(repr=False)


class MicroBatcher:
    """Gathers submitted items until ``max_size`` (summed item sizes) or ``max_wait_s`` after the first,
    then runs them together on ``executor``. ``max_queue`` jobs may wait; more raise :class:`Overloaded`."""

    def __init__(
        self,
        name: str,
        run: RunBatch,
        executor: Executor,
        max_size: int,
        max_wait_s: float,
        max_queue: int,
    ) -> None:
        self.name, self.run, self.executor = name, run, executor
        self.max_size, self.max_wait_s = max_size, max_wait_s
        self.queue: asyncio.Queue[_Job] = asyncio.Queue(max_queue)
        self.worker: asyncio.Task | None = None
        self.taken: list[_Job] = []  # jobs the worker has taken off the queue and not yet answered
        self.stopped = False

    def start(self) -> None:
        self.worker = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def stop(self) -> None:
        """Stop the worker. Every job it has not answered, and every later submit, gets
        :class:`Overloaded` (503, retry): no caller waits forever on a stopped batcher."""
        if self.worker is not None:
            self.worker.cancel()
            await asyncio.gather(self.worker, return_exceptions=True)
            self.worker = None
        self.stopped = True
        pending = self.taken + [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        for job in pending:
            if not job.future.done():
                job.future.set_exception(Overloaded(f"{self.name} stopped before this request ran; retry"))
        self.taken = []

    async def submit(self, item: Any, size: int = 1, deadline: float | None = None) -> Done:
        """Queue ``item`` and wait for its result. A job still waiting at ``deadline`` (a
        ``time.perf_counter()`` value) is dropped before inference with :class:`DeadlineExceeded`."""
        if self.stopped:
            raise Overloaded(f"{self.name} has stopped (the bundle was replaced or the server is stopping)")
        future = asyncio.get_running_loop().create_future()
        enqueued = time.perf_counter()
        try:
            self.queue.put_nowait(_Job(item, size, enqueued, future))
        except asyncio.QueueFull:
            raise Overloaded(f"{self.name} queue is full ({self.queue.maxsize} waiting)") from None
        if deadline is None:
            return await future
        try:  # answer at the deadline; the timeout cancels the future, so the worker skips the job
            return await asyncio.wait_for(future, max(0.0, deadline - enqueued))
        except asyncio.TimeoutError:
            waited = time.perf_counter() - enqueued
            raise DeadlineExceeded(f"no result within the deadline ({waited:.3f} s queued)") from None

    async def _gather(self) -> list[_Job]:
        jobs = self.taken = [await self.queue.get()]
        size = jobs[0].size
        deadline = time.perf_counter() + self.max_wait_s
        while size < self.max_size:
            if self.queue.empty():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            else:
                job = self.queue.get_nowait()
            jobs.append(job)
            size += job.size
        return [j for j in jobs if not j.future.done()]  # drop requests that expired or went away

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._gather()
            if not jobs:
                continue
            started = time.perf_counter()
            try:
                results, stages = await loop.run_in_executor(self.executor, self.run, [j.item for j in jobs])
            except Exception as exc:  # handed to every waiting request; the loop carries on
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            for job, result in zip(jobs, results, strict=True):
                if not job.future.done():
                    job.future.set_result(Done(result, started - job.enqueued, stages, len(jobs)))
            self.taken = []
