"""Turns next-token logits into tokens, one row per request, each with its own settings.

Order of operations (vLLM's): suppress stop tokens before `min_new_tokens`; penalties
(repetition over prompt + output, HF style; frequency and presence over the output, OpenAI
style); greedy rows take the argmax; sampled rows divide by temperature, keep the top-k, the
top-p nucleus and tokens with at least min_p times the top probability, then draw. A request
with a seed draws from its own generator, so its tokens do not depend on what else is batched
with it; the generator is seeded afresh for each output position (`position_seed`), so the
draws for a position depend only on the seed and the position, never on how many draws came
before on this engine: a request handed from a prefill to a decode engine draws what it would
have drawn in one. Reported logprobs are those of the raw model distribution.

Whatever the settings, a row always yields a valid token id: `SamplingParams` bounds keep the
arithmetic finite, and a row that still ends with no probability mass (every token banned or
filtered out) takes the argmax of its logits instead of feeding NaN to the draw.

`sample` never waits for the GPU: an overlapped step samples while the device still runs the
step before (`overlap.py`), so per-row settings and row indices go up with non-blocking
copies (`torch.tensor(values, device=...)`, or indexing a GPU tensor with a list, would first
wait for every kernel queued before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.runtime.forward_batch import device_ints

FLOAT32_MAX = torch.finfo(torch.float32).max
_U64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for output token `position` of a request seeded with `seed`:
    splitmix64 of the two, so nearby seeds and positions give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def generator_at(request: Request) -> torch.Generator | None:
    """A seeded request's generator, set for the request's next output token (None when
    the request has no seed)."""
    if request.generator is not None:
        seed = position_seed(request.sampling_params.seed, request.num_output_tokens)
        request.generator.manual_seed(seed)
    return request.generator


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = tuple(eos_token_ids)

    def make_generator(self, device: torch.device) -> torch.Generator:
        """A seeded request's generator; `generator_at` seeds it before every draw."""
        return torch.Generator(device=device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """`logits` is `[len(requests), vocab]` float32; it is modified in place."""
        params = [r.sampling_params for r in requests]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        token_ids = self.sample(logits, requests).tolist()
        logprobs: list[float | None] = [None] * len(requests)
        top: list[dict[int, float] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            chosen = torch.tensor([token_ids[i] for i in logprob_rows], device=logits.device)
            chosen_lp = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
            for j, row in enumerate(logprob_rows):
                logprobs[row] = chosen_lp[j]
                n = params[row].logprobs
                if n:
                    values, ids = raw_logprobs[j].topk(n)
                    top[row] = dict(zip(ids.tolist(), values.tolist(), strict=True))
        return SampleResult(token_ids, logprobs, top)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The tokens alone, on the logits' device. `logits` is modified in place."""
        self.process_logits(logits, requests)
        params = [r.sampling_params for r in requests]
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == len(requests):
            return self._draw(filtered_probs(logits, params), requests)
        tokens = logits.argmax(dim=-1)
        if sample_rows:
            rows = device_ints(sample_rows, logits.device)
            probs = filtered_probs(logits.index_select(0, rows), [params[i] for i in sample_rows])
            tokens.index_copy_(0, rows, self._draw(probs, [requests[i] for i in sample_rows]))
        return tokens

    def process_logits(self, logits: torch.Tensor, requests) -> None:
        """In place: stop tokens suppressed before min_new_tokens, then penalties. `requests`
        need `sampling_params`, `token_ids`, `output_token_ids` and `num_output_tokens`."""
        self._suppress_stop_tokens(logits, requests)
        for row, request in enumerate(requests):
            if request.sampling_params.uses_penalties:
                _apply_penalties(logits[row], request)

    def _suppress_stop_tokens(self, logits: torch.Tensor, requests: list[Request]) -> None:
        for row, request in enumerate(requests):
            p = request.sampling_params
            if request.num_output_tokens >= p.min_new_tokens:
                continue
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            # NOTE: the engine refuses ids outside the vocabulary; a stray one must not crash.
            banned = [t for t in banned if t < logits.shape[-1]]
            if banned:
                logits[row].index_fill_(0, device_ints(banned, logits.device), float("-inf"))

    @staticmethod
    def _draw(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if len(unseeded) == len(requests):
            return draw(probs)
        drawn = torch.empty(len(requests), dtype=torch.int64, device=probs.device)
        if unseeded:
            rows = device_ints(unseeded, probs.device)
            drawn.index_copy_(0, rows, draw(probs.index_select(0, rows)))
        for i, request in enumerate(requests):
            if request.generator is not None:
                drawn[i] = draw(probs[i], generator_at(request))
        return drawn


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` (the last dimension), drawn in proportion to it: the
    largest probability over an exponential variate. The very draws (same generator, same
    tokens) of `torch.multinomial(probs, 1)`, whose one-sample path computes exactly this, but
    without its validity check, a host sync (`_with_mass` has made every row valid)."""
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return probs.div(race).argmax(dim=-1)


def _apply_penalties(row_logits: torch.Tensor, request: Request) -> None:
    p = request.sampling_params
    device = row_logits.device
    # NOTE: ids go up without blocking and counts come from index_add_, not bincount (which
    # reads the largest id back to the host): penalties must not wait for the GPU either.
    if p.repetition_penalty != 1.0:
        seen = device_ints(sorted(set(request.token_ids)), device)
        values = row_logits[seen]
        row_logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if (p.frequency_penalty or p.presence_penalty) and request.num_output_tokens:
        output = device_ints(request.output_token_ids, device)
        counts = torch.zeros(row_logits.shape[0], device=device).index_add_(
            0, output, torch.ones(len(request.output_token_ids), device=device)
        )
        row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, renormalized."""
    device = logits.device
    temperature = _device_floats([p.sampling_temperature for p in params], device)
    logits = (logits / temperature[:, None]).nan_to_num_(nan=float("-inf"), posinf=FLOAT32_MAX)
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        k = device_ints(top_k, device)
        sorted_logits.masked_fill_(ranks[None, :] >= k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # NOTE: drop a token once the mass strictly before it already reaches top_p; the most
        # likely token is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = _device_floats(top_p, device)
        sorted_logits.masked_fill_(mass_before >= p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = _device_floats([p.min_p for p in params], device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return _with_mass(probs, logits)


def _device_floats(values: list[float], device: torch.device) -> torch.Tensor:
    """Host floats as a float32 tensor on `device`, without waiting for the GPU."""
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def _with_mass(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Rows without a usable distribution (NaN, or all mass filtered out: every token was
    banned before min_new_tokens) become a point mass on their logits' argmax."""
    # NOTE: without a host sync (no `if empty.any()`): an overlapped step samples while the
    # GPU still runs the step before. Rows with mass come out unchanged.
    empty = ~(probs.sum(dim=-1) > 0) | probs.isnan().any(dim=-1)
    probs = probs.nan_to_num(nan=0.0).masked_fill_(empty[:, None], 0.0)
    choice = logits.argmax(dim=-1, keepdim=True)
    kept = probs.gather(1, choice)
    return probs.scatter_(1, choice, torch.where(empty[:, None], 1.0, kept))
