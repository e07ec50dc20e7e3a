"""Offline generation: `LLM(model_path).generate(prompts, SamplingParams(...))`.

It composes an engine with the speculator its settings ask for, as the CLI and the engine
process do, so it sits above both `engine/` and `speculative/`.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

from tqdm import tqdm

from pdserve.engine.checkpoint.model_files import refuse_remote_code, resolve_model_dir
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.text.detokenizer import RequestDetokenizer
from pdserve.speculative.speculator import build_speculator

Prompt = str | Sequence[int]


class LLM:
    """Batch generation on one device (or `tp_size` of them: `close()` them, or use `with`).
    `model_path` is a model directory, a `.gguf` file or a Hugging Face hub id (at
    `revision`); other keyword arguments are `EngineConfig` fields."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        revision: str | None = None,
        trust_remote_code: bool = False,
        **engine_options,
    ):
        if trust_remote_code:
            refuse_remote_code()
        if model_path is None:
            from pdserve.synthetic.tiny_model import default_model_dir

            model_dir = default_model_dir()
        else:
            model_dir = resolve_model_dir(str(model_path), revision)
        self._start(EngineConfig(model_path=str(model_dir), **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = Engine(config, build_speculator(config.speculative))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (`tp_size` > 1); they are also
        stopped when this process exits."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts at once (continuous batching); outputs in prompt order.

        A prompt is a string or a list of token ids. `sampling_params` is one for all prompts
        or one per prompt. An invalid prompt raises before anything is queued.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        # NOTE: validate every prompt before queueing any, so a bad one leaves nothing behind.
        token_ids = [self.engine.validate_prompt(prompt) for prompt in prompts]
        for params in sampling_params:
            params.check_vocab(self.engine.model_config.vocab_size)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        # NOTE: the engine reports ids; text is made here as a worker's front end makes it
        # for clients (same detokenizer, fed the same outputs), so both read the same.
        detokenizers: dict[str, RequestDetokenizer] = {}
        for request_id, ids_of_prompt, params in zip(ids, token_ids, sampling_params, strict=True):
            self.engine.add_request(request_id, ids_of_prompt, params)
            detokenizers[request_id] = RequestDetokenizer(self.tokenizer, ids_of_prompt, params)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(prompts), desc="Generating", disable=not show)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                if not output.finished or output.request_id not in detokenizers:
                    continue  # not done yet, or queued on the engine by someone else
                # NOTE: text is made once a request finishes, off the per-step path.
                detokenizer = detokenizers.pop(output.request_id)
                detokenizer.take_output(output.token_ids, finished=True)
                output.text = detokenizer.text
                final[output.request_id] = output
                bar.update(1)
        bar.close()
        results = [final[i] for i in ids]
        for prompt, output in zip(prompts, results, strict=True):
            if isinstance(prompt, str):
                output.prompt = prompt
        return results


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # a single prompt given as token ids
    return prompts
