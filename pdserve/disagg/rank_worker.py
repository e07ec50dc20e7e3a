"""A disaggregated worker's tensor-parallel rank: `pdserve.engine.ranks.rank_worker` with the rank's
own KV links (`rank_links`). Rank 0 runs it: `python -m pdserve.disagg.rank_worker ...`, with
`pdserve.engine.ranks.rank_worker`'s arguments."""

from __future__ import annotations

import sys

from pdserve.disagg.rank_links import RankLinks
from pdserve.engine.ranks import rank_worker


def main(argv: list[str] | None = None) -> int:
    return rank_worker.main(argv, extension=RankLinks)


if __name__ == "__main__":
    sys.exit(main())
