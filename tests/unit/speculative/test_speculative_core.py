"""Speculative decoding's core pieces (issue 6, first part): the algorithm registry and its
refusals, buffer sizing from configs alone, NGRAM proposals, and lossless verification
(greedy exactness; the tree sampling verifier's output distribution against the target's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
import torch

from pdserve.speculative import registry
from pdserve.speculative.algorithm import (
    Capabilities,
    SpecSettings,
    SpeculativeAlgorithm,
    SpeculativeConfigError,
)
from pdserve.speculative.ngram import propose_ngram, propose_ngram_tree
from pdserve.speculative.tree import ROOT, DraftTree
from pdserve.speculative.verify import accept_greedy, accept_sampling

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


EAGLE_LIKE = Capabilities(has_draft_kv=True, carries_hidden=True, seeds_topk=True)


class _Plugin(SpeculativeAlgorithm):
    name: ClassVar[str] = "TEST_PLUGIN"
    capabilities: ClassVar[Capabilities] = EAGLE_LIKE

    def propose(self, requests):
        return [DraftTree.empty() for _ in requests]

    def build_disagg_draft_input(self, batch, last_tokens, records):
        if not records:
            raise ValueError("empty batch")
        return [r.hidden_states for r in records]


@pytest.fixture
def plugin():
    registry.register(_Plugin)
    yield _Plugin
    registry.unregister(_Plugin.name)


def test_a_decorated_plugin_is_found_by_name(plugin):
    assert registry.get("TEST_PLUGIN") is plugin
    assert "TEST_PLUGIN" in registry.names()


def test_registration_refuses_what_cannot_work(plugin):
    with pytest.raises(registry.RegistrationError, match="is registered"):
        registry.register(plugin)

    class Reserved(_Plugin):
        name = "EAGLE"

    with pytest.raises(registry.RegistrationError, match="reserved"):
        registry.register(Reserved)

    class NoHook(SpeculativeAlgorithm):
        name = "NO_HOOK"
        capabilities = EAGLE_LIKE

    with pytest.raises(registry.RegistrationError, match="build_disagg_draft_input"):
        registry.register(NoHook)

    class NoPropose(SpeculativeAlgorithm):
        name = "NO_PROPOSE"
        capabilities = EAGLE_LIKE

        def build_disagg_draft_input(self, batch, last_tokens, records):
            return []

    with pytest.raises(registry.RegistrationError, match="does not implement propose"):
        registry.register(NoPropose)

    class NoCapabilities(_Plugin):
        name = "NO_CAPS"
        capabilities = None

    with pytest.raises(registry.RegistrationError, match="capabilities"):
        registry.register(NoCapabilities)
    with pytest.raises(registry.RegistrationError, match="not a SpeculativeAlgorithm"):
        registry.register(dict)
    with pytest.raises(registry.UnknownAlgorithm, match="NOPE"):
        registry.get("NOPE")


def test_buffers_are_sized_from_the_draft_config_alone(plugin):
    algorithm = plugin(
        SpecSettings("TEST_PLUGIN", "draft", num_steps=3, eagle_topk=4, num_draft_tokens=8)
    )
    spec = algorithm.metadata_spec({"hidden_size": 32}, "bfloat16")
    assert (spec.topk, spec.hidden_size, spec.hidden_dtype) == (4, 32, "bfloat16")
    # hc_mult = 2 doubles the width that crosses prefill -> decode.
    assert algorithm.metadata_spec({"hidden_size": 32, "hc_mult": 2}, "bfloat16").hidden_size == 64
    with pytest.raises(SpeculativeConfigError, match="draft-model-path"):
        algorithm.metadata_spec(None, "bfloat16")


def test_an_algorithm_without_hidden_state_carries_none():
    class Standalone(_Plugin):
        name = "TEST_STANDALONE"
        capabilities = Capabilities(has_draft_kv=True, carries_hidden=False, seeds_topk=True)

    spec = Standalone(SpecSettings("TEST_STANDALONE", "draft")).metadata_spec(
        {"hidden_size": 32}, "bf16"
    )
    assert spec.hidden_size is None and spec.hidden_dtype is None and spec.topk == 1


def test_settings_name_the_bad_flag():
    with pytest.raises(SpeculativeConfigError, match="num-steps"):
        SpecSettings("EAGLE", num_steps=0)
    with pytest.raises(SpeculativeConfigError, match="eagle-topk"):
        SpecSettings("EAGLE", eagle_topk=17)
    with pytest.raises(SpeculativeConfigError, match="num-draft-tokens must be"):
        SpecSettings("EAGLE", num_steps=3, eagle_topk=1, num_draft_tokens=3)


def test_ngram_proposes_what_followed_the_latest_repeat_of_the_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, num_draft=2) == [7, 8]  # latest earlier [1, 2, 3]
    assert propose_ngram([4, 5, 6], num_draft=3) == []
    assert propose_ngram([5, 5, 5], num_draft=4) == [5]
    with pytest.raises(ValueError):
        propose_ngram(tokens, num_draft=0)


def test_greedy_verification_keeps_exactly_the_targets_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5, 11, generator=generator)
    target = logits.argmax(-1)
    draft = target[:, :4].clone()
    # Corrupt each row's draft from a random position on (or not at all).
    cut = torch.randint(0, 5, (64,), generator=generator)
    for row, position in enumerate(cut.tolist()):
        if position < 4:
            draft[row, position] = (draft[row, position] + 1) % 11
    results = [
        accept_greedy(DraftTree.chain(row), choices)
        for row, choices in zip(draft.tolist(), target.tolist(), strict=True)
    ]
    accepted = [len(path) for path, _ in results]
    next_token = [bonus for _, bonus in results]
    assert accepted == cut.tolist()
    assert next_token == target[torch.arange(64), cut].tolist()


def test_builtins_are_registered_and_cannot_be_unregistered():
    assert {"EAGLE", "EAGLE3", "STANDALONE", "NGRAM"} <= set(registry.names())
    with pytest.raises(registry.RegistrationError, match="built-in"):
        registry.unregister("EAGLE")


def test_settings_refuse_more_draft_tokens_than_the_tree_holds():
    assert SpecSettings("X", num_steps=3, eagle_topk=2, num_draft_tokens=11).tree_capacity == 10
    with pytest.raises(SpeculativeConfigError, match="more than the 10 draft tokens"):
        SpecSettings("X", num_steps=3, eagle_topk=2, num_draft_tokens=12)


def test_draft_trees_know_depths_masks_and_truncation():
    tree = DraftTree([7, 8, 9, 5], [ROOT, ROOT, 0, 2])
    assert tree.depths == [1, 1, 2, 3] and not tree.is_chain
    mask = tree.attention_mask()
    assert mask[4] == [True, True, False, True, True]  # node 3: root, 0, 2, itself
    assert mask[2] == [True, False, True, False, False]
    assert tree.truncated(2) == DraftTree([7, 8, 9], [ROOT, ROOT, 0])
    assert tree.path_tokens(3) == [7, 9, 5]
    assert DraftTree.chain([4, 5, 6]).is_chain
    with pytest.raises(ValueError, match="parents come first"):
        DraftTree([1, 2], [1, ROOT])


def test_ngram_tree_merges_distinct_continuations_into_a_trie():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    tree = propose_ngram_tree(tokens, depth=2, topk=3, max_nodes=8)
    paths = {tuple(tree.path_tokens(i)) for i in range(len(tree)) if not tree.children(i)}
    assert paths == {(3, 5), (4, 1), (3, 1)}
    assert tree.tokens[:1] == [3] and len(tree.children(ROOT)) == 2  # 3 is shared
    assert len(propose_ngram_tree(tokens, depth=2, topk=3, max_nodes=2)) == 2


def test_tree_greedy_acceptance_follows_the_targets_choices():
    tree = DraftTree([7, 8, 9, 5], [ROOT, ROOT, 1, 2])
    # rows: root, node0, node1, node2, node3; the target picks 8 at the root, then 9, then 6.
    choices = [8, 0, 9, 6, 0]
    assert accept_greedy(tree, choices) == ([1, 2], 6)
    assert accept_greedy(tree, [3, 0, 0, 0, 0]) == ([], 3)
    assert accept_greedy(tree, [8, 0, 9, 5, 4]) == ([1, 2, 3], 4)


def test_tree_sampling_verifier_emits_the_target_distribution():
    """Point-mass proposals (three siblings at the root, one grandchild) against a fixed p at
    every row: the first and second emitted tokens must each be p-distributed (total
    variation < 0.01 over 1e5 draws)."""
    vocab, draws = 6, 100_000
    generator = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
    tree = DraftTree([2, 0, 4, 2], [ROOT, ROOT, ROOT, 0])
    first, second = torch.empty(draws, dtype=torch.long), torch.empty(draws, dtype=torch.long)
    for i in range(draws):
        path, bonus = accept_sampling(tree, lambda row: p, generator)
        emitted = [tree.tokens[n] for n in path] + [bonus]
        if len(emitted) == 1:  # the next round starts afresh from the same p
            path, bonus = accept_sampling(tree, lambda row: p, generator)
            emitted += [tree.tokens[n] for n in path] + [bonus]
        first[i], second[i] = emitted[0], emitted[1]

    def tv(tokens) -> float:
        empirical = torch.bincount(tokens, minlength=vocab).double() / draws
        return 0.5 * (empirical - p.double()).abs().sum().item()

    assert tv(first) < 0.01
    assert tv(second) < 0.01


def test_a_plugin_registers_through_the_entry_point_group(tmp_path):
    """An installed distribution naming its class in the `pdserve.speculative` group is found
    by name; one whose entry point name disagrees with the class is refused."""
    (tmp_path / "my_plugin.py").write_text(
        textwrap.dedent(
            """
            from pdserve.speculative.algorithm import Capabilities, SpeculativeAlgorithm
            from pdserve.speculative.tree import DraftTree

            class MyDraft(SpeculativeAlgorithm):
                name = "MY_DRAFT"
                capabilities = Capabilities(False, False, False)

                def propose(self, requests):
                    return [DraftTree.empty() for _ in requests]

                def build_disagg_draft_input(self, batch, last_tokens, records):
                    return [None for _ in records]
            """
        )
    )
    info = tmp_path / "my_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pdserve.speculative]\nMY_DRAFT = my_plugin:MyDraft\n")
    code = (
        "from pdserve.speculative import registry; "
        "print(registry.get('MY_DRAFT').__module__, 'MY_DRAFT' in registry.names())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["my_plugin", "True"]
    (info / "entry_points.txt").write_text("[pdserve.speculative]\nOTHER = my_plugin:MyDraft\n")
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode != 0 and "they must match" in done.stderr
