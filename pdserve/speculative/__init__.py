"""Speculative decoding (docs/architecture/metadata.md): a draft proposes tokens, the target
verifies them in one forward pass, and lossless verification keeps the output exactly the target's
(greedy) or distributed exactly as the target's (sampling).

- `algorithm.py`: what an algorithm is (capabilities, config-only sizing, the hooks);
  `registry.py`: built-ins and plugins by name.
- `ngram.py`, `eagle.py` (EAGLE, EAGLE3), `standalone.py`; `draft_model.py`: what the
  draft-model algorithms share (draft KV, catching up, chain and tree drafting).
- `tree.py`: draft trees; `verify.py`: lossless verification; `state.py`: per-request draft
  state and the disaggregation hook's batch.
- `speculator.py`: the engine's speculator over one algorithm (`build_speculator`): drafts,
  verifies in the engine's forward pass, catches the draft up; `train_eagle.py`:
  `pdserve train-eagle`; `checkpoints.py`: writing EAGLE draft checkpoints.
"""
