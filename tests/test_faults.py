"""Faults at random steps, with many requests in flight: only the failing step's requests fail.

``test_engine_behaviour.py`` fails a step chosen by hand among two or three
requests. Here the failing step is drawn at random (from a seeded
``random.Random``) while a couple of dozen requests are in flight -- chunked
prefill, ``n`` up to 3, greedy and seeded sampling, shared prefixes, a pool
small enough to preempt -- and the fault comes from a random layer of the real
model (after the layers before it wrote their keys and values) or from the
sampler (after the step's forks), where it fails one request's rows. More requests arrive after the failure, some
with the prompts of the failed ones, so the prefix cache is tempted to serve
what the failed step wrote.

Checks: a forward fault fails the requests scheduled in its step, and only those; a
sampler fault fails the one request whose rows raise, and no other request of its
step. They finish with ``finish_reason="error"`` and ``RequestOutput.error`` set; what they had
generated before is a prefix of their solo run; their blocks are freed at once;
every other request, earlier or later, finishes with exactly the tokens it gets
when run alone on a fresh engine; the engine ends clean.
"""

from __future__ import annotations

import random

import pytest
from engine_helpers import (
    FIRST_ORDINARY_TOKEN,
    assert_consistent,
    assert_pool_clean,
    build_llm,
    make_model,
)

from kvpaging import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "qwen3"
VOCAB = 4096
ENGINE = dict(block_size=4, num_blocks=24, max_model_len=48, max_num_seqs=8, max_num_batched_tokens=16)


class Injected(RuntimeError):
    pass


def workload(rng: random.Random, count: int, prefixes: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    reqs = []
    for _ in range(count):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(rng.randint(1, 6))]
        else:
            prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(rng.randint(1, 30))]
        sampling = {"temperature": 0.0} if rng.random() < 0.5 else {
            "temperature": rng.choice([0.6, 1.0]), "top_p": rng.choice([1.0, 0.9]), "seed": rng.randrange(2**31)}
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randint(1, 10), ignore_eos=True, **sampling)
        reqs.append((prompt, params))
    return reqs


@pytest.fixture(scope="module")
def solo(one_thread):
    """Each request alone on a fresh engine with a pool that never runs short; cached by request."""
    model = make_model(ARCH)  # a twin: same seed, same weights, shares nothing with the engines under test
    cache: dict = {}

    def run(prompt: list[int], params: SamplingParams) -> list[list[int]]:
        key = (tuple(prompt), repr(params))
        if key not in cache:
            llm = build_llm(model, num_blocks=64, max_model_len=ENGINE["max_model_len"], max_num_batched_tokens=64)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert llm.engine.scheduler.num_preemptions == 0
            cache[key] = [c.token_ids for c in out.outputs]
        return cache[key]

    return run


class FaultAt:
    """Raise ``Injected`` on chosen calls (1-based); a forward pre-hook, or a drop-in sampler."""

    def __init__(self, calls: set[int], inner=None) -> None:
        self.calls, self.inner, self.count, self.raised = calls, inner, 0, []

    def _tick(self):
        self.count += 1
        if self.count in self.calls:
            error = Injected(f"injected at call {self.count}")
            self.raised.append(error)
            raise error

    def __call__(self, *args, **kwargs):
        self._tick()
        if self.inner is not None:  # the sampler: fail or sample
            return self.inner(*args, **kwargs)
        return None  # a forward pre-hook: go on unchanged


class RowFault:
    """A drop-in sampler that, at the chosen steps (1-based, counting the steps that sample), raises
    whenever the rows it is given include one request's: the first row's request of that step."""

    def __init__(self, calls: set[int], inner, engine) -> None:
        self.calls, self.inner, self.engine = calls, inner, engine
        self.count, self.last_step, self.raised, self.victims = 0, None, [], {}

    def __call__(self, logits, params, *args, **kwargs):
        step = self.engine.num_steps
        if step != self.last_step:  # the step's first call: the whole batch
            self.last_step, self.count = step, self.count + 1
            if self.count in self.calls:
                self.victims[step] = params[0]
                self.raised.append(Injected(f"injected at sampling step {self.count}"))
        victim = self.victims.get(step)
        if victim is not None and any(p is victim for p in params):
            raise self.raised[-1]
        return self.inner(logits, params, *args, **kwargs)


