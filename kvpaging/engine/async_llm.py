"""``AsyncLLM``: the engine behind an asyncio front, for online serving (vLLM's name).

``LLM.generate`` owns the engine loop: it adds a batch, steps until the batch is
done, and returns. A server cannot work that way: requests arrive one by one,
at any time, from many connections, and each wants its tokens as soon as they
are made. So the engine gets a loop of its own::

    event loop (the server)                    engine thread (one, owns the LLMEngine)
    -----------------------                    ---------------------------------------
    await llm.add_request(id, prompt, params)  --("add", ...)-->    engine.add_request
                                               <--accepted/refused--
    async for out in stream:                   while requests are in flight:
        ...                                        engine.step()  -> outputs
                                               <--RequestOutput--  (to each request's stream)
    (client gone: stream.abort())              --("abort", id)-->  engine.abort_request: blocks freed

Only the engine thread touches the engine; everyone else sends it commands on a
queue, which it reads between steps (so an abort takes effect at most one step
later). The engine's step runs off the event loop, so a slow forward pass never
stalls the server's other connections. Outputs are ``RequestOutputKind.CUMULATIVE``
(kvpaging has no DELTA): each one holds everything generated so far, so a
consumer that falls behind simply takes the newest and skips the rest; the
server turns them into deltas for its streams.

    llm = AsyncLLM(LLM("smollm2").engine)
    async for out in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
        print(out.outputs[0].text)
    llm.shutdown()

Where vLLM's AsyncLLM runs the engine core in another process, this one runs it
in a thread of the same process: simpler to read, and a notebook can attach the
dashboard to the very engine that serves (``Dashboard().attach(async_llm)``).

One thing a thread costs that a process would not: torch's OpenMP runtime (libgomp) keeps a team of
worker threads for every thread that has run a parallel operator, and once the process holds more of
them than it has cores, every team waits for work by sleeping instead of spinning. A model built on
the main thread and stepped on the engine thread makes two teams; on a 2-core VM at two torch
threads a bfloat16 SmolLM2 decode step of one sequence then takes 42 ms instead of 30
(``benchmarks/engine_thread.py``).
So ``kvpaging serve`` gives ``AsyncLLM`` a function that loads the model, and the engine thread
calls it: the thread that builds the model is the one that steps it, and the process keeps one team.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from kvpaging.engine.llm_engine import LLMEngine
from kvpaging.engine.outputs import RequestOutput
from kvpaging.engine.step_record import StepRecord
from kvpaging.sampling_params import SamplingParams

logger = logging.getLogger("kvpaging")

__all__ = ["AsyncLLM", "RequestStream", "EngineDeadError", "EngineGenerateError", "StatLogger"]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it was shut down, or a step raised outside any one request):
    no request can be served any more. vLLM's name."""


class EngineGenerateError(RuntimeError):
    """One request failed inside the model's forward pass; the engine lives on. ``output`` is the
    request's last output (``finish_reason="error"``). vLLM's name."""

    def __init__(self, message: str, output: RequestOutput | None = None) -> None:
        super().__init__(message)
        self.output = output


class StatLogger(Protocol):
    """What the engine thread reports to, for metrics. Every method runs on the engine thread."""

    def on_step(self, record: StepRecord) -> None: ...  # an engine observer: after every step

    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...  # every step's outputs

    def on_abort(self, request_id: str) -> None: ...  # a request aborted before it finished

    def on_idle(self) -> None: ...  # the engine has no request left (nothing runs, nothing waits)


_ACCEPTED = object()  # put on a stream once the engine has queued its request


