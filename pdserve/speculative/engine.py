"""The engine with speculative decoding: each step, requests still prefilling run as usual (and
the draft catches up on them); fully computed requests draft a tree, verify it with one target
forward over the last committed token plus the tree, and keep what the target agrees with.

Verification (see `verify.py`) is lossless: greedy output is exactly the target's, sampled
output is distributed exactly as the target's. KV written for rejected tokens is dropped: the
pages past the accepted tokens go back to the allocator after every step, and an accepted tree
node's KV is moved to the slot of its position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionContext
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampler import filtered_probs, generator_at
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.speculative import registry
from pdserve.speculative.algorithm import SpeculativeAlgorithm
from pdserve.speculative.state import ExtendItem
from pdserve.speculative.tree import DraftTree
from pdserve.speculative.verify import accept_greedy, accept_sampling

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig) -> Engine:
    """An Engine, speculative when the config asks for it."""
    if config.speculative is None:
        return Engine(config)
    return SpeculativeEngine(config)


@dataclass
class _RowView:
    """A tree row seen as a request by the sampler: the history down to that row."""

    sampling_params: object
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class SpeculativeEngine(Engine):
    speculative = True

    def __init__(self, config: EngineConfig):
        if config.speculative is None:
            raise ValueError("SpeculativeEngine needs speculative settings")
        self.algorithm: SpeculativeAlgorithm = registry.get(config.speculative.algorithm)(
            config.speculative
        )
        super().__init__(config)
        logger.info(
            "speculative decoding: %s, %d steps, topk %d, %d draft tokens",
            self.algorithm.name,
            config.speculative.num_steps,
            config.speculative.eagle_topk,
            config.speculative.num_draft_tokens,
        )

    # ---- start-up ----------------------------------------------------------------------

    def _load_models(self):
        model = super()._load_models()
        self.model = model
        self.algorithm.load(self)
        return model

    def _build_kv_pools(self, extra_page_bytes: int = 0):
        pool = super()._build_kv_pools(extra_page_bytes + self.algorithm.draft_page_bytes())
        self.algorithm.build_pools(pool.num_pages)
        return pool

    def _lookahead_slots(self) -> int:
        return self.algorithm.lookahead_slots()

    def kv_tokens_for_transfer(self, num_prompt_tokens: int) -> int:
        # NOTE: the draft's KV may cover the first generated token too (STANDALONE).
        return num_prompt_tokens + 1

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.current_batch = None
        batch = self.scheduler.schedule()
        self.current_batch = batch
        self.last_batch_tokens = sum(batch.num_new_tokens)
        if not batch:
            return []
        drafting, extending = ScheduledBatch(), ScheduledBatch()
        for request, count in zip(batch.requests, batch.num_new_tokens, strict=True):
            # NOTE: a prompt whose last chunk is one token has a draft state already; its
            # first token still comes from the sampler, as every other first token does
            # (verifying a tree draws differently): a seeded request's tokens must not
            # depend on where the chunks of a batch happened to end.
            ready = request.draft_state is not None and count == 1
            ready = ready and request.num_output_tokens > 0
            (drafting if ready else extending).add(request, count)
        outputs = self._extend(extending) if extending else []
        if drafting:
            outputs.extend(self._speculate(drafting.requests))
        return outputs

    def _extend(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Prefill chunks (and recomputation after preemption), then the draft catches up."""
        starts = [r.num_computed_tokens for r in batch.requests]
        capture = self.algorithm.target_capture()
        sampled, result, features = self.runner.run_with_features(batch, capture)
        outputs = self._process(batch, sampled, result)
        items, row = [], 0
        for request, count, start in zip(batch.requests, batch.num_new_tokens, starts, strict=True):
            rows = None if features is None else features[row : row + count]
            row += count
            if request.finished and not request.hold_pages:
                continue  # pages already freed
            next_tokens = request.token_ids[start + 1 : start + count + 1]
            items.append(ExtendItem(request, start, next_tokens, rows))
        self._catch_up(items)
        return outputs

    def _catch_up(self, items: list[ExtendItem]) -> None:
        states = self.algorithm.extend(items)
        if len(states) != len(items):
            raise RuntimeError(f"{self.algorithm.name}.extend returned {len(states)} states")
        for item, state in zip(items, states, strict=True):
            request = item.request
            done = request.num_computed_tokens == request.num_tokens - 1
            request.draft_state = state if done else None
            if done:
                self.scheduler.trim_pages(request, request.num_tokens)

    @torch.inference_mode()
    def _speculate(self, requests: list) -> list[RequestOutput]:
        trees = self.algorithm.propose(requests)
        if len(trees) != len(requests):
            raise RuntimeError(f"{self.algorithm.name}.propose returned {len(trees)} trees")
        trees = [self._fit(r, t) for r, t in zip(requests, trees, strict=True)]
        hidden, features = self._verify_forward(requests, trees)
        logits = self.model.compute_logits(hidden)
        outputs, items, row = [], [], 0
        for request, tree in zip(requests, trees, strict=True):
            rows = logits[row : row + len(tree) + 1]
            path, emitted = self._accept(request, tree, rows)
            n = request.num_computed_tokens
            outputs.append(self._emit(request, emitted))
            if not request.finished:
                if not tree.is_chain and path:
                    self._move_kv(request, n, path, tree)
                request.num_computed_tokens = n + 1 + len(path)
                if features is not None:
                    picked = torch.tensor([row] + [row + 1 + i for i in path], device=self.device)
                    item_features = features.index_select(0, picked)
                else:
                    item_features = None
                next_tokens = [tree.tokens[i] for i in path] + [emitted[-1][0]]
                items.append(ExtendItem(request, n, next_tokens, item_features))
            row += len(tree) + 1
        self._catch_up(items)
        return outputs

    def _fit(self, request, tree: DraftTree) -> DraftTree:
        """Check a proposal, and cut it to what the request may still emit."""
        s = self.config.speculative
        if len(tree) > s.num_draft_tokens - 1 or any(d > s.num_steps for d in tree.depths):
            raise RuntimeError(
                f"{self.algorithm.name} proposed {len(tree)} tokens {max(tree.depths)} deep; "
                f"the settings allow {s.num_draft_tokens - 1} tokens, {s.num_steps} deep"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tree.tokens):
            raise RuntimeError(f"{self.algorithm.name} proposed token ids outside the vocabulary")
        # NOTE: accepted nodes + the bonus token must fit the request's token limit.
        return tree.truncated(request.max_total_tokens - request.num_tokens - 1)

    def _verify_forward(self, requests, trees):
        ids, positions, masks = [], [], {}
        for b, (request, tree) in enumerate(zip(requests, trees, strict=True)):
            n = request.num_computed_tokens
            ids.extend([request.token_ids[-1], *tree.tokens])
            positions.append([n, *(n + d for d in tree.depths)])
            if not tree.is_chain:
                mask = torch.zeros(len(tree) + 1, n + len(tree) + 1, dtype=torch.bool)
                mask[:, :n] = True
                mask[:, n:] = torch.tensor(tree.attention_mask())
                masks[b] = mask
        ctx = AttentionContext.build(
            page_size=self.kv_pool.page_size,
            pages=[r.pages for r in requests],
            num_computed=[r.num_computed_tokens for r in requests],
            query_lens=[len(t) + 1 for t in trees],
            device=self.device,
            positions=positions,
            masks=masks,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        capture = self.algorithm.target_capture()
        if isinstance(capture, tuple):
            return self.model.forward_capture(input_ids, ctx.positions, self.kv_pool, ctx, capture)
        hidden = self.model(input_ids, ctx.positions, self.kv_pool, ctx)
        return hidden, (hidden if capture == "final" else None)

    def _accept(self, request, tree: DraftTree, logits: torch.Tensor):
        """-> (accepted node ids, [(token, logprob, top logprobs)] emitted in order). Rows
        see the history down to them: stop tokens before min_new_tokens, penalties."""
        params = request.sampling_params
        raw = logits.log_softmax(dim=-1) if params.logprobs is not None else None
        plain = not params.uses_penalties and request.num_output_tokens >= params.min_new_tokens
        if params.greedy and plain:
            # NOTE: the common case needs no per-row history: the target's argmax per row.
            path, bonus = accept_greedy(tree, logits.argmax(dim=-1).tolist())
            return path, self._emitted(tree, path, bonus, raw, params)
        views = [
            _RowView(
                params,
                request.token_ids + tree.path_tokens(r - 1) if r else request.token_ids,
                request.num_prompt_tokens,
            )
            for r in range(len(tree) + 1)
        ]
        logits = logits.clone()
        self.sampler.process_logits(logits, views)
        if params.greedy:
            path, bonus = accept_greedy(tree, logits.argmax(dim=-1).tolist())
        else:
            probs = lambda r: filtered_probs(logits[r : r + 1], [params])[0]  # noqa: E731
            path, bonus = accept_sampling(tree, probs, generator_at(request))
        return path, self._emitted(tree, path, bonus, raw, params)

    @staticmethod
    def _emitted(tree, path, bonus, raw, params):
        tokens = [tree.tokens[i] for i in path] + [bonus]
        rows = [0] + [i + 1 for i in path]
        emitted = []
        for token, r in zip(tokens, rows, strict=True):
            logprob = top = None
            if raw is not None:
                logprob = float(raw[r, token])
                if params.logprobs:
                    values, ids = raw[r].topk(params.logprobs)
                    top = dict(zip(ids.tolist(), values.tolist(), strict=True))
            emitted.append((token, logprob, top))
        return emitted

    def _emit(self, request, emitted) -> RequestOutput:
        request.spec_verify_steps += 1
        appended = []
        for token, logprob, top in emitted:
            self._append_token(request, token, logprob, top)
            appended.append(token)
            if request.finished:
                break
        request.spec_emitted_tokens += len(appended)
        return self._output(request, appended)

    def _move_kv(self, request, n: int, path: list[int], tree: DraftTree) -> None:
        """Accepted tree nodes' KV from their verification slots (n + 1 + node) to the slots
        of their positions (n + depth)."""
        size = self.kv_pool.page_size
        pages = request.pages

        def slot(index: int) -> int:
            return pages[index // size] * size + index % size

        moves = [(n + 1 + node, n + tree.depths[node]) for node in path]
        moves = [(src, dst) for src, dst in moves if src != dst]
        if not moves:
            return
        src = torch.tensor([slot(s) for s, _ in moves], device=self.device)
        dst = torch.tensor([slot(d) for _, d in moves], device=self.device)
        storage = self.kv_pool.storage
        flat = storage.view(2, storage.shape[1], -1, *storage.shape[4:])
        flat.index_copy_(2, dst, flat.index_select(2, src))
