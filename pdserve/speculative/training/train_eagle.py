"""`pdserve train-eagle`: train an EAGLE-3 draft head for a target on the target's own
generations, and write a draft directory the server loads.

1. Generate: prompts (a JSONL file of chat or text prompts, or random tokens), answered by
   the target (pdserve's engine): greedily, and with more sampled answers per prompt if
   asked; a chat answer ends at EOS. A sequences file keeps what was generated, so a later
   run (other training settings, or the next part of a job) starts from it.
2. Capture: one target forward over each sequence keeps the outputs of the capture layers
   (the EAGLE-3 features) and the target's own next-token choice at every position (labels).
   Only the answer's labels are learned: drafting starts after the prompt.
3. Train with training-time test (TTT), as EAGLE-3 does: the draft is unrolled `ttt_steps`
   times. At unroll step j, position q reads the token x_{q+1} and, for j = 0, the target's
   features at q; for j > 0, its own step j-1 output at q - 1 (what it reads while drafting).
   It attends to step-0 keys up to q - j (where the target's features were real) and to one
   key of each later step along its own draft path. Every step learns the target's token
   after x_{q+1}; later steps weigh 0.8^j.
4. Save: `config.json` (LlamaForCausalLMEagle3, the capture layers, a draft vocabulary of the
   most frequent label tokens with its d2t map) and `model.safetensors`; the embedding is the
   target's, shared at load time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from pdserve.engine.checkpoint.model_files import resolve_model_dir
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.runtime.forward_batch import Capture, ForwardBatch
from pdserve.engine.text.chat_template import chat_prompt_ids
from pdserve.speculative.checkpoints import build_draft_model, eagle_draft_config, save_draft
from pdserve.speculative.training.train_config import TrainConfig

logger = logging.getLogger(__name__)

STEP_DECAY = 0.8
SAMPLE_TEMPERATURE = 0.8  # answers after a prompt's first (greedy) one
GENERATE_CONCURRENCY = 1024  # answers generated together (the engine's default is 256)


@dataclass
class TrainReport:
    out_dir: Path  # the draft; the sequences file when only generating (steps 0)
    train_seconds: float
    final_loss: float
    eval_accuracy: list[float]  # per unroll step, on held-out sequences


def train_eagle(config: TrainConfig) -> TrainReport:
    torch.manual_seed(config.seed)
    prompts, stored = None, None
    if config.sequences_file is not None and Path(config.sequences_file).is_file():
        stored = load_sequences(config.sequences_file)
        max_len = stored.tokens.shape[1] + 8
    else:
        if config.prompts_file is not None:
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.model_path))
            prompts = read_prompts_file(config.prompts_file, tokenizer, config.num_sequences)
            if len(prompts) < 2:
                raise ValueError(
                    f"{config.prompts_file}: need at least 2 prompts (one is held out)"
                )
        prompt_len = max(map(len, prompts)) if prompts else config.prompt_len
        max_len = prompt_len + config.gen_len + 8
    engine = Engine(
        EngineConfig(
            config.model_path,
            device=config.device,
            dtype=config.dtype,
            max_model_len=max_len,
            seed=config.seed,
            max_running_requests=GENERATE_CONCURRENCY,
        )
    )
    target = engine.model_config
    aux = config.aux_layer_ids or _default_aux(target.num_layers)
    sequences = _sequences(engine, config, stored, prompts)
    if config.steps == 0:
        return TrainReport(Path(config.sequences_file), 0.0, float("nan"), [])
    features, labels = _capture(engine, sequences.tokens, tuple(aux))
    labels = _answer_labels_only(labels, sequences)
    draft_vocab = _draft_vocabulary(labels, min(config.draft_vocab_size, target.vocab_size))
    learned = labels[labels >= 0]
    covered = torch.isin(learned, draft_vocab.to(learned.device)).float().mean()
    logger.info(
        "draft vocabulary: %d tokens, %.1f%% of the answer tokens", len(draft_vocab), 100 * covered
    )
    draft_config = eagle_draft_config(
        target,
        aux_layer_ids=list(aux),
        draft_vocab_size=len(draft_vocab),
        num_kv_heads=target.num_kv_heads,
        intermediate_size=target.intermediate_size,
    )
    device = engine.device
    model = build_draft_model(draft_config, target, max_len)
    model = model.to(device)
    _initialize_from_target(model, engine.model, draft_vocab)
    draft_labels = _to_draft_ids(labels, draft_vocab, target.vocab_size)
    tokens = sequences.tokens
    # NOTE: held out by whole prompts, so no answer to a held-out prompt is trained on.
    held_prompts = max(1, int(len(tokens) // sequences.answers_per_prompt * config.eval_fraction))
    split = held_prompts * sequences.answers_per_prompt
    train = (tokens[split:], features[split:], draft_labels[split:])
    held_out = (tokens[:split], features[:split], draft_labels[:split])
    started = time.perf_counter()
    final_loss = _train(model, train, config)
    seconds = time.perf_counter() - started
    accuracy = _evaluate(model, held_out, config.ttt_steps)
    logger.info("held-out accuracy per unroll step: %s", [f"{a:.3f}" for a in accuracy])
    out = save_draft(model.float().cpu(), draft_config, config.out_dir, include_embeddings=False)
    return TrainReport(out, seconds, final_loss, accuracy)


def _default_aux(num_layers: int) -> list[int]:
    ids = [2, num_layers // 2, num_layers - 3]
    if all(0 <= i < num_layers for i in ids):
        return ids
    return sorted({0, num_layers // 2, num_layers - 1})


@dataclass
class Sequences:
    """Prompts and the target's answers, right-padded to one length; the answers to one
    prompt are consecutive rows."""

    tokens: torch.Tensor  # [N, T]
    answer_starts: list[int]  # where each row's answer begins (its prompt length)
    lengths: list[int]  # each row's real tokens
    answers_per_prompt: int = 1

    def checked(self, vocab_size: int, source: str) -> Sequences:
        """These sequences, after checking they fit a target of `vocab_size` tokens."""
        rows = len(self.tokens)
        problem = None
        if self.tokens.dim() != 2 or len(self.answer_starts) != rows or len(self.lengths) != rows:
            problem = "tokens, answer starts and lengths disagree on the number of rows"
        elif rows < 2 * self.answers_per_prompt or rows % self.answers_per_prompt:
            problem = f"{rows} rows for {self.answers_per_prompt} answers per prompt"
        elif int(self.tokens.min()) < 0 or int(self.tokens.max()) >= vocab_size:
            problem = f"token ids outside the target's vocabulary of {vocab_size}"
        elif any(
            not 0 < start < length <= self.tokens.shape[1]
            for start, length in zip(self.answer_starts, self.lengths, strict=True)
        ):
            problem = "an answer start or length outside its row"
        if problem is not None:
            raise ValueError(f"{source}: not sequences for this target: {problem}")
        return self


def save_sequences(sequences: Sequences, path: str | Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "tokens": sequences.tokens.to(torch.int32).contiguous(),
            "answer_starts": torch.tensor(sequences.answer_starts),
            "lengths": torch.tensor(sequences.lengths),
        },
        str(path),
        metadata={"answers_per_prompt": str(sequences.answers_per_prompt)},
    )
    logger.info("wrote %d sequences to %s", len(sequences.tokens), path)


def load_sequences(path: str | Path) -> Sequences:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as stored:
            answers = int((stored.metadata() or {}).get("answers_per_prompt", "1"))
            tensors = {name: stored.get_tensor(name) for name in stored.keys()}  # noqa: SIM118
        return Sequences(
            tensors["tokens"].long(),
            tensors["answer_starts"].tolist(),
            tensors["lengths"].tolist(),
            answers,
        )
    except (KeyError, ValueError, OSError, SafetensorError) as e:
        raise ValueError(f"{path}: not a sequences file written by train-eagle ({e})") from None


def read_prompts_file(path: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of the prompts of a JSONL file (the first `limit`): each line is
    {"messages": [...]} (rendered with the chat template, as the chat endpoint renders it)
    or {"prompt": "text"}."""
    prompts: list[list[int]] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number}: not JSON ({e.msg})") from None
            if isinstance(record, dict) and isinstance(record.get("messages"), list):
                prompts.append(chat_prompt_ids(tokenizer, record["messages"]))
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                prompts.append(tokenizer.encode(record["prompt"]))
            else:
                raise ValueError(
                    f'{path} line {number}: expected {{"messages": [...]}} or {{"prompt": "..."}}'
                )
            if len(prompts) == limit:
                break
    return prompts