class RequestStream:
    """The outputs of one request, as the engine thread makes them.

    Iterate it (``async for out in stream``) to get each new ``RequestOutput`` until the
    finished one; a consumer that stops early (an exception, a cancelled task, a
    ``break`` followed by ``aclose``) aborts the request. ``abort()`` does so directly.
    """

    def __init__(self, request_id: str, llm: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._llm = llm
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    # -- engine thread side ------------------------------------------------------------------
    def put(self, item) -> None:
        """Hand ``item`` (an output, an exception or the acceptance marker) to the consumer's loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            pass

    # -- consumer side -----------------------------------------------------------------------
    async def _next_item(self):
        item = await self._queue.get()
        # Outputs are cumulative: when several are waiting, the newest says everything the others say.
        while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._queue.get_nowait()
        return item

    async def get(self) -> RequestOutput:
        """The newest output (waiting for one if none is new). Raises what the engine raised for it."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} has already finished")
        item = await self._next_item()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error is not None:
                raise EngineGenerateError(f"request {self.request_id!r} failed in the model's forward pass: "
                                          f"{type(item.error).__name__}: {item.error}", item) from item.error
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it has finished (safe to call any number of times, from the event loop)."""
        if not self.finished:
            self.finished = True
            self._llm._send(("abort", self.request_id, self))


class AsyncLLM:
    """Serve an ``LLMEngine`` to asyncio callers, with one engine thread stepping it.

    From then on the engine belongs to that thread: go through this object (``generate``,
    ``add_request``, ``abort``, or ``call(fn)`` to run ``fn(engine)`` between two steps), never
    ``LLM.generate`` or ``engine.step`` on the same engine from another thread: the engine refuses
    those with a ``RuntimeError`` (``LLMEngine.owner_thread``) until ``shutdown()``. Observers may be
    attached (``Dashboard().attach(async_llm)``): they only receive step records.
    ``stat_logger`` (optional) hears about every step and output, on the engine thread.
    """

    def __init__(self, engine, *, stat_logger: StatLogger | None = None) -> None:
        """``engine``: an idle ``LLMEngine`` or ``LLM``, or a function of no arguments that makes one, which the
        engine thread calls before its loop (the constructor waits, and raises what it raised). Give the function
        when torch runs more than one thread: the thread that builds a model is the one whose OpenMP team stays,
        and a second thread stepping the engine starts a second team, which makes OpenMP spin less on a machine
        with no spare core (the module docstring's measurement)."""
        self.stat_logger = stat_logger
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # the engine thread's alone
        self._lock = threading.Lock()  # orders "is it dead?" + "send" against "die" + "drain"
        self._dead: BaseException | None = None
        build = engine if callable(engine) else None
        self._thread = threading.Thread(target=self._run, args=(build,), name="kvpaging-engine", daemon=True)
        if build is None:
            self._adopt(engine)
            self._thread.start()
            return
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread.start()
        error = self._built.exception()
        if error is not None:
            self._thread.join()
            raise error

    def _adopt(self, engine) -> None:
        """Take ``engine`` for the engine thread: from now on only that thread may queue, abort or step."""
        self.engine = getattr(engine, "engine", engine)  # an LLM holds its LLMEngine as .engine
        if not isinstance(self.engine, LLMEngine):
            raise TypeError(f"AsyncLLM serves an LLMEngine (or an LLM), got {type(engine).__name__}")
        if self.engine.owner_thread is not None:
            raise ValueError(f"the engine is already served by the thread {self.engine.owner_thread.name!r}")
        if self.engine.has_unfinished_requests():
            raise ValueError("the engine has unfinished requests: AsyncLLM needs an idle engine to own")
        # The server tokenizes prompts and applies chat templates on its own copy: a Hugging Face fast
        # tokenizer must not be used by two threads at once, and the engine thread decodes with its own.
        tokenizer = self.engine.tokenizer
        self.tokenizer = None if tokenizer is None else copy.deepcopy(tokenizer)
        if self.stat_logger is not None:
            self.engine.add_observer(self.stat_logger.on_step)
        self.engine.owner_thread = self._thread

    # -- the front ----------------------------------------------------------------------------
    @property
    def config(self):
        """The engine's resolved ``EngineConfig`` (frozen: safe to read from any thread)."""
        return self.engine.config

    @property
    def is_running(self) -> bool:
        """True while the engine loop serves requests (False once it died or was shut down)."""
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine loop stopped (None while it runs)."""
        return self._dead

    async def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        The engine's own checks run first (the prompt, its length, ``n``...): a refused request
        raises their ``ValueError`` here, before any output, so a server can still answer 400.
        """
        params = SamplingParams() if params is None else params
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._send(("add", request_id, prompt, params, stream))
        try:
            item = await stream._queue.get()
        except BaseException:  # cancelled while waiting: the request may be queued already
            stream.abort()
            raise
        if isinstance(item, BaseException):
            stream.finished = True
            raise item
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's ``RequestOutput`` each time it advances, until the finished one.

        Cancel the consuming task, or close this generator early, and the request is aborted.
        """
        if request_id is None:
            import uuid

            request_id = f"req-{uuid.uuid4().hex}"
        stream = await self.add_request(request_id, prompt, params)
        try:
            while not stream.finished:
                yield await stream.get()
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        """Abort a request by id (nothing happens if it has finished already)."""
        self._send(("abort", request_id, None))

    def call(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result
        (blocking; from a thread that is not an event loop's). For tests, notebooks, snapshots."""
        return self._call_future(fn).result(timeout)

    async def call_async(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``call`` for a coroutine: awaits the result without blocking the event loop."""
        return await asyncio.wrap_future(self._call_future(fn))

    def _call_future(self, fn) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", fn, future))
        return future

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine loop: unfinished requests are aborted (their streams raise
        ``EngineDeadError``), and the engine thread is joined. Safe to call twice."""
        with self._lock:
            if self._dead is None and self._thread.is_alive():
                self._commands.put(("stop",))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout)
        if self.stat_logger is not None:
            try:
                self.engine.remove_observer(self.stat_logger.on_step)
            except ValueError:
                pass

    def _send(self, command: tuple) -> None:
        with self._lock:
            if self._dead is None:
                self._commands.put(command)
                return
            error = self._dead
        _refuse(command, error)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self, build) -> None:
        if build is not None:
            try:
                self._adopt(build())
            except BaseException as error:  # noqa: BLE001 - the constructor raises it
                self._built.set_exception(error)
                return
            self._built.set_result(None)
        try:
            self._loop()
        finally:
            self.engine.owner_thread = None  # the engine is the caller's again

    def _loop(self) -> None:
        engine = self.engine
        busy = False
        try:
            while True:
                if not engine.has_unfinished_requests():
                    if busy and self.stat_logger is not None:
                        self.stat_logger.on_idle()
                    busy = False
                    commands = [self._commands.get()]  # idle: sleep until something arrives
                else:
                    commands = []
                commands += _drain(self._commands)
                for command in commands:
                    if command[0] == "stop":
                        self._stop()
                        return
                    self._handle(command)
                if engine.has_unfinished_requests():
                    busy = True
                    self._deliver(engine.step())
        except BaseException as error:  # noqa: BLE001 - whatever it was, every waiting caller must hear of it
            logger.exception("the engine loop failed; every request in flight fails with it")
            self._die(EngineDeadError(f"the engine loop failed: {type(error).__name__}: {error}"), cause=error)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, stream = command
            if request_id in self._streams:
                stream.put(ValueError(f"request_id {request_id!r} is already in use by an unfinished request"))
                return
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as error:  # noqa: BLE001 - a refused request: its caller gets the reason
                stream.put(error)
                return
            self._streams[request_id] = stream
            stream.put(_ACCEPTED)
        elif kind == "abort":
            _, request_id, stream = command
            if request_id not in self._streams or (stream is not None and self._streams[request_id] is not stream):
                return  # finished or refused already (a refused duplicate must not abort the request it collided with)
            del self._streams[request_id]
            self._abort(request_id)
        elif kind == "call":
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as error:  # noqa: BLE001 - the caller gets it
                    future.set_exception(error)
        else:  # pragma: no cover - a bug in this file
            raise AssertionError(f"unknown command {command!r}")

    def _abort(self, request_id: str) -> None:
        """Abort a request the engine may already have finished (then there is nothing to abort)."""
        try:
            self.engine.abort_request(request_id)
        except ValueError:
            return
        if self.stat_logger is not None:
            self.stat_logger.on_abort(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.stat_logger is not None and outputs:
            self.stat_logger.on_outputs(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _stop(self) -> None:
        error = EngineDeadError("the engine was shut down")
        logger.info("the engine loop stops; %d request(s) in flight aborted", len(self._streams))
        for request_id in list(self._streams):
            self._abort(request_id)
        if self.stat_logger is not None:
            self.stat_logger.on_idle()
        self._die(error)

    def _die(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        with self._lock:
            self._dead = error
            pending = _drain(self._commands)
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        for command in pending:
            _refuse(command, error)


def _drain(commands: queue.SimpleQueue) -> list:
    """Every command waiting in the queue now, oldest first (without waiting for more)."""
    taken = []
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken


def _refuse(command: tuple, error: BaseException) -> None:
    """Answer a command the dead engine will never run."""
    if command[0] == "add":
        command[4].put(error)
    elif command[0] == "call":
        future = command[2]
        if future.set_running_or_notify_cancel():
            future.set_exception(error)
