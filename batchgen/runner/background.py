"""The job's reading and writing, off the engine's thread: each a thread of its own behind a
bounded queue, so the engine steps while the next window is tokenized and a part is written,
and neither runs further ahead than its queue.

`Prefetch` iterates a producer (the prepared windows) on its thread; `SerialWorker` runs
submitted tasks (part and timeline writes) one at a time, in order, on its thread. Either's
error is raised on the engine's thread, as the same exception (type and message unchanged):
where the consumer takes the failed item, or at the next submit or the close. Leaving a
Prefetch's block and closing a SerialWorker end their threads, however the job ends
(normally, on an error, on a signal); the threads are daemons only so that a process ended by
a deadline (deadline.py) is not held up by one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_S = 0.1  # how often a producer waiting for room looks for a stop


class _End:
    """The producer's last item: it ran out, or failed with `error`."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class Prefetch(Generic[T]):
    """Iterate `items` on a thread, at most `depth` items ahead of the consumer: made and
    waiting, or being made (with depth 1, the next item is made while the consumer works on
    this one). Items come out in order, once; iterate it once."""

    def __init__(self, items: Iterable[T], depth: int, name: str) -> None:
        self._items = items
        self._room = threading.Semaphore(depth)  # taken by the producer before each item
        self._queue: queue.Queue[T | _End] = queue.Queue()  # bounded by _room
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)

    def __enter__(self) -> Prefetch[T]:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[T]:
        while True:
            item = self._queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error  # the producer's exception, on the consumer's thread
                return
            self._room.release()  # the producer may make the next one
            yield item

    def close(self) -> None:
        """Stop the producer (after the item it is making) and wait for its thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _produce(self) -> None:
        it = iter(self._items)
        try:
            while self._wait_for_room():
                try:
                    item = next(it)
                except StopIteration:
                    self._queue.put(_End())
                    return
                self._queue.put(item)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, raised there)
            self._queue.put(_End(e))
        finally:
            close = getattr(it, "close", None)  # a generator's own cleanup, on its own thread
            if close is not None:
                close()

    def _wait_for_room(self) -> bool:
        """Wait until the consumer is fewer than depth items behind; False once closed."""
        while not self._stop.is_set():
            if self._room.acquire(timeout=_POLL_S):
                return True
        return False


_STOP = object()


class SerialWorker:
    """Run submitted tasks one at a time, in submission order, on a thread; `submit` waits
    while `depth` tasks wait already. After a task fails the rest are dropped and the error is
    raised by the next submit or the close (once)."""

    def __init__(self, depth: int, name: str) -> None:
        self._queue: queue.Queue[Callable[[], None] | object] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._raised = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._check()
        self._queue.put(task)

    def close(self) -> None:
        """Run what was submitted, end the thread, raise a task's error."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._check()

    def _check(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def _work(self) -> None:
        while (task := self._queue.get()) is not _STOP:
            if self._error is not None:
                continue  # a task failed: the rest are dropped
            try:
                task()  # type: ignore[operator]
            except BaseException as e:  # noqa: BLE001 (raised on the submitting thread)
                self._error = e
