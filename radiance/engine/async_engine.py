"""Drives an `LLMEngine` from an asyncio task without ever blocking the event loop.

Engine steps run in one worker thread; requests and aborts are queued and applied by that thread between
steps, so the engine is only ever touched from one thread. Each request gets an OutputSlot its `generate`
iterator reads (the newest output: a slow reader skips to it); abandoning the iterator (client disconnect) aborts
the request. Outputs are routed to the slot of the `generate` call whose request produced them, not by request
id alone: an id can be reused as soon as its request is aborted, while the engine still holds (and steps) the
old one.
A step that raises stops the loop: the engine's requests are aborted and every `generate` call, waiting or
later, raises EngineDeadError. `shutdown()` (the server stopping) stops the loop and joins its threads; a call
still waiting then raises EngineStoppedError.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from radiance.config import EngineConfig
from radiance.engine.llm_engine import LLMEngine
from radiance.engine.outputs import StepOutput
from radiance.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OutputSlot:
    """What a `generate` call has not read yet: the newest output only (each holds all the request's tokens, text
    and logprobs so far, so a reader that fell behind skips to it and loses nothing), or an error, which ends the
    call and is never replaced. A queue of every step's output grew with the square of the output length for a
    client that stayed connected but stopped reading (bench/RESULTS.md, forty-ninth session)."""

    def __init__(self):
        self._item: StepOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put_nowait(self, item: StepOutput | BaseException) -> None:
        if not isinstance(self._item, BaseException):
            self._item = item
            self._ready.set()

    async def get(self) -> StepOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._item = self._item, None
        return item


class EngineDeadError(RuntimeError):
    """An engine step raised: the engine's state is unknown, so every request in flight fails with this and
    later ones are refused (the server answers 500 / 503 and /health turns unhealthy, as vLLM does)."""


class EngineStoppedError(EngineDeadError):
    """The engine was shut down (the server stops): a `generate` call still waiting ends with this, a later one is
    refused with it."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, checkpoint=None, engine: LLMEngine | None = None,
                 progress: bool = True):
        self.engine = engine or LLMEngine(config, checkpoint=checkpoint, progress=progress)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radiance-engine")
        # constraints compile off the event loop and off the stepping thread (a large JSON schema takes 10s of ms)
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radiance-grammar")
        self.engine.warm_grammar_backend()
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._queues: dict[str, OutputSlot] = {}  # the live generate calls
        self._serving: dict[str, OutputSlot] = {}  # engine request id -> its generate call's slot (thread side)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.errored: BaseException | None = None
        self.stopped = False  # shutdown() ran

    # the attributes of the synchronous engine the server reads
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def tokenizer_error(self) -> str | None:
        return self.engine.tokenizer_error

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def chat_template(self):
        return self.engine.chat_template

    @property
    def chat_templates(self):
        return self.engine.chat_templates

    @property
    def sampling_defaults(self):
        return self.engine.sampling_defaults

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def load_summary(self) -> list[str]:
        return self.engine.load_summary

    def stats(self):
        return self.engine.stats()

    # ---------------------------------------------------------------- LoRA adapters

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_enabled

    def list_loras(self) -> list:
        return self.engine.list_loras()

    async def add_lora(self, lora_request) -> bool:
        """Loads an adapter off the event loop (ValueError naming the file / tensor when it cannot be served) and
        registers it; True if newly added, False if its id was already loaded."""
        from radiance.lora import LoRARequest
        manager = self.engine._lora_manager()  # ValueError when LoRA is off
        if isinstance(lora_request, LoRARequest) and manager.has(lora_request.lora_int_id):
            return False
        adapter = await asyncio.get_running_loop().run_in_executor(self._compiler, manager.load, lora_request)
        return manager.add(lora_request, adapter)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter between steps (requests already using it finish with it); False if unknown."""
        manager = self.engine._lora_manager()
        if not manager.has(lora_int_id):
            return False
        if self._task is None or self._task.done():  # no loop stepping: nothing runs beside this
            return self.engine.remove_lora(lora_int_id)
        done = asyncio.get_running_loop().create_future()
        with self._lock:
            self._pending.append(("call", None, done, lambda: self.engine.remove_lora(lora_int_id)))
        self._wakeup.set()
        return await done

    async def _resolve_lora(self, lora_request):
        """generate's adapter: checked (ValueError when LoRA is off, the adapter unknown or unloadable), one that is
        not loaded yet loaded off the event loop."""
        if lora_request is None:
            return None
        if not self.lora_enabled:
            return self.engine.check_lora_request(lora_request)  # raises the engine's message
        from radiance.lora import LoRARequest
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a radiance.LoRARequest, got {type(lora_request).__name__}")
        if not self.engine.lora.has(lora_request.lora_int_id):
            await self.add_lora(lora_request) if lora_request.lora_path else self.engine.check_lora_request(lora_request)
        return lora_request

    async def check_structured_output(self, spec) -> None:
        """ValueError when the constraint cannot be served (compiled on a worker thread, cached for the
        engine's own use)."""
        await asyncio.get_running_loop().run_in_executor(
            self._compiler, lambda: self.engine.grammar_backend().compile(spec))

    # ---------------------------------------------------------------- requests

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                       lora_request=None) -> AsyncIterator[StepOutput]:
        # the request's own copy, taken now: the loop adds it later, and the caller may change its object meanwhile
        params = copy.copy(params) if params is not None else SamplingParams()
        if self.stopped:
            raise EngineStoppedError("the engine was shut down")
        if self.errored is not None:
            raise self._dead_error()
        self.engine.check_one_sequence(params)  # n > 1 is the caller's to expand (the server does)
        self.engine.check_request(prompt_token_ids, params)  # ValueError before anything is queued
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_request = await self._resolve_lora(lora_request)  # ValueError before anything is queued
        if request_id in self._queues:  # taken while the adapter loaded
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_loop()
        queue = OutputSlot()
        self._queues[request_id] = queue
        with self._lock:
            # the adapter only where there is one: the engine's add_request takes it as a 4th argument
            request = (list(prompt_token_ids), params) + ((lora_request,) if lora_request is not None else ())
            self._pending.append(("add", request_id, queue, *request))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished and self._queues.get(request_id) is queue:  # not a later call's with this id
                self.abort(request_id)

    def num_cached_tokens(self, request_id: str) -> int | None:
        """The prefix-cache hits the engine counted when it admitted this live generate call's request, or None
        where it was not admitted (still pending or waiting, or no longer held). The server reads it for a
        request that ends before its first output, which would carry it (request_prefill_kv_computed_tokens).

        Read on the event loop while the engine thread may step, which is safe: dict lookups and attribute reads
        are atomic under the GIL, and the scheduler sets num_cached_tokens once, before `admitted` (read first
        here), so an admitted sequence's count is final. The slot check keeps a reused id's other request out.
        The one stale answer: None while the step then running admits it (its schedule is that short window)."""
        queue = self._queues.get(request_id)
        if queue is None or self._serving.get(request_id) is not queue:  # first: a reused id's sequence is not ours
            return None
        seq = self.engine.sequences.get(request_id)
        if seq is None or not seq.admitted:
            return None
        return seq.num_cached_tokens

    def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is None:
            return
        with self._lock:
            self._pending.append(("abort", request_id, queue))
        if self._wakeup is not None:
            self._wakeup.set()

    # ---------------------------------------------------------------- shutdown

    async def shutdown(self) -> None:
        """Stops the loop, ends the `generate` calls still waiting (outputs of a stopped loop never come: they
        waited forever) and joins the engine's threads, after the step that runs, if any."""
        if self.stopped:
            return
        self.stopped = True
        await self._stop_loop()
        for queue in self._queues.values():
            queue.put_nowait(EngineStoppedError("the engine was shut down"))
        self._queues.clear()
        await asyncio.to_thread(self._join_threads)  # off the loop: a step on a large model takes a while
        logger.info("engine stopped")

    async def _stop_loop(self) -> None:
        task = self._task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            return  # never started, or ended with its loop (nothing runs it any more)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _join_threads(self) -> None:
        self._executor.shutdown(wait=True)
        self._compiler.shutdown(wait=True, cancel_futures=True)

    # ---------------------------------------------------------------- the loop

    def _step_in_thread(self) -> list[tuple[str, OutputSlot, StepOutput | BaseException]]:
        try:
            return self._apply_and_step()
        except Exception:
            self._abort_all_in_thread()
            raise

    def _apply_and_step(self) -> list[tuple[str, OutputSlot, StepOutput | BaseException]]:
        """Applies the queued adds and aborts, runs one step; returns (request id, slot, output or error)."""
        with self._lock:
            pending, self._pending = self._pending, []
        results, aborted = [], set()
        for kind, request_id, queue, *request in pending:
            if kind == "call":  # a function to run between steps; `queue` is the asyncio future of its result
                self._run_between_steps(queue, request[0])
                continue
            if kind == "add":
                try:
                    self.engine.add_request(request_id, *request)
                except Exception as exc:  # this request fails, not the loop that serves the others
                    results.append((request_id, queue, exc))
                    continue
                self._serving[request_id] = queue
            elif self._serving.get(request_id) is queue:  # else it failed to add, or already finished
                del self._serving[request_id]
                self.engine.abort_request(request_id)
                aborted.add(request_id)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            queue = self._serving.get(out.request_id)
            if queue is None or out.finish_reason == "abort" and out.request_id in aborted:
                continue  # its generate call has left; the id may already serve a new call
            if out.finished:
                del self._serving[out.request_id]
            results.append((out.request_id, queue, out))
        return results

    def _run_between_steps(self, future: asyncio.Future, call) -> None:
        loop = future.get_loop()
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the caller's to raise
            error = exc
            loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(error))
            return
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    def _abort_all_in_thread(self) -> None:
        """After a failed step: every request the engine holds is aborted (best effort: its state is suspect),
        so its KV blocks go back and the running / waiting gauges read 0 instead of the requests of a dead loop."""
        for request_id in list(self._serving):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the step's own error is the one to report
                logger.debug("abort of %s after the failed step failed", request_id, exc_info=True)
        self._serving.clear()

    def _dead_error(self) -> EngineDeadError:
        """A fresh error per request: one instance raised in many tasks collects all their tracebacks."""
        error = EngineDeadError(f"the engine stopped after an internal error ({type(self.errored).__name__})")
        error.__cause__ = self.errored
        return error

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                idle = not self._pending
            if idle and not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                results = await loop.run_in_executor(self._executor, self._step_in_thread)
            except Exception as exc:  # a broken step fails every waiting request, loudly (logged once, here)
                logger.exception("engine step failed; the engine is stopped")
                self.errored = exc
                for queue in self._queues.values():
                    queue.put_nowait(self._dead_error())
                self._queues.clear()
                return
            for request_id, queue, item in results:
                if self._queues.get(request_id) is not queue:
                    continue  # aborted while the step ran
                queue.put_nowait(item)
                if isinstance(item, BaseException) or item.finished:
                    del self._queues[request_id]
            await asyncio.sleep(0)
