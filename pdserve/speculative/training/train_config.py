"""`pdserve train-eagle`'s settings; each field declares its flag. Torch-free, so the command
line can be built without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.flags import option


@dataclass(frozen=True)
class TrainConfig:
    model_path: str = option(help="the target model directory", required=True)
    out_dir: str = option(help="where to write the draft directory", name="--out", required=True)
    prompts_file: str | None = option(
        None,
        'JSONL of prompts, one per line: {"messages": [...]} (the chat template is applied) '
        'or {"prompt": "text"}; answers end at EOS (default: random token prompts)',
    )
    num_sequences: int = option(
        256, "prompts the target answers to train on (with --prompts-file: its first N)"
    )
    answers_per_prompt: int = option(
        1,
        "answers the target gives each prompt: the first greedy, the others sampled "
        "(temperature 0.8); the labels are always the target's greedy choices",
    )
    sequences_file: str | None = option(
        None,
        "a .safetensors file of generated prompts + answers: read instead of generating when "
        "it exists, written after generating when it does not",
    )
    prompt_len: int = option(16, "random prompt tokens (without --prompts-file)")
    gen_len: int = option(112, "tokens generated per prompt (at most, with --prompts-file)")
    steps: int = option(1500, "optimizer steps (0: only generate sequences, into --sequences-file)")
    batch_size: int = option(16, "sequences per optimizer step")
    lr: float = option(1e-3, "learning rate")
    ttt_steps: int = option(4, "training-time-test unroll (draft steps)")
    aux_layer_ids: tuple[int, ...] | None = option(
        None, "target layers the head reads (default [2, L // 2, L - 3])", name="--aux-layers"
    )
    draft_vocab_size: int = option(
        4096, "the head predicts the most frequent target tokens only (d2t maps them)"
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto, float32, bfloat16 or float16")
    seed: int = option(0, "seed for prompts, data order and initial weights")
    eval_fraction: float = 0.1

    def __post_init__(self) -> None:
        positive = ("num_sequences", "prompt_len", "gen_len", "batch_size")
        for name in (*positive, "answers_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.steps < 0:
            raise ValueError("steps must be at least 0")
        if self.steps == 0 and self.sequences_file is None:
            raise ValueError("steps 0 only generates sequences: name --sequences-file to keep them")
        if not 1 <= self.ttt_steps <= 16:
            raise ValueError("ttt-steps must be in [1, 16]")
        if self.num_sequences < 2:
            raise ValueError("num-sequences must be at least 2 (one is held out)")