def _sequences(
    engine: Engine, config: TrainConfig, stored: Sequences | None, prompts: list[list[int]] | None
) -> Sequences:
    """The stored sequences, checked against the target; else the target's answers to the
    prompts (random ones without a prompts file), stored when a sequences file is named."""
    if stored is not None:
        return stored.checked(engine.model_config.vocab_size, config.sequences_file)
    real_prompts = prompts is not None
    if prompts is None:
        prompts = _random_prompts(engine, config)
    sequences = _generate(
        engine, prompts, config.gen_len, config.answers_per_prompt, stop_at_eos=real_prompts
    )
    if config.sequences_file is not None:
        save_sequences(sequences, config.sequences_file)
    return sequences


def _random_prompts(engine: Engine, config: TrainConfig) -> list[list[int]]:
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    generator = torch.Generator().manual_seed(config.seed)
    shape = (config.num_sequences, config.prompt_len)
    return torch.randint(3, vocab, shape, generator=generator).tolist()


def _generate(
    engine: Engine,
    prompts: list[list[int]],
    gen_len: int,
    answers_per_prompt: int,
    *,
    stop_at_eos: bool,
) -> Sequences:
    """The target's answers to `prompts`, `gen_len` tokens at most: up to EOS after a real
    prompt, always `gen_len` after a random one (random text has no end). The first answer
    to a prompt is greedy, the others sampled (seeded), so the head also sees contexts off
    the greedy path; its labels stay the target's greedy choices either way."""
    greedy = SamplingParams(max_new_tokens=gen_len, temperature=0, ignore_eos=not stop_at_eos)
    started = time.perf_counter()
    keys = [(i, k) for i in range(len(prompts)) for k in range(answers_per_prompt)]
    for i, k in keys:
        params = greedy
        if k > 0:
            seed = i * answers_per_prompt + k
            params = dataclasses.replace(greedy, temperature=SAMPLE_TEMPERATURE, seed=seed)
        engine.add_request(f"train-{i}-{k}", prompts[i], params)
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                answers[output.request_id] = output.token_ids
    rows = [prompts[i] + answers[f"train-{i}-{k}"] for i, k in keys]
    lengths = [len(row) for row in rows]
    width = max(lengths)
    logger.info(
        "generated %d answers (%d tokens) in %.1f s",
        len(rows),
        sum(lengths) - sum(len(prompts[i]) for i, _ in keys),
        time.perf_counter() - started,
    )
    # NOTE: padding only follows a row's real tokens, so (attention being causal) it changes
    # no feature or label of theirs; its labels are masked out.
    tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    return Sequences(tokens, [len(prompts[i]) for i, _ in keys], lengths, answers_per_prompt)


