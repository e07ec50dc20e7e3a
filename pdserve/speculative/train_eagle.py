"""`pdserve train-eagle`: train an EAGLE-3 draft head for a target on the target's own
generations, and write a draft directory the server loads.

1. Generate: random prompts, continued greedily by the target (pdserve's engine).
2. Capture: one target forward over each sequence keeps the outputs of the capture layers
   (the EAGLE-3 features) and the target's own next-token choice at every position (labels).
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

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.forward_batch import Capture, ForwardBatch
from pdserve.engine.page_allocator import pages_needed
from pdserve.engine.sampling_params import SamplingParams
from pdserve.speculative.checkpoints import build_draft_model, eagle_draft_config, save_draft
from pdserve.speculative.train_config import TrainConfig

logger = logging.getLogger(__name__)

STEP_DECAY = 0.8


@dataclass
class TrainReport:
    out_dir: Path
    train_seconds: float
    final_loss: float
    eval_accuracy: list[float]  # per unroll step, on held-out sequences


def train_eagle(config: TrainConfig) -> TrainReport:
    torch.manual_seed(config.seed)
    engine = Engine(
        EngineConfig(
            config.model_path,
            device=config.device,
            dtype=config.dtype,
            max_model_len=config.prompt_len + config.gen_len + 8,
            seed=config.seed,
        )
    )
    target = engine.model_config
    aux = config.aux_layer_ids or _default_aux(target.num_layers)
    sequences = _generate(engine, config)
    features, labels = _capture(engine, sequences, tuple(aux))
    draft_vocab = _draft_vocabulary(labels, min(config.draft_vocab_size, target.vocab_size))
    draft_config = eagle_draft_config(
        target,
        aux_layer_ids=list(aux),
        draft_vocab_size=len(draft_vocab),
        num_kv_heads=target.num_kv_heads,
        intermediate_size=target.intermediate_size,
    )
    device = engine.device
    model = build_draft_model(draft_config, target, config.prompt_len + config.gen_len + 8)
    model = model.to(device)
    _initialize_from_target(model, engine.model, draft_vocab)
    draft_labels = _to_draft_ids(labels, draft_vocab, target.vocab_size)
    split = max(1, int(len(sequences) * config.eval_fraction))
    train = (sequences[split:], features[split:], draft_labels[split:])
    held_out = (sequences[:split], features[:split], draft_labels[:split])
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


def _generate(engine: Engine, config: TrainConfig) -> torch.Tensor:
    """[N, prompt + gen] token ids: random prompts and the target's greedy continuations."""
    tokenizer_size = len(engine.tokenizer)
    vocab = min(engine.model_config.vocab_size, tokenizer_size)
    generator = torch.Generator().manual_seed(config.seed)
    prompts = torch.randint(
        3, vocab, (config.num_sequences, config.prompt_len), generator=generator
    )
    params = SamplingParams(max_new_tokens=config.gen_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    rows = prompts.tolist()
    for i, prompt in enumerate(rows):
        engine.add_request(f"train-{i}", prompt, params)
    generated: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                generated[output.request_id] = output.token_ids
    logger.info(
        "generated %d x %d tokens in %.1f s",
        config.num_sequences,
        config.gen_len,
        time.perf_counter() - started,
    )
    return torch.tensor([prompt + generated[f"train-{i}"] for i, prompt in enumerate(rows)])


@torch.inference_mode()
def _capture(engine, sequences: torch.Tensor, aux: tuple[int, ...]):
    """Target features [N, T, num_aux x hidden] and the target's next token at every
    position [N, T], a few sequences per forward pass."""
    length = sequences.shape[1]
    per_pass = max(1, 4096 // length)
    page_size = engine.config.page_size
    features, labels = [], []
    for start in range(0, len(sequences), per_pass):
        chunk = sequences[start : start + per_pass]
        pages = [engine.allocator.allocate(pages_needed(length, page_size)) for _ in chunk]
        try:
            inputs = ForwardBatch()
            for tokens, pages_of_row in zip(chunk.tolist(), pages, strict=True):
                inputs.add(pages_of_row, 0, tokens)
            output = engine.runner.forward(inputs, Capture.layers(aux))
            hidden, captured = output.hidden, output.features
            labels.append(engine.model.compute_logits(hidden).argmax(-1).view(len(chunk), length))
            features.append(captured.view(len(chunk), length, -1))
        finally:
            for p in pages:
                engine.allocator.free(p)
    return torch.cat(features), torch.cat(labels)


def _draft_vocabulary(labels: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent label tokens, sorted (d2t needs draft ids in target order)."""
    counts = torch.bincount(labels.flatten().cpu())
    size = min(size, int((counts > 0).sum()))
    return counts.topk(size).indices.sort().values


def _to_draft_ids(labels: torch.Tensor, draft_vocab: torch.Tensor, vocab: int) -> torch.Tensor:
    table = torch.full((vocab,), -100, dtype=torch.int64)
    table[draft_vocab] = torch.arange(len(draft_vocab))
    return table.to(labels.device)[labels]


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
        batch = (tokens[index].to(device), features[index.to(features.device)], labels[index])
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
def _evaluate(model, data, steps: int) -> list[float]:
    tokens, features, labels = data
    device = model.lm_head.weight.device
    logits = ttt_logits(model, tokens.to(device), features, steps)
    length = tokens.shape[1] - 1
    accuracy = []
    for step in range(steps):
        target = labels[:, 1 : length + 1][:, step:]
        guess = logits[step][:, step:].argmax(-1)
        valid = target != -100
        accuracy.append(float((guess == target)[valid].float().mean()) if valid.any() else 0.0)
    return accuracy