def run_with_faults(seed: int, kind: str, num_faults: int, solo) -> dict:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(3)]
    first = workload(rng, 24, prefixes)
    llm = build_llm(make_model(ARCH), **ENGINE)
    engine = llm.engine

    # faults on calls drawn among the first 25: the first 24 requests keep the engine busy for longer
    fail_at = set(rng.sample(range(2, 26), num_faults))
    if kind == "forward":
        layer = rng.randrange(len(engine.model.model.layers))
        fault = FaultAt(fail_at)
        handle = engine.model.model.layers[layer].register_forward_pre_hook(fault, with_kwargs=True)
    else:
        fault = RowFault(fail_at, engine.sampler, engine)
        engine.sampler = fault

    schedules = []  # every step's SchedulerOutput, read from outside: which requests each step ran
    real_schedule = engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = real_schedule(*args, **kwargs)
        schedules.append(out)
        return out

    engine.scheduler.schedule = recording_schedule

    specs = {}
    for i, (prompt, params) in enumerate(first):
        specs[f"a{i}"] = (prompt, params)
        engine.add_request(f"a{i}", prompt, params)
    finals, failed = {}, {}
    added_later = False
    steps = 0
    while engine.has_unfinished_requests():
        raised_before = len(fault.raised)
        outs = engine.step()
        steps += 1
        assert steps < 500
        if len(fault.raised) > raised_before:
            # a forward fault: the failing step's requests, and only those, come back failed, at once;
            # a sampler fault: the requests whose rows raised (one request, or repeats sharing its params)
            in_step = {s.seq.request.request_id for s in schedules[-1].scheduled}
            if kind == "forward":
                victims = in_step
            else:
                victim = fault.victims[engine.num_steps]
                victims = {seq.request.request_id for seq in schedules[-1].samples if seq.request.params is victim}
                assert victims, "the victim's rows were sampled in this step"
            assert victims <= {o.request_id for o in outs} <= in_step
            for o in outs:
                if o.request_id not in victims:
                    assert o.error is None and all(c.finish_reason != "error" for c in o.outputs), o
                    continue
                assert o.finished and o.error is fault.raised[-1], o
                assert "error" in [c.finish_reason for c in o.outputs]
                assert all(c.finish_reason in ("error", "length") for c in o.outputs)  # some finished before
                failed[o.request_id] = o
                assert o.request_id not in engine.scheduler.requests
            for request in {s.seq.request for s in schedules[-1].scheduled if s.seq.request.request_id in victims}:
                for seq in request.seqs:  # forks made in the failed step included
                    assert not engine.block_manager.has_sequence(seq.seq_id), f"failed {seq.seq_id} still holds blocks"
            if not added_later:
                # more requests after the first failure, some repeating the failed requests' prompts
                added_later = True
                repeats = [specs[rid] for rid in sorted(in_step)][:3]
                for j, (prompt, params) in enumerate(repeats + workload(rng, 12, prefixes)):
                    specs[f"b{j}"] = (prompt, params)
                    engine.add_request(f"b{j}", prompt, params)
        else:
            for o in outs:
                assert o.error is None and all(c.finish_reason != "error" for c in o.outputs)
        for o in outs:
            if o.finished and o.request_id not in failed:
                assert o.request_id not in finals
                finals[o.request_id] = o
        assert_consistent(engine)

    if kind == "forward":
        handle.remove()
    assert len(fault.raised) == num_faults, f"{len(fault.raised)} faults raised, {num_faults} planned"
    assert set(finals) | set(failed) == set(specs) and not set(finals) & set(failed)
    for rid, (prompt, params) in specs.items():
        alone = solo(prompt, params)
        if rid in failed:
            for c, ref in zip(failed[rid].outputs, alone):
                assert c.token_ids == ref[: len(c.token_ids)], f"{rid}.{c.index}: before failing it strayed from its solo run"
        else:
            got = [c.token_ids for c in finals[rid].outputs]
            assert got == alone, f"{rid} ({params}): {got}, alone {alone}"
            assert all(c.finish_reason == "length" for c in finals[rid].outputs)
    assert_pool_clean(llm)
    return {"steps": steps, "failed": len(failed), "finished": len(finals),
            "preemptions": engine.scheduler.num_preemptions, "hits": engine.block_manager.stats().prefix_hit_tokens}


@pytest.mark.parametrize("kind", ["forward", "sampler"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_fault_at_a_random_step_fails_only_that_steps_requests(seed, kind, solo):
    figures = run_with_faults(seed, kind, num_faults=1, solo=solo)
    assert figures["failed"] > 0 and figures["finished"] > 0, figures


@pytest.mark.parametrize("kind", ["forward", "sampler"])
def test_several_faults_in_one_run(kind, solo):
    figures = run_with_faults(11, kind, num_faults=3, solo=solo)
    assert figures["failed"] >= 3 and figures["finished"] > 0, figures


def test_the_workload_really_is_under_pressure(solo):
    """The fault runs are only worth something if they preempt, chunk prompts, hit the cache and fork."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(rng.randint(8, 20))] for _ in range(3)]
    reqs = workload(rng, 24, prefixes)
    assert any(len(p) > ENGINE["max_num_batched_tokens"] for p, _ in reqs)  # some prompt needs chunks
    assert any(sp.n > 1 for _, sp in reqs)
    llm = build_llm(make_model(ARCH), **ENGINE)
    engine = llm.engine
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    stats = engine.block_manager.stats()
    assert engine.scheduler.num_preemptions > 0
    assert stats.prefix_hit_tokens > 0 and stats.num_cow_copies > 0
    for (prompt, params), out in zip(reqs, outs):
        assert [c.token_ids for c in out.outputs] == solo(prompt, params)
    assert_pool_clean(llm)