def _answer_labels_only(labels: torch.Tensor, sequences: Sequences) -> torch.Tensor:
    """Labels (the target's token after each position) kept where drafting happens: from
    the prompt's end (the first drafted token follows the first answer token) to the last
    real token (the token after it is never drafted); -100 elsewhere."""
    labels = labels.clone()
    for row, (start, length) in enumerate(
        zip(sequences.answer_starts, sequences.lengths, strict=True)
    ):
        labels[row, :start] = -100
        labels[row, length - 1 :] = -100
    return labels


@torch.inference_mode()
def _capture(engine, sequences: torch.Tensor, aux: tuple[int, ...]):
    """Target features [N, T, num_aux x hidden] and the target's next token at every
    position [N, T] (on the device), a few sequences per forward pass. The features stay in
    host memory: they outgrow what the target's KV pool leaves of a GPU. On a GPU they are
    pinned, so each training batch copies up quickly, and kept in bfloat16, the precision
    the draft reads them in under autocast."""
    count, length = sequences.shape
    per_pass = max(1, 4096 // length)
    cuda = engine.device.type == "cuda"
    features = None
    labels = []
    for start in range(0, count, per_pass):
        chunk = sequences[start : start + per_pass]
        pages = [engine.reserve_pages(length) for _ in chunk]
        if None in pages:
            raise RuntimeError(f"the KV pool cannot hold {len(chunk)} sequences of {length}")
        try:
            inputs = ForwardBatch()
            for tokens, pages_of_row in zip(chunk.tolist(), pages, strict=True):
                inputs.add(pages_of_row, 0, tokens)
            output = engine.runner.forward(inputs, Capture.layers(aux))
            hidden, captured = output.hidden, output.features
            labels.append(engine.model.compute_logits(hidden).argmax(-1).view(len(chunk), length))
            if features is None:
                dtype = torch.bfloat16 if cuda else captured.dtype
                shape = (count, length, captured.shape[-1])
                features = torch.empty(shape, dtype=dtype, pin_memory=cuda)
            features[start : start + len(chunk)].copy_(captured.view(len(chunk), length, -1))
        finally:
            for p in pages:
                if p is not None:
                    engine.free_pages(p)
    return features, torch.cat(labels)


def _draft_vocabulary(labels: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent label tokens, sorted (d2t needs draft ids in target order)."""
    labels = labels.flatten().cpu()
    counts = torch.bincount(labels[labels >= 0])
    size = min(size, int((counts > 0).sum()))
    return counts.topk(size).indices.sort().values


def _to_draft_ids(labels: torch.Tensor, draft_vocab: torch.Tensor, vocab: int) -> torch.Tensor:
    """Labels in draft ids; -100 (not learned) for masked labels and tokens outside the
    draft vocabulary."""
    table = torch.full((vocab + 1,), -100, dtype=torch.int64)
    table[draft_vocab] = torch.arange(len(draft_vocab))
    # NOTE: a masked label (-100) reads the table's last entry, which stays -100.
    return table.to(labels.device)[labels.clamp(min=-1)]


@torch.no_grad()
def _initialize_from_target(model, target_model, draft_vocab: torch.Tensor) -> None:
    device = model.lm_head.weight.device
    model.embed_tokens.weight.copy_(target_model.model.embed_tokens.weight.float())
    model.embed_tokens.weight.requires_grad_(False)
    head = target_model.lm_head.weight
    model.lm_head.weight.copy_(head[draft_vocab.to(head.device)].float().to(device))
    if model.d2t is not None:
        model.d2t.copy_((draft_vocab - torch.arange(len(draft_vocab))).to(device))


def ttt_logits(model, tokens: torch.Tensor, features: torch.Tensor, steps: int):
    """Unrolled draft logits [steps, B, T - 1, draft vocab]; position q reads x_{q+1}."""
    layer = model.layers[0]
    attn = layer.self_attn
    batch, length = tokens.shape[0], tokens.shape[1] - 1
    embeds = layer.input_layernorm(model.embed_tokens(tokens[:, 1:]))
    hidden = model._fuse_aux(features[:, :-1].float())
    positions = torch.arange(length, device=tokens.device)
    keys, values, logits = [], [], []
    for step in range(steps):
        x = torch.cat([embeds, layer.hidden_norm(hidden)], dim=-1)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(batch * length, attn.num_heads, attn.head_dim)
        k = k.reshape(batch * length, attn.num_kv_heads, attn.head_dim)
        q, k = attn.rotary(positions.repeat(batch), q, k)
        keys.append(k.view(batch, length, attn.num_kv_heads, attn.head_dim))
        values.append(v.view(batch, length, attn.num_kv_heads, attn.head_dim))
        out = _attend(q.view(batch, length, attn.num_heads, attn.head_dim), keys, values, step)
        h = hidden + attn.o_proj(out.reshape(batch, length, attn.q_size))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(model.compute_logits(h))
        # Next unroll step: position q reads this step's output at q - 1.
        hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
    return torch.stack(logits)


def _attend(q, keys, values, step: int):
    """q [B, L, heads, D] against every unroll step's keys, TTT-masked."""
    _, length, heads, _ = q.shape
    kv_heads = keys[0].shape[2]
    k = torch.cat(keys, dim=1).repeat_interleave(heads // kv_heads, dim=2)
    v = torch.cat(values, dim=1).repeat_interleave(heads // kv_heads, dim=2)
    query_pos = torch.arange(length, device=q.device)[:, None]
    key_pos = torch.arange(length, device=q.device)[None, :]
    blocks = [key_pos <= query_pos - step]  # step 0: real features up to the anchor
    blocks += [key_pos == query_pos - step + s for s in range(1, step + 1)]
    mask = torch.cat(blocks, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)


def _loss(model, tokens, features, labels, steps: int) -> torch.Tensor:
    logits = ttt_logits(model, tokens, features, steps)
    total, weight = 0.0, 0.0
    length = tokens.shape[1] - 1
    for step in range(steps):
        # Position q learns the target's token after x_{q+1}: labels[q + 1]; at unroll step
        # j it needs an anchor q - j >= 0.
        target = labels[:, 1 : length + 1].clone()
        target[:, :step] = -100
        loss = F.cross_entropy(logits[step].flatten(0, 1), target.flatten(), ignore_index=-100)
        total = total + STEP_DECAY**step * loss
        weight += STEP_DECAY**step
    return total / weight


def _train(model, data, config: TrainConfig) -> float:
    tokens, features, labels = data
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    warmup = max(1, config.steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(config.seed + 1)
    device = model.lm_head.weight.device
    autocast = device.type == "cuda"
    loss_value = float("nan")
    for step in range(config.steps):
        index = torch.randint(len(tokens), (config.batch_size,), generator=generator)
        batch = (
            tokens[index].to(device),
            features[index].to(device, non_blocking=True),
            labels[index.to(labels.device)],
        )
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model, *batch, config.ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        if step % 100 == 0 or step == config.steps - 1:
            loss_value = float(loss.detach())
            logger.info("step %d/%d loss %.4f", step, config.steps, loss_value)
    return loss_value


@torch.no_grad()
def _evaluate(model, data, steps: int, per_pass: int = 16) -> list[float]:
    """Held-out accuracy per unroll step, `per_pass` sequences at a time (the logits of all
    of them at once can outgrow the memory the target's KV pool leaves)."""
    tokens, features, labels = data
    device = model.lm_head.weight.device
    length = tokens.shape[1] - 1
    correct, counted = [0] * steps, [0] * steps
    for start in range(0, len(tokens), per_pass):
        rows = slice(start, start + per_pass)
        logits = ttt_logits(model, tokens[rows].to(device), features[rows].to(device), steps)
        for step in range(steps):
            target = labels[rows, 1 : length + 1][:, step:]
            guess = logits[step][:, step:].argmax(-1)
            valid = target != -100
            correct[step] += int((guess == target)[valid].sum())
            counted[step] += int(valid.sum())
    return [c / n if n else 0.0 for c, n in zip(correct, counted, strict=True)]
