"""The engine's speculator (`pdserve.engine.speculator.Speculator`) over one `SpeculativeAlgorithm`.

Each step, requests that are fully computed and have a draft input get a tree from the
algorithm (checked, and cut to what the request may still emit); the engine verifies it in
its forward pass, as the last committed token plus the tree. Chains an algorithm drafts on the
device (`propose_on_device`) stay there until verification, which copies them to the host
with the target's choices in one copy. Verification (see `verify.py`)
is lossless: greedy output is exactly the target's, sampled output is distributed exactly as
the target's. KV written for rejected tokens is dropped: an accepted tree node's KV moves to
the slot of its position, and the pages past the accepted tokens go back to the allocator
after every step. Then the draft catches up on every token the target computed (prefill
chunks too), which gives each fully computed request its next draft input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pdserve.engine.core.request import Request
from pdserve.engine.core.scheduler import ScheduledBatch
from pdserve.engine.runtime.forward_batch import Capture, ForwardOutput, device_ints
from pdserve.engine.runtime.overlap import placeholder
from pdserve.engine.runtime.sampler import filtered_probs, generator_at
from pdserve.engine.speculator import Draft, DraftHandoff, Emitted, Proposals
from pdserve.protocol.spec_settings import SpecSettings
from pdserve.speculative import registry
from pdserve.speculative.algorithm import SpeculativeAlgorithm
from pdserve.speculative.state import DraftBatch, ExtendItem
from pdserve.speculative.tree import DraftTree
from pdserve.speculative.verify import accept_greedy, accept_sampling

logger = logging.getLogger(__name__)


def build_speculator(settings: SpecSettings | None) -> AlgorithmSpeculator | None:
    """The speculator these settings describe (None: no speculative decoding)."""
    if settings is None:
        return None
    return AlgorithmSpeculator(registry.get(settings.algorithm)(settings))


@dataclass(kw_only=True)
class TreeDraft(Draft):
    """A draft tree in the verification pass: proposed after `start` committed tokens; after
    `verify`, its accepted nodes (`path`, root to leaf) and the target's token after them.
    A chain drafted on the device has placeholder ids and no `tree` until `verify` copies
    it."""

    tree: DraftTree | None
    start: int
    path: list[int] = field(default_factory=list)
    bonus: int = -1


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


class AlgorithmSpeculator:
    """Drafts with `algorithm`, verifies its trees, and keeps its draft state current."""

    def __init__(self, algorithm: SpeculativeAlgorithm):
        self.algorithm = algorithm
        self.settings: SpecSettings = algorithm.settings
        self._drafted: torch.Tensor | None = None  # this step's device tokens (flat)
        self.steps_drafted_on_device = 0  # statistics, tests
        self._seed_metadata = None  # the metadata record's layout, once asked (`seed_drafts`)

    # ---- start-up ----------------------------------------------------------------------

    def load(self, engine) -> None:
        self.engine = engine
        self.algorithm.load(engine)
        logger.info(
            "speculative decoding: %s, %d steps, topk %d, %d draft tokens",
            self.algorithm.name,
            self.settings.num_steps,
            self.settings.eagle_topk,
            self.settings.num_draft_tokens,
        )

    def draft_page_bytes(self) -> int:
        return self.algorithm.draft_page_bytes()

    def handoff(self, hidden_dtype: str) -> DraftHandoff:
        algorithm, settings = self.algorithm, self.settings
        draft_config = algorithm.draft_config()
        return DraftHandoff(
            algorithm=algorithm.name,
            topk=settings.eagle_topk,
            num_steps=settings.num_steps,
            num_draft_tokens=settings.num_draft_tokens,
            metadata=algorithm.metadata_spec(draft_config, hidden_dtype),
            draft_pools=algorithm.draft_pools(),
            draft_config=draft_config,
        )

    def seed_drafts(self, requests: list[Request], records: list) -> list:
        """The algorithm's `build_disagg_draft_input`, checked: one state per request."""
        algorithm, engine = self.algorithm, self.engine
        if self._seed_metadata is None:  # NOTE: once: the draft's config is read from disk
            self._seed_metadata = self.handoff(str(engine.dtype).removeprefix("torch.")).metadata
        batch = DraftBatch([r.request_id for r in requests], self._seed_metadata, engine.device)
        states = algorithm.build_disagg_draft_input(
            batch, [r.first_token for r in records], records
        )
        if states is None or len(states) != len(requests):
            raise ValueError(
                f"{algorithm.name}.build_disagg_draft_input returned "
                f"{'None' if states is None else len(states)} inputs for {len(requests)} requests"
            )
        missing = [r.request_id for r, s in zip(requests, states, strict=True) if s is None]
        if missing:
            raise ValueError(
                f"{algorithm.name}.build_disagg_draft_input returned None for {missing[:3]}"
            )
        return states

    def build_pools(self, num_pages: int) -> None:
        self.algorithm.build_pools(num_pages)

    def build_graphs(self, page_table, max_tokens: int) -> None:
        self.algorithm.build_graphs(page_table, max_tokens)

    def lookahead_slots(self) -> int:
        return self.algorithm.lookahead_slots()

    def kv_tokens_for_transfer(self, num_prompt_tokens: int) -> int:
        # NOTE: the draft's KV may cover the first generated token too (STANDALONE).
        return num_prompt_tokens + 1

    def target_capture(self) -> Capture:
        capture = self.algorithm.target_capture()
        if not isinstance(capture, Capture):
            raise TypeError(
                f"{self.algorithm.name}.target_capture() returned {capture!r}; return a "
                "Capture (Capture.NONE, Capture.final() or Capture.layers(ids))"
            )
        return capture

    def verify_tokens(self) -> int:
        return self.settings.num_draft_tokens

    # ---- proposing ---------------------------------------------------------------------

    def propose(self, batch: ScheduledBatch) -> Proposals:
        # NOTE: a prompt whose last chunk is one token has a draft state already; its first
        # token still comes from the sampler, as every other first token does (verifying a
        # tree draws differently): a seeded request's tokens must not depend on where the
        # chunks of a batch happened to end.
        ready = [
            i
            for i, (request, count) in enumerate(
                zip(batch.requests, batch.num_new_tokens, strict=True)
            )
            if request.draft_state is not None and count == 1 and request.num_output_tokens > 0
        ]
        self._drafted = None
        if not ready:
            return Proposals({})
        requests = [batch.requests[i] for i in ready]
        drafted = self._propose_on_device(requests)
        if drafted is not None:
            self._drafted = drafted.flatten()
            self.steps_drafted_on_device += 1
            return Proposals(
                {
                    i: self._device_draft(request, b, drafted.shape[1])
                    for b, (i, request) in enumerate(zip(ready, requests, strict=True))
                },
                self._drafted,
            )
        trees = self.algorithm.propose(requests)
        if len(trees) != len(requests):
            raise RuntimeError(f"{self.algorithm.name}.propose returned {len(trees)} trees")
        return Proposals(
            {
                i: self._draft(request, self._fit(request, tree))
                for i, request, tree in zip(ready, requests, trees, strict=True)
            }
        )

    def _propose_on_device(self, requests: list[Request]) -> torch.Tensor | None:
        """Chains left on the device (`[B, num_steps]`), where the algorithm drafts them
        there and no request is near its token limit (a chain cut short is cut on the host);
        else None."""
        steps = self.settings.num_steps
        if any(r.max_total_tokens - r.num_tokens - 1 < steps for r in requests):
            return None
        drafted = self.algorithm.propose_on_device(requests)
        if drafted is not None and tuple(drafted.shape) != (len(requests), steps):
            raise RuntimeError(
                f"{self.algorithm.name}.propose_on_device returned shape {tuple(drafted.shape)}"
                f" for {len(requests)} requests of {steps} steps"
            )
        return drafted

    def _fit(self, request: Request, tree: DraftTree) -> DraftTree:
        """Check a proposal, and cut it to what the request may still emit."""
        s = self.settings
        if len(tree) > s.num_draft_tokens - 1 or any(d > s.num_steps for d in tree.depths):
            raise RuntimeError(
                f"{self.algorithm.name} proposed {len(tree)} tokens {max(tree.depths)} deep; "
                f"the settings allow {s.num_draft_tokens - 1} tokens, {s.num_steps} deep"
            )
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in tree.tokens):
            raise RuntimeError(f"{self.algorithm.name} proposed token ids outside the vocabulary")
        # NOTE: accepted nodes + the bonus token must fit the request's token limit.
        return tree.truncated(request.max_total_tokens - request.num_tokens - 1)

    @staticmethod
    def _draft(request: Request, tree: DraftTree) -> TreeDraft:
        """The verification input: the last committed token (the root, at position n), then
        the tree's nodes at n + depth, each seeing the cached prefix, its ancestors and
        itself (the mask covers the new tokens: all of them see the cache). A chain is
        consecutive and causal: no positions or mask needed."""
        n = request.num_computed_tokens
        token_ids = [request.token_ids[-1], *tree.tokens]
        if tree.is_chain:
            return TreeDraft(token_ids=token_ids, tree=tree, start=n)
        mask = torch.tensor(tree.attention_mask(), dtype=torch.bool)
        positions = [n, *(n + d for d in tree.depths)]
        return TreeDraft(token_ids=token_ids, positions=positions, mask=mask, tree=tree, start=n)

    @staticmethod
    def _device_draft(request: Request, row: int, length: int) -> TreeDraft:
        """A chain drafted on the device, row `row` of the step's device tokens: its ids are
        placeholders until `verify` copies them."""
        token_ids = [request.token_ids[-1], *(placeholder(row * length + s) for s in range(length))]
        return TreeDraft(token_ids=token_ids, tree=None, start=request.num_computed_tokens)

    # ---- verifying ---------------------------------------------------------------------

    def verify(
        self, requests: list[Request], drafts: list[TreeDraft], logits: torch.Tensor
    ) -> list[list[Emitted]]:
        choices = self._copy_to_host(drafts, logits)
        return [
            self._verify(request, draft, rows, row_choices)
            for request, draft, rows, row_choices in zip(
                requests,
                drafts,
                logits.split([len(d.token_ids) for d in drafts]),
                choices,
                strict=True,
            )
        ]

    def _copy_to_host(self, drafts: list[TreeDraft], logits: torch.Tensor) -> list[list[int]]:
        """What the host needs to verify, in one copy: every row's argmax (the target's
        greedy choice; a request that samples or adjusts its logits chooses again), and the
        chains drafted on the device, which become the drafts' trees."""
        parts = [logits.argmax(dim=-1)]
        if self._drafted is not None:
            parts.append(self._drafted)
        host = torch.cat(parts).tolist()
        drafted = host[logits.shape[0] :]
        for draft in drafts:
            if draft.tree is None:  # its ids past the root are placeholders into `drafted`
                draft.tree = DraftTree.chain([drafted[-1 - t] for t in draft.token_ids[1:]])
        self._drafted = None
        choices, start = [], 0
        for draft in drafts:
            choices.append(host[start : start + len(draft.token_ids)])
            start += len(draft.token_ids)
        return choices

    def _verify(
        self, request: Request, draft: TreeDraft, logits: torch.Tensor, choices: list[int]
    ) -> list[Emitted]:
        """Rows see the history down to them: stop tokens before min_new_tokens, penalties."""
        tree = draft.tree
        params = request.sampling_params
        raw = logits.log_softmax(dim=-1) if params.logprobs is not None else None
        plain = not params.uses_penalties and request.num_output_tokens >= params.min_new_tokens
        if params.greedy and plain:
            # NOTE: the common case needs no per-row history: the target's argmax per row.
            path, bonus = accept_greedy(tree, choices)
        else:
            views = [
                _RowView(
                    params,
                    request.token_ids + tree.path_tokens(r - 1) if r else request.token_ids,
                    request.num_prompt_tokens,
                )
                for r in range(len(tree) + 1)
            ]
            logits = logits.clone()
            self.engine.sampler.process_logits(logits, views)
            if params.greedy:
                path, bonus = accept_greedy(tree, logits.argmax(dim=-1).tolist())
            else:
                probs = lambda r: filtered_probs(logits[r : r + 1], [params])[0]  # noqa: E731
                path, bonus = accept_sampling(tree, probs, generator_at(request))
        draft.path, draft.bonus = path, bonus
        return _emitted(tree, path, bonus, raw, params)

    # ---- after the step ----------------------------------------------------------------

    def catch_up(
        self, batch: ScheduledBatch, output: ForwardOutput, drafts: dict[int, Draft]
    ) -> None:
        items = []
        for i, (request, count) in enumerate(
            zip(batch.requests, batch.num_new_tokens, strict=True)
        ):
            if i in drafts or (request.finished and not request.hold_pages):
                continue  # a finished request's pages are already freed
            start = output.batch.num_computed[i]
            next_tokens = request.token_ids[start + 1 : start + count + 1]
            features = None if output.features is None else output.features[output.rows(i)]
            items.append(ExtendItem(request, start, next_tokens, features))
        for i, draft in drafts.items():
            if not batch.requests[i].finished:
                items.append(self._commit(batch.requests[i], draft, output, i))
        if not items:
            return
        states = self.algorithm.extend(items)
        if len(states) != len(items):
            raise RuntimeError(f"{self.algorithm.name}.extend returned {len(states)} states")
        for item, state in zip(items, states, strict=True):
            request = item.request
            done = request.num_computed_tokens == request.num_tokens - 1
            request.draft_state = state if done else None
            if done:
                self.engine.trim_pages(request, request.num_tokens)

    def _commit(
        self, request: Request, draft: TreeDraft, output: ForwardOutput, index: int
    ) -> ExtendItem:
        """Keep the accepted nodes' KV and count them computed; the draft's catch-up item."""
        n, path, tree = draft.start, draft.path, draft.tree
        if not tree.is_chain and path:
            self._move_kv(request, n, path, tree)
        request.num_computed_tokens = n + 1 + len(path)
        features = None
        if output.features is not None:
            row = output.rows(index).start
            if tree.is_chain:  # the accepted rows follow the root's
                features = output.features[row : row + 1 + len(path)]
            else:
                picked = [row] + [row + 1 + node for node in path]
                features = output.features.index_select(
                    0, device_ints(picked, output.features.device)
                )
        next_tokens = [tree.tokens[node] for node in path] + [draft.bonus]
        return ExtendItem(request, n, next_tokens, features)

    def _move_kv(self, request: Request, n: int, path: list[int], tree: DraftTree) -> None:
        """Accepted tree nodes' KV from their verification slots (n + 1 + node) to the slots
        of their positions (n + depth)."""
        kv_pool = self.engine.kv_pool
        size = kv_pool.page_size
        pages = request.pages

        def slot(index: int) -> int:
            return pages[index // size] * size + index % size

        moves = [(n + 1 + node, n + tree.depths[node]) for node in path]
        moves = [(src, dst) for src, dst in moves if src != dst]
        if not moves:
            return
        self.engine.runner.move_kv([slot(s) for s, _ in moves], [slot(d) for _, d in moves])


def _emitted(tree: DraftTree, path: list[int], bonus: int, raw, params) -> list[Emitted]:
    """The accepted nodes' tokens and the bonus, each with its raw logprob (and top logprobs)
    from its row when asked."""
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
