"""Which small random targets can an EAGLE-3 head learn? For each seeded random target (the
tiny tokenizer's ~1000-token vocabulary; hidden size, layers, weight scale and, optionally,
`make_tiny_model`'s residual scale), `train-eagle` trains a head on the target's own greedy
generations and reports its held-out accuracy per draft step, beside how often an n-gram
match would have predicted the next token (how repetitive the target's own text is).

    python benchmarks/speculative_targets.py 256x16x0.1 512x16x0.05x0.001 --out targets.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="+", help="HIDDENxLAYERSxINIT_STD[xRESIDUAL_SCALE]")
    parser.add_argument("--train-sequences", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=800)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from pdserve import LLM
    from pdserve.speculative.ngram import propose_ngram
    from pdserve.speculative.training.train_eagle import TrainConfig, _generate, train_eagle
    from pdserve.synthetic.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="pdserve-targets-"))
    rows = []
    for spec in args.targets:
        fields = spec.split("x")
        hidden, layers, std = int(fields[0]), int(fields[1]), float(fields[2])
        scale = float(fields[3]) if len(fields) > 3 else 1.0
        heads = max(4, hidden // 64)
        path = make_tiny_model(
            work / spec,
            "llama",
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 4),
            intermediate_size=4 * hidden,
            init_std=std,
            residual_scale=scale,
        )
        aux = (min(1, layers - 1), layers // 2, layers - 2 if layers > 2 else layers - 1)
        config = TrainConfig(
            model_path=str(path),
            out_dir=str(work / f"{spec}-eagle"),
            num_sequences=args.train_sequences,
            steps=args.train_steps,
            aux_layer_ids=aux,
        )
        started = time.perf_counter()
        report = train_eagle(config)
        sequences = _generate(LLM(str(path), max_model_len=160).engine, config)[:64].tolist()
        hits = total = 0
        for seq in sequences:
            for end in range(config.prompt_len, len(seq) - 1):
                guess = propose_ngram(seq[: end + 1], 1)
                hits += bool(guess) and guess[0] == seq[end + 1]
                total += 1
        rows.append(
            {
                "target": spec,
                "held_out_accuracy_per_step": [round(a, 3) for a in report.eval_accuracy],
                "ngram_next_token_hit_rate": round(hits / total, 3),
                "seconds": round(time.perf_counter() - started, 1),
                "draft": str(report.out_dir),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
