"""Drafting with a model of its own (EAGLE, EAGLE-3, STANDALONE): the draft's KV pool, catching
it up on what the target computed, and proposing a chain or a tree.

The draft's KV pool shares the target's page ids (a request's pages hold its draft KV too), so
pages, preemption and transfer need no second allocator. Invariant between steps, for a
request with committed tokens x_0..x_m (x_m not yet in the target's KV): the draft's KV covers
positions [0, m - 1 + offset] and `request.draft_state` holds the draft's top-k (and hidden
state) for the token after x_m. EAGLE drafts (offset 0) read at position i the pair
(x_{i+1}, target feature at i); STANDALONE (offset 1) reads x_i, like any language model.

Drafting (num_steps S, topk K): the first level is the seed's top-k. Each later step feeds the
K best leaves (by cumulative log-probability) through the draft at once, each attending to the
cached prefix, its ancestors and itself (a tree mask; K = 1 is a plain chain), and adds their
top-K children. The `num_draft_tokens - 1` best nodes form the tree: a node never scores above
its parent, so the best nodes always include their ancestors.
"""

from __future__ import annotations

import abc
import heapq

import torch

from pdserve.engine.runtime.attention import AttentionContext
from pdserve.engine.runtime.decode_graphs import DecodeGraphRunner
from pdserve.engine.runtime.forward_batch import ForwardBatch, device_ints
from pdserve.engine.runtime.kv_pool import KVPool
from pdserve.speculative.algorithm import SpeculativeAlgorithm
from pdserve.speculative.draft_graphs import ChainDraftGraphs
from pdserve.speculative.state import DraftState, ExtendItem
from pdserve.speculative.tree import ROOT, DraftTree


class DraftNet(abc.ABC):
    """What drafting needs from a draft model, whatever its kind."""

    model: torch.nn.Module

    @abc.abstractmethod
    def forward(self, ids, positions, features, from_target: bool, kv_pool, ctx) -> torch.Tensor:
        """Recurrent hidden states [T, width] of the new tokens."""

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, draft vocab] float32."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def feature_width(self) -> int:
        """Width of the target features `forward` reads when `from_target` (0: none)."""
        return 0


