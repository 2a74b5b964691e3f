"""AsyncLLM: the engine thread, streams of outputs, aborts, failures and shutdown (kvpaging/engine/async_llm.py)."""

import asyncio
import threading

import pytest

from kvpaging import LLM, AsyncLLM, EngineDeadError, EngineGenerateError, SamplingParams
from kvpaging.models import tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def reference(one_thread):
    llm = LLM(tiny("qwen3"), num_blocks=32, max_model_len=256)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [100, 200, 300, 400, 500]]
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture
def async_llm(one_thread):
    llm = AsyncLLM(LLM(tiny("qwen3"), num_blocks=32, max_model_len=256))
    yield llm
    llm.shutdown()
    assert not llm._thread.is_alive()


def engine_books(llm: AsyncLLM):
    """(unfinished requests, blocks held), read on the engine thread."""
    return llm.call(lambda e: (e.get_num_unfinished_requests(), e.block_manager.stats().num_used_blocks))


def test_concurrent_generate_streams_each_request_to_its_caller(async_llm, reference):
    prompts, expected = reference

    async def one(i):
        outputs = [o async for o in async_llm.generate(prompts[i], GREEDY, f"r{i}")]
        return outputs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    for i, outputs in enumerate(asyncio.run(main())):
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == expected[i]
        # each output is cumulative: token lists only grow
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and lengths[-1] == 12
    assert engine_books(async_llm) == (0, 0)


def test_a_cancelled_consumer_aborts_its_request_and_frees_its_blocks(async_llm):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        got = asyncio.Event()

        async def consume():
            async for out in async_llm.generate([5, 6, 7, 8], long, "long"):
                if len(out.outputs[0].token_ids) >= 3:
                    got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        busy = await async_llm.call_async(lambda e: e.get_num_unfinished_requests())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return busy

    assert asyncio.run(main()) == 1
    assert engine_books(async_llm) == (0, 0)  # the abort is queued before this call: it ran first


def test_a_refused_request_raises_before_any_output_and_the_engine_serves_on(async_llm, reference):
    prompts, expected = reference

    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in async_llm.generate([5, 10**6], GREEDY, "bad"):
                pass
        with pytest.raises(ValueError, match="max_model_len"):
            await async_llm.add_request("too-long", list(range(1, 300)), GREEDY)
        stream = await async_llm.add_request("dup", prompts[0], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            await async_llm.add_request("dup", prompts[0], GREEDY)
        return [o async for o in stream][-1]  # the refused duplicate did not abort the first "dup"

    final = asyncio.run(main())
    assert final.finished and final.outputs[0].token_ids == expected[0]


def test_a_request_failing_in_the_forward_fails_alone(async_llm, reference):
    prompts, expected = reference
    runner = async_llm.engine.runner
    execute = runner.execute
    calls = []

    def failing_once(out):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected forward failure")
        return execute(out)

    runner.execute = failing_once

    async def main():
        with pytest.raises(EngineGenerateError, match="injected forward failure") as info:
            async for _ in async_llm.generate(prompts[0], GREEDY, "fails"):
                pass
        assert info.value.output.outputs[0].finish_reason == "error"
        return [o async for o in async_llm.generate(prompts[1], GREEDY, "next")][-1]

    assert asyncio.run(main()).outputs[0].token_ids == expected[1]
    assert async_llm.is_running


def test_an_engine_failure_reaches_every_waiting_caller_and_later_ones(async_llm):
    step = async_llm.engine.step
    started = threading.Event()

    def broken_step():
        if started.is_set():
            raise RuntimeError("injected engine failure")
        started.set()
        return step()

    async_llm.engine.step = broken_step

    async def main():
        results = await asyncio.gather(
            *(_drain(async_llm.generate([5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0), f"r{i}"))
              for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            await _drain(async_llm.generate([5, 6, 7], GREEDY, "after"))

    asyncio.run(main())
    assert not async_llm.is_running and "injected engine failure" in str(async_llm.dead_error)
    async_llm._thread.join(5)
    assert not async_llm._thread.is_alive()


def test_shutdown_fails_requests_in_flight_and_joins_the_thread(async_llm):
    async def main():
        stream = await async_llm.add_request("r", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.get()
        await asyncio.get_running_loop().run_in_executor(None, async_llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            while True:
                await stream.get()

    asyncio.run(main())
    assert not async_llm._thread.is_alive() and not async_llm.is_running
    assert async_llm.engine.get_num_unfinished_requests() == 0  # the thread is gone: reading is safe now


async def _drain(generator):
    async for _ in generator:
        pass


def test_while_served_the_engine_refuses_other_threads_and_is_theirs_again_after_shutdown(one_thread, reference):
    prompts, expected = reference
    llm = LLM(tiny("qwen3"), num_blocks=32, max_model_len=256)
    served = AsyncLLM(llm)
    try:
        with pytest.raises(RuntimeError, match="kvpaging-engine"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="served"):
            llm.engine.step()
        with pytest.raises(ValueError, match="already served"):
            AsyncLLM(llm)

        async def through_the_server():
            return [o async for o in served.generate(prompts[0], GREEDY, "r0")][-1]

        assert asyncio.run(through_the_server()).outputs[0].token_ids == expected[0]
    finally:
        served.shutdown()
    assert llm.engine.owner_thread is None
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected[0]


def test_a_function_given_for_the_engine_builds_it_on_the_engine_thread(one_thread, reference):
    """What ``kvpaging serve`` does: the thread that steps the engine also builds it (one OpenMP team)."""
    prompts, expected = reference
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return LLM(tiny("qwen3"), num_blocks=32, max_model_len=256)

    served = AsyncLLM(build)
    try:
        assert built_on == [served._thread] and served.engine.owner_thread is served._thread

        async def through_the_server():
            return [o async for o in served.generate(prompts[0], GREEDY, "r0")][-1]

        assert asyncio.run(through_the_server()).outputs[0].token_ids == expected[0]
    finally:
        served.shutdown()
    assert not served._thread.is_alive() and served.engine.owner_thread is None


def test_a_function_that_fails_or_gives_a_busy_engine_raises_from_the_constructor(one_thread):
    def missing():
        raise OSError("no model at /nowhere")

    with pytest.raises(OSError, match="/nowhere"):
        AsyncLLM(missing)
    busy = LLM(tiny("qwen3"), num_blocks=32, max_model_len=256)
    busy.engine.add_request("queued", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="unfinished requests"):
        AsyncLLM(lambda: busy)
    with pytest.raises(TypeError, match="int"):
        AsyncLLM(lambda: 3)
    assert not any(t.name == "kvpaging-engine" and t.is_alive() for t in threading.enumerate())
    assert busy.engine.owner_thread is None  # refused: still the caller's
