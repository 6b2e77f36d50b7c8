"""The asyncio core of the link emulator: accept, connect upstream, shape both directions.

Each direction of a connection is a reader and a deliverer joined by a FIFO of
``(deliver_at, bytes)``: the reader books link time on its direction's shared
:class:`TokenBucket`, adds the one-way latency (and a round trip when the loss model hits a
segment), and queues the chunk; the deliverer writes each chunk when its time comes, in order,
so a delayed chunk holds back everything behind it, as TCP's in-order delivery does. The
reader stops reading while the queue holds ``window`` bytes, which backpressures the sender
through the real sockets. Nothing here sleeps on a thread; one event loop serves every
connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque

import numpy as np

from ..errors import ConfigError
from .bucket import TokenBucket
from .config import MSS, LinkConfig, LinkStats

__all__ = ["AsyncLink"]

log = logging.getLogger("rollpatch.netem")


class AsyncLink:
    """A link emulator on the running event loop: ``await start()`` … ``await aclose()``.

    Also an async context manager. :class:`~rollpatch.netem.Link` runs one on its own thread.
    """

    def __init__(self, config: LinkConfig) -> None:
        if not isinstance(config, LinkConfig):
            raise ConfigError("AsyncLink needs a LinkConfig", value=type(config).__name__)
        self.config = config
        rate = config.rate_bytes_per_s
        self._buckets = {
            "up": TokenBucket(rate, config.burst_bytes),
            "down": TokenBucket(rate, config.burst_bytes),
        }
        self._rng = np.random.default_rng(config.seed)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections = self._refused = self._lost = 0
        self._bytes = {"up": 0, "down": 0}
        self._closing = False

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the link listens on (the real port when ``listen`` asked for 0)."""
        if self._server is None or not self._server.sockets:
            raise ConfigError("the link is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    def stats(self) -> LinkStats:
        """Counters since the link started."""
        return LinkStats(
            self._connections,
            len(self._tasks),
            self._refused,
            self._bytes["up"],
            self._bytes["down"],
            self._lost,
        )

    async def start(self) -> None:
        """Listen; :class:`ConfigError` names the address when that is impossible."""
        host, port = self.config.listen
        try:
            self._server = await asyncio.start_server(
                self._handle,
                host,
                port,
                limit=self.config.chunk_bytes,
                backlog=min(self.config.max_connections, 1024),
            )
        except OSError as e:
            raise ConfigError(
                f"the link cannot listen on {host}:{port}: {e.strerror or e}",
                hint="pick a free port, or port 0 for any",
            ) from None

    async def aclose(self) -> None:
        """Stop accepting, close every connection (both sockets), wait until they are gone."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> AsyncLink:  # noqa: PYI034 (typing.Self needs 3.11)
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- internals ---------------------------------------------------------------------------

    def _draw_losses(self, n: int) -> int:
        """Segments of a chunk of ``n`` bytes that the loss model drops."""
        if self.config.loss <= 0:
            return 0
        lost = int(self._rng.binomial(math.ceil(n / MSS), self.config.loss))
        self._lost += lost
        return lost

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        cfg = self.config
        if self._closing or len(self._tasks) >= cfg.max_connections:
            self._refused += 1
            log.debug("refused a connection: %d open (max_connections)", len(self._tasks))
            cwriter.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None  # handlers always run in a task
        self._tasks.add(task)
        uwriter: asyncio.StreamWriter | None = None
        try:
            loop = asyncio.get_running_loop()
            ready_at = loop.time() + (cfg.rtt_s if cfg.handshake else 0.0)
            try:
                ureader, upstream = await asyncio.wait_for(
                    asyncio.open_connection(*cfg.upstream, limit=cfg.chunk_bytes),
                    cfg.connect_timeout_s,
                )
            except (OSError, asyncio.TimeoutError) as e:
                self._refused += 1
                log.warning("upstream %s:%d unreachable: %s", *cfg.upstream, e)
                return
            uwriter = upstream
            self._connections += 1
            up = _Direction(self, creader, upstream, "up", ready_at)
            down = _Direction(self, ureader, cwriter, "down", ready_at)
            await _run_both(up, down)
        except asyncio.CancelledError:
            # aclose() cancels handlers; this task is the connection's top level, and asyncio's
            # stream callback (3.11) logs a cancelled handler as an error, so end it normally.
            pass
        finally:
            cwriter.transport.abort()
            if uwriter is not None:
                uwriter.transport.abort()
            self._tasks.discard(task)


async def _run_both(up: _Direction, down: _Direction) -> None:
    """Until both directions delivered their EOF, or either side broke (then both close)."""
    tasks = {asyncio.ensure_future(up.run()), asyncio.ensure_future(down.run())}
    try:
        pending = tasks
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:  # a reset on one side resets the connection
                    return
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Direction:
    """One direction of one connection (see the module docstring)."""

    def __init__(
        self,
        link: AsyncLink,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        name: str,
        ready_at: float,
    ) -> None:
        self._link, self._reader, self._writer, self._name = link, reader, writer, name
        self._bucket = link._buckets[name]
        cfg = link.config
        self._latency = cfg.latency_ms / 1e3
        self._rto = max(cfg.rtt_s, cfg.min_rto_ms / 1e3)
        self._window, self._chunk = cfg.window, cfg.chunk_bytes
        self._queue: deque[tuple[float, bytes] | None] = deque()
        self._queued = 0
        self._ready = ready_at  # nothing leaves before the handshake is done
        self._last = ready_at  # in-order delivery: never before the previous chunk
        self._space, self._data = asyncio.Event(), asyncio.Event()

    async def run(self) -> None:
        """Pump until EOF is delivered; raises OSError when either socket breaks."""
        reader = asyncio.ensure_future(self._read())
        deliver = asyncio.ensure_future(self._deliver())
        try:
            done, _ = await asyncio.wait({reader, deliver}, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
            await reader
            await deliver
        finally:
            reader.cancel()
            deliver.cancel()
            await asyncio.gather(reader, deliver, return_exceptions=True)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._queued >= self._window:
                self._space.clear()
                await self._space.wait()
            data = await self._reader.read(self._chunk)
            if not data:
                break
            now = loop.time()
            lost = self._link._draw_losses(len(data))
            left = max(self._bucket.reserve(len(data) + lost * MSS, now), self._ready)
            at = max(left + self._latency + (self._rto if lost else 0.0), self._last)
            self._last = at
            self._queue.append((at, data))
            self._queued += len(data)
            self._data.set()
        self._queue.append(None)
        self._data.set()

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._data.clear()
                await self._data.wait()
            item = self._queue.popleft()
            if item is None:
                if self._writer.can_write_eof():
                    self._writer.write_eof()
                return
            at, data = item
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            # counted as they are handed to the socket, not after: write() may send at once,
            # and the peer read them (and read the stats, from another thread) before the
            # next statement runs here
            self._link._bytes[self._name] += len(data)
            self._writer.write(data)
            await self._writer.drain()
            self._queued -= len(data)
            self._space.set()