class DraftModelAlgorithm(SpeculativeAlgorithm):
    """Shared by the built-in draft-model algorithms; a subclass loads its `DraftNet`."""

    offset: int = 0  # see the module docstring

    def load(self, engine) -> None:
        super().load(engine)
        if engine.model_config.sliding_window is not None:
            raise ValueError("speculative decoding with sliding-window attention is not supported")
        self.device, self.dtype = engine.device, engine.dtype
        self.net = self.load_net(engine)
        self.pool: KVPool | None = None
        self.chain_graphs: ChainDraftGraphs | None = None
        self.catch_up_graphs: DecodeGraphRunner | None = None

    @abc.abstractmethod
    def load_net(self, engine) -> DraftNet: ...

    @abc.abstractmethod
    def draft_kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the draft's KV."""

    def draft_page_bytes(self) -> int:
        layers, heads, dim = self.draft_kv_shape()
        return KVPool.bytes_per_page(layers, self.engine.config.page_size, heads, dim, self.dtype)

    def build_pools(self, num_pages: int) -> None:
        layers, heads, dim = self.draft_kv_shape()
        self.pool = KVPool(
            num_layers=layers,
            num_pages=num_pages,
            page_size=self.engine.config.page_size,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=self.dtype,
            device=self.device,
        )

    def draft_pools(self) -> list[KVPool]:
        return [self.pool]

    def build_graphs(self, page_table, max_tokens: int) -> None:
        """Draft from static inputs: chains' draft steps (`ChainDraftGraphs`) and catch-ups
        of at most `num_draft_tokens` tokens per request (after a verification), replayed
        from CUDA graphs on a GPU."""
        self.chain_graphs = self.catch_up_graphs = None
        if not max_tokens:
            return
        carries = self.capabilities.carries_hidden
        cuda = self.device.type == "cuda"
        if self.settings.is_chain and self.settings.num_steps >= 2:
            self.chain_graphs = ChainDraftGraphs(
                self.net,
                self.pool,
                page_table,
                max_tokens,
                self.settings.num_steps,
                self.config.hidden_size if carries else None,
                self.dtype,
                self.device,
            )
            if cuda:
                self.chain_graphs.capture()
        per_seq = self.settings.num_draft_tokens
        rows = max(1, max_tokens // per_seq) * per_seq
        width = self.net.feature_width()
        self._catch_up_features = (
            torch.zeros((rows, width), dtype=self.dtype, device=self.device) if width else None
        )

        topk = self.settings.eagle_topk
        self._catch_up_topk_p = torch.zeros((rows, topk), device=self.device)
        self._catch_up_topk_index = torch.zeros((rows, topk), dtype=torch.int64, device=self.device)

        def forward(ids, positions, ctx):
            features = self._catch_up_features
            features = None if features is None else features[: ids.shape[0]]
            hidden = self.net.forward(ids, positions, features, True, self.pool, ctx)
            # NOTE: every row's next draft input, in the graph (a handful of kernels fewer to
            # launch per step); the rows that end a sequence are picked after the replay.
            topk_p, topk_index = self._next_topk(hidden)
            self._catch_up_topk_p[: ids.shape[0]].copy_(topk_p)
            self._catch_up_topk_index[: ids.shape[0]].copy_(topk_index)
            return hidden, None

        self.catch_up_graphs = DecodeGraphRunner(
            forward,
            self.pool.page_size,
            page_table,
            rows // per_seq,
            self.device,
            hidden_size=self.config.hidden_size,
            dtype=self.dtype,
            tokens_per_seq=per_seq,
        )
        if cuda:
            self.catch_up_graphs.capture(pool=self.chain_graphs.pool if self.chain_graphs else None)

    # ---- catching up -----------------------------------------------------------------

    @torch.inference_mode()
    def extend(self, items: list[ExtendItem]) -> list[DraftState]:
        if not items:
            return []
        batch = ForwardBatch()
        features = []
        for item in items:
            tokens, first = self.extend_tokens(item)
            batch.add(item.request.pages, first, tokens, request=item.request)
            if item.features is not None:
                features.append(item.features)
        graphs = self.catch_up_graphs
        if graphs is not None and graphs.can_run(batch):
            return self._catch_up_from_graph(graphs, batch, features)
        ctx = AttentionContext.build(
            page_size=self.pool.page_size,
            pages=batch.pages,
            num_computed=batch.num_computed,
            query_lens=batch.query_lens,
            device=self.device,
        )
        hidden = self.net.forward(
            device_ints(batch.flat_token_ids(), self.device),
            ctx.positions,
            torch.cat(features) if features else None,
            True,
            self.pool,
            ctx,
        )
        last = [s + n - 1 for s, n in zip(ctx.query_starts, batch.query_lens, strict=True)]
        hidden = hidden.index_select(0, device_ints(last, self.device))
        return self._states(*self._next_topk(hidden), hidden)

    def _catch_up_from_graph(
        self, graphs: DecodeGraphRunner, batch: ForwardBatch, features: list[torch.Tensor]
    ) -> list[DraftState]:
        """The next draft inputs after each sequence's last token, from the catch-up graphs
        (the target features copied into their padded rows first)."""
        per_seq = graphs.tokens_per_seq
        if self._catch_up_features is not None:
            rows = [i * per_seq + r for i, n in enumerate(batch.query_lens) for r in range(n)]
            index = device_ints(rows, self.device)
            self._catch_up_features.index_copy_(0, index, torch.cat(features))
        hidden, _ = graphs.run(batch)
        last = [i * per_seq + n - 1 for i, n in enumerate(batch.query_lens)]
        last = device_ints(last, self.device)
        return self._states(
            self._catch_up_topk_p.index_select(0, last),
            self._catch_up_topk_index.index_select(0, last),
            hidden.index_select(0, last),
        )

    def extend_tokens(self, item: ExtendItem) -> tuple[list[int], int]:
        """The draft's tokens for an extend and the position of the first."""
        return list(item.next_tokens), item.start

    def _next_topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's top-k after each row: probabilities (float32) and target ids."""
        probs = self.net.logits(hidden).softmax(dim=-1)
        topk_p, topk_ids = probs.topk(self.settings.eagle_topk, dim=-1)
        return topk_p.float(), self.net.to_target_ids(topk_ids)

    def _states(self, topk_p, topk_index, hidden) -> list[DraftState]:
        """One draft state per row (rows copied out of any static buffer already)."""
        carries = self.capabilities.carries_hidden
        return [
            DraftState(
                topk_p=topk_p[i], topk_index=topk_index[i], hidden=hidden[i] if carries else None
            )
            for i in range(hidden.shape[0])
        ]

    # ---- proposing -------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list) -> list[DraftTree]:
        if not requests:
            return []
        if self.settings.is_chain:
            drafted = self.propose_on_device(requests)
            if drafted is None:
                drafted = self._draft_chain_eagerly(requests)
            return [DraftTree.chain(row) for row in drafted.tolist()]
        states = [r.draft_state for r in requests]
        tokens = torch.stack([s.topk_index for s in states])  # [B, K]
        scores = torch.stack([s.topk_p for s in states]).clamp_min(1e-30).log()
        hidden = (
            torch.stack([s.hidden for s in states]) if self.capabilities.carries_hidden else None
        )
        return self._propose_tree(requests, tokens, scores, hidden, self._prefix(requests))

    def _prefix(self, requests: list) -> list[int]:
        """Where each request's draft KV ends: the first drafted token's position."""
        return [r.num_computed_tokens + self.offset for r in requests]

    def _chain_seed(self, requests: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each request's first drafted token (the seed's best) and the hidden state it
        carries (None for drafts that carry none)."""
        states = [r.draft_state for r in requests]
        first = torch.stack([s.topk_index[0] for s in states])
        carries = self.capabilities.carries_hidden
        return first, torch.stack([s.hidden for s in states]) if carries else None

    @torch.inference_mode()
    def propose_on_device(self, requests: list) -> torch.Tensor | None:
        """Chains from the chain graphs (or the seed alone, for one step), left on the
        device; None for trees, or a batch the graphs do not hold."""
        steps = self.settings.num_steps
        if not self.settings.is_chain or not requests:
            return None
        graphs = self.chain_graphs
        if steps > 1 and (graphs is None or not graphs.can_run(len(requests))):
            return None
        first, hidden = self._chain_seed(requests)
        if steps == 1:
            return first[:, None]
        drafted = graphs.run(requests, first, hidden, self._prefix(requests))
        return torch.cat([first[:, None], drafted], dim=1)

    def _draft_chain_eagerly(self, requests: list) -> torch.Tensor:
        """`propose_on_device`'s chains, one launch per kernel (no graphs)."""
        token, hidden = self._chain_seed(requests)
        prefix = self._prefix(requests)
        drafted = [token]
        for step in range(1, self.settings.num_steps):
            at = [p + step - 1 for p in prefix]
            ctx = AttentionContext.build(
                page_size=self.pool.page_size,
                pages=[r.pages for r in requests],
                num_computed=at,
                query_lens=[1] * len(requests),
                device=self.device,
            )
            out = self.net.forward(token, ctx.positions, hidden, False, self.pool, ctx)
            token = self.net.to_target_ids(self.net.logits(out).argmax(dim=-1))
            hidden = out
            drafted.append(token)
        return torch.stack(drafted, dim=1)

    def _propose_tree(self, requests, tokens, scores, hidden, prefix) -> list[DraftTree]:
        batch, topk = tokens.shape
        nodes = [_Nodes() for _ in requests]
        token_rows, score_rows = _to_host(tokens, scores)
        frontier = []  # per request: the node ids being fed this step
        for b in range(batch):
            frontier.append(
                [
                    nodes[b].add(t, ROOT, s)
                    for t, s in zip(token_rows[b], score_rows[b], strict=True)
                ]
            )
        fed: list[list[int]] = [[] for _ in requests]  # node ids in draft-KV slot order
        if hidden is not None:
            hidden = hidden[:, None, :].expand(batch, topk, hidden.shape[-1])
        for step in range(1, self.settings.num_steps):
            masks = {}
            for b in range(batch):
                masks[b] = _feed_mask(nodes[b], fed[b], frontier[b])
            starts = [prefix[b] + len(fed[b]) for b in range(batch)]
            depth_position = [[prefix[b] + step - 1] * topk for b in range(batch)]
            for b in range(batch):
                fed[b].extend(frontier[b])
            ctx = AttentionContext.build(
                page_size=self.pool.page_size,
                pages=[r.pages for r in requests],
                num_computed=starts,
                query_lens=[topk] * batch,
                device=self.device,
                positions=depth_position,
                masks=masks,
            )
            flat_hidden = None if hidden is None else hidden.reshape(batch * topk, -1)
            out = self.net.forward(
                tokens.reshape(-1), ctx.positions, flat_hidden, False, self.pool, ctx
            )
            logp = self.net.logits(out).log_softmax(dim=-1)
            child_lp, child_ids = logp.topk(topk, dim=-1)  # [B*K, K]
            child_ids = self.net.to_target_ids(child_ids).view(batch, topk * topk)
            child_scores = (scores[:, :, None] + child_lp.view(batch, topk, topk)).view(batch, -1)
            best = child_scores.topk(topk, dim=-1).indices  # [B, K] into the K*K children
            ids_rows, score_rows, best_rows = _to_host(child_ids, child_scores, best)
            new_frontier = []
            for b in range(batch):
                children = [
                    nodes[b].add(ids_rows[b][c], frontier[b][c // topk], score_rows[b][c])
                    for c in range(topk * topk)
                ]
                new_frontier.append([children[c] for c in best_rows[b]])
            frontier = new_frontier
            tokens = child_ids.gather(1, best)
            scores = child_scores.gather(1, best)
            if hidden is not None:
                parents = (best // topk)[:, :, None].expand(batch, topk, out.shape[-1])
                hidden = out.view(batch, topk, -1).gather(1, parents)
        size = self.settings.num_draft_tokens - 1
        return [n.best_tree(size) for n in nodes]


def _to_host(*rows: torch.Tensor) -> list[list[list[int | float]]]:
    """`[B, n]` tensors as nested lists, in one copy (one wait for the GPU, not one per
    tensor): float64 holds token ids and float32 scores exactly."""
    widths = [r.shape[1] for r in rows]
    packed = torch.cat([r.double() for r in rows], dim=1).tolist()
    out, start = [], 0
    for r, width in zip(rows, widths, strict=True):
        part = [row[start : start + width] for row in packed]
        if not r.dtype.is_floating_point:
            part = [[int(v) for v in row] for row in part]
        out.append(part)
        start += width
    return out


class _Nodes:
    """Host-side bookkeeping of one request's drafted nodes."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depths: list[int] = []

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def ancestors_and_self(self, node: int) -> set[int]:
        found = set()
        while node != ROOT:
            found.add(node)
            node = self.parents[node]
        return found

    def best_tree(self, size: int) -> DraftTree:
        # NOTE: scores never rise along a path, and ties go to the shallower node, so the
        # chosen set contains every chosen node's ancestors.
        chosen = heapq.nsmallest(
            size, range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i)
        )
        chosen.sort(key=lambda i: (self.depths[i], i))
        index = {old: new for new, old in enumerate(chosen)}
        parents = [ROOT if self.parents[i] == ROOT else index[self.parents[i]] for i in chosen]
        return DraftTree([self.tokens[i] for i in chosen], parents)


def _feed_mask(nodes: _Nodes, fed: list[int], frontier: list[int]) -> torch.Tensor:
    """[K, fed + K] over the keys after the cached prefix (which every node sees): the fed
    ancestors, and the node itself."""
    mask = torch.zeros(len(frontier), len(fed) + len(frontier), dtype=torch.bool)
    slot_of = {node: i for i, node in enumerate([*fed, *frontier])}
    for row, node in enumerate(frontier):
        for ancestor in nodes.ancestors_and_self(node):
            if ancestor in slot_of:
                mask[row, slot_of[ancestor]] = True
    mask[range(len(frontier)), [len(fed) + i for i in range(len(frontier))]] = True
    return mask
