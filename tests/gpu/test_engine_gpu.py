"""The engine on CUDA (Triton attention unless a test names the torch reference): float32
exactness against transformers, bfloat16 agreement, memory sizing from the GPU's free
memory. Skipped without a GPU; run on the device machine."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import ARCHS, random_prompts

pytestmark = pytest.mark.gpu

LENGTHS = (1, 7, 16, 33, 90, 300)
KV_BYTES = 256 << 20


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_greedy_equals_transformers(arch, backend, tiny_model_dirs, hf_greedy):
    model_dir = tiny_model_dirs(arch)
    llm = LLM(
        model_dir,
        device="cuda",
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        attention_backend=backend,
    )
    prompts = random_prompts(LENGTHS, 1000, seed=1)
    outputs = llm.generate(prompts, greedy(32))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(model_dir, prompt, 32, device="cuda", dtype=torch.float32)
        assert output.token_ids == expected, f"prompt length {len(prompt)}"


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_greedy_agrees_with_transformers(arch, tiny_model_dirs, hf_greedy):
    """bf16 rounding differs between any two implementations, so greedy paths may part at a
    near-tie. Check they are equal, or part only where the float32 model itself sees the two
    candidate tokens within a small logit gap."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs(arch)
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", kv_cache_memory=KV_BYTES)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    prompts = random_prompts((3, 11, 25, 40, 64, 80, 120, 200), 1000, seed=4)
    outputs = llm.generate(prompts, greedy(8))
    matches, gaps = 0, []
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_greedy(model_dir, prompt, 8, device="cuda", dtype=torch.bfloat16)
        if output.token_ids == expected:
            matches += 1
            continue
        part = next(
            i for i, (a, b) in enumerate(zip(output.token_ids, expected, strict=True)) if a != b
        )
        prefix = torch.tensor([prompt + expected[:part]], device="cuda")
        with torch.no_grad():
            logits = reference(prefix).logits[0, -1]
        gaps.append(abs(float(logits[expected[part]] - logits[output.token_ids[part]])))
    print(f"{arch}: bf16 8-token agreement {matches}/{len(prompts)}, fp32 gaps where parted {gaps}")
    assert matches >= len(prompts) // 2
    assert all(gap < 0.1 for gap in gaps), gaps


def test_chunked_prefill_and_page_size_on_gpu(tiny_model_dirs):
    model_dir = tiny_model_dirs("qwen3")
    prompts = random_prompts((5, 64, 150), 1000, seed=5)

    def tokens(**options):
        llm = LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory=KV_BYTES, **options)
        return [o.token_ids for o in llm.generate(prompts, greedy(16))]

    reference = tokens(chunked_prefill_size=0)
    assert tokens(chunked_prefill_size=16) == reference
    assert tokens(page_size=1) == reference
    assert tokens(page_size=64) == reference


def test_seeded_sampling_reproduces_on_gpu(tiny_model_dirs):
    llm = LLM(tiny_model_dirs("llama"), device="cuda", kv_cache_memory=KV_BYTES)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=50, top_p=0.9, seed=11)
    alone = llm.generate(["Hello there"], params)[0].token_ids
    batched = llm.generate(["x", "Hello there", "y z"], params)[1].token_ids
    assert alone == batched


def test_kv_pool_sized_from_gpu_memory(tiny_model_dirs):
    llm = LLM(tiny_model_dirs("llama"), device="cuda", gpu_memory_utilization=0.1)
    total = torch.cuda.get_device_properties(0).total_memory
    pool = llm.engine.kv_pool
    assert 0.03 * total < pool.nbytes < 0.1 * total
    assert llm.generate(["Hi"], greedy(4))[0].token_ids


def test_sampling_queues_behind_the_gpu_without_waiting_for_it():
    """An overlapped step samples while the GPU still runs the step before: every kind of
    row (greedy, temperature with top-k / top-p / min-p, a stop token banned before
    min_new_tokens, seeded and unseeded, penalties) must be sampled without the host waiting
    for the GPU. Called while the GPU sleeps, `sample` returns before the sleep ends. (One
    untimed round first: a kernel's first launch in a process loads its module, which may
    wait for the GPU: once per process, not per step.)"""
    from pdserve.engine.core.request import Request
    from pdserve.engine.runtime.sampler import Sampler

    device = torch.device("cuda")
    sampler = Sampler((1,))
    settings = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, min_new_tokens=2),
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(
            temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3
        ),
    ]
    requests = [Request(f"r{i}", [5, 6, 7], p, 100) for i, p in enumerate(settings)]
    for token in (6, 9, 9):
        requests[-1].append_token(token)  # penalties read the tokens generated so far
    for request in requests:
        if request.sampling_params.seed is not None:
            request.generator = sampler.make_generator(device)
    for rows in (requests, requests[1:]):
        sampler.sample(torch.randn(len(rows), 64, device=device), rows)
    torch.cuda.synchronize()
    for rows in (requests, requests[1:]):  # some rows greedy, then every row sampled
        logits = torch.randn(len(rows), 64, device=device)
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time
        asleep = torch.cuda.Event()
        asleep.record()
        tokens = sampler.sample(logits, rows)
        assert not asleep.query(), "sampling waited for the GPU"
        assert all(0 <= t < 64 for t in tokens.tolist())
