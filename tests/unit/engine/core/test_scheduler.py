"""Scheduler bookkeeping without a model: tokens are 'computed' by the test itself."""

import random

import pytest

from pdserve.engine.core.page_allocator import PageAllocator
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pdserve.protocol.engine_messages import FinishReason


def make_scheduler(num_pages=32, page_size=4, max_running=8, budget=16, split=True):
    config = SchedulerConfig(page_size, max_running, budget, split)
    return Scheduler(config, PageAllocator(num_pages))


def make_request(i, prompt_len, max_new=8):
    params = SamplingParams(max_new_tokens=max_new)
    return Request(f"r{i}", list(range(prompt_len)), params, prompt_len + max_new)


def run_step(scheduler):
    """Mimic the engine: advance computed tokens, sample token 0 where a chunk ends."""
    batch = scheduler.schedule()
    for i, request in enumerate(batch.requests):
        samples = batch.samples(i)
        request.num_computed_tokens += batch.num_new_tokens[i]
        assert request.num_computed_tokens <= len(request.pages) * scheduler.config.page_size
        if samples:
            request.append_token(0)
            if request.num_tokens >= request.max_total_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
    return batch


def check_invariants(scheduler):
    owners = [p for r in scheduler.running for p in r.pages]
    assert len(owners) == len(set(owners)), "a page is owned twice"
    assert len(owners) == scheduler.allocator.num_used
    assert all(not r.pages for r in scheduler.waiting)


def test_long_prompt_is_chunked_by_the_budget():
    scheduler = make_scheduler(budget=16)
    request = make_request(0, 40)
    scheduler.add(request)
    assert run_step(scheduler).num_new_tokens == [16]
    assert run_step(scheduler).num_new_tokens == [16]
    batch = run_step(scheduler)
    assert batch.num_new_tokens == [8] and request.num_output_tokens == 1


def test_decode_tokens_do_not_use_the_prefill_budget():
    scheduler = make_scheduler(budget=16)
    first, second = make_request(0, 4), make_request(1, 30)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(second)
    batch = run_step(scheduler)
    assert batch.num_new_tokens == [1, 16]


def test_unsplit_prompt_larger_than_budget_runs_alone():
    scheduler = make_scheduler(budget=8, split=False)
    scheduler.add(make_request(0, 20))
    scheduler.add(make_request(1, 3))
    assert run_step(scheduler).num_new_tokens == [20]
    assert run_step(scheduler).num_new_tokens == [1, 3]


def test_max_running_requests_is_respected():
    scheduler = make_scheduler(max_running=2, budget=100)
    for i in range(4):
        scheduler.add(make_request(i, 3))
    batch = run_step(scheduler)
    assert len(batch) == 2 and len(scheduler.waiting) == 2


def test_preemption_frees_pages_and_requeues_newest():
    scheduler = make_scheduler(num_pages=6, page_size=4, budget=100)
    old, new = make_request(0, 8, max_new=12), make_request(1, 8, max_new=12)
    scheduler.add(old)
    run_step(scheduler)
    scheduler.add(new)
    for _ in range(20):
        run_step(scheduler)
        check_invariants(scheduler)
        if new.num_preemptions:
            break
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.num_output_tokens >= 1  # generated tokens survive preemption


@pytest.mark.parametrize("seed", range(5))
def test_random_finish_and_abort_mix_frees_everything(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_pages=24, page_size=4, max_running=6, budget=12)
    requests = []
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            request = make_request(step, rng.randint(1, 30), rng.randint(1, 20))
            requests.append(request)
            scheduler.add(request)
        run_step(scheduler)
        live = [r for r in requests if not r.finished]
        if live and rng.random() < 0.1:
            scheduler.finish(rng.choice(live), FinishReason.ABORT)
        check_invariants(scheduler)
    assert scheduler.num_unfinished == 0
    assert scheduler.allocator.num_used == 0
    assert all(r.finished and not r.pages for r in requests)
