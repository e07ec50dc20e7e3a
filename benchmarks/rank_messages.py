"""What a decode pass's `RankForward` costs on the host: encoding it on rank 0 and decoding it
(with the codec's schema checks) on every other rank, at each batch size. Each request keeps its
pages, one in 16 gains a page, and its one token is a placeholder for the broadcast device
tokens (an overlapped decode step). CPU only; median of `--repeats`.

    python benchmarks/rank_messages.py --batch-sizes 1 64 256
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.protocol import codec
from pdserve.protocol.rank_messages import RankForward, flatten


def decode_pass(batch: int) -> RankForward:
    new_pages, new_page_counts = flatten([[i] if i % 16 == 0 else [] for i in range(batch)])
    return RankForward(
        request_ids=[f"chatcmpl-{i:08x}" for i in range(batch)],
        pages_kept=[40] * batch,
        new_pages=new_pages,
        new_page_counts=new_page_counts,
        num_computed=[640] * batch,
        token_ids=[-1] * batch,
        token_counts=[1] * batch,
        positions=[],
        position_counts=[0] * batch,
        masks=[],
        capture_kind="",
        capture_layers=[],
        graphs="decode",
        device_tokens_shape=[batch],
        device_tokens_dtype="int64",
        ended=[],
    )


def median_us(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print("batch  bytes  encode us  decode us")
    for batch in args.batch_sizes:
        message = decode_pass(batch)
        data = codec.encode(message)
        encode_us = median_us(lambda m=message: codec.encode(m), args.repeats)
        decode_us = median_us(lambda d=data: codec.decode(d, RankForward), args.repeats)
        print(f"{batch:5d} {len(data):6d} {encode_us:10.1f} {decode_us:10.1f}")


if __name__ == "__main__":
    main()
