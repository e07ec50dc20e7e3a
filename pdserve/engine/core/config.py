"""Engine configuration: one frozen dataclass, validated on construction.

Role configs (serve, prefill, decode) *have* an EngineConfig. Each field that is a
command-line flag declares it here (`protocol.flags.option`); `pdserve.commands` builds the
config from the parsed flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.flags import option
from pdserve.protocol.spec_settings import SpecSettings

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "triton", "torch")

# What a tensor-parallel worker's other ranks may run (rank 0 names it; nothing else).
RANK_WORKER_MODULES = ("pdserve.engine.ranks.rank_worker", "pdserve.disagg.rank_worker")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance.

    kv_cache_memory: bytes for the KV pool; None sizes it from `gpu_memory_utilization` of
    the GPU's memory (minus weights and activations) or, on CPU, to hold `max_running_requests`
    full-length sequences capped at `cpu_kv_cache_cap` bytes.
    chunked_prefill_size: prefill tokens per step; a longer prompt is split into chunks.
    0 or negative disables splitting (prompts then go whole, `max_prefill_tokens` per step).
    attention_backend: "auto" (Triton on CUDA, the torch reference on CPU), "triton" or
    "torch"; chosen once at start-up for the target and any draft model.
    cuda_graph_max_bs: the largest decode batch replayed from a captured CUDA graph (larger
    batches run eagerly); disable_cuda_graph: run every step eagerly.
    disable_overlap_schedule: on CUDA, each step is prepared while the GPU runs the previous
    one (its tokens reported a step later) unless this is set.
    tp_size: ranks of tensor parallelism (`pdserve.engine.parallel.tensor_parallel`); the KV budget
    (kv_cache_memory, gpu_memory_utilization) is per rank. nnodes, node_rank, dist_init_addr:
    a worker whose ranks span nodes (SGLang's flags); node k runs ranks
    k * tp_size / nnodes onwards, node 0 serves. disable_custom_all_reduce: decode's small
    all-reduces go through NCCL too (`pdserve.engine.parallel.symmetric_all_reduce`).
    enable_two_batch_overlap: under tensor parallelism, an eager pass of at least
    `two_batch_min_tokens` tokens (a long prefill chunk) runs as two halves of its tokens,
    each half's all-reduces overlapping the other half's compute (`ModelRunner`).
    stream_interval: a worker's engine process sends a request's tokens once this many piled
    up (`pdserve.engine_process.stream_interval`); `LLM` ignores it.
    """

    model_path: str
    dtype: str = option(
        "auto",
        "weights and activations; auto: float32 on CPU, the checkpoint's half type on GPU",
        choices=DTYPES,
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    page_size: int = option(16, "tokens per KV page")
    kv_cache_memory: int | None = option(
        None, "bytes of KV cache (default: sized from --gpu-memory-utilization)"
    )
    gpu_memory_utilization: float = option(
        0.85, "fraction of GPU memory for weights, activations and KV cache"
    )
    max_running_requests: int = option(
        256, "requests decoded together at most", aliases=("--max-num-seqs",)
    )
    chunked_prefill_size: int = option(
        8192,
        "prefill tokens per step; longer prompts are split (<= 0: never split)",
        aliases=("--max-num-batched-tokens",),
    )
    max_prefill_tokens: int = option(16384, "prefill tokens per step when chunking is off")
    max_model_len: int | None = option(
        None, "context length (default: the model's max_position_embeddings)"
    )
    seed: int = option(0, "the engine's random seed (requests without a seed sample from it)")
    attention_backend: str = option(
        "auto",
        "attention kernels: auto is Triton on CUDA and the torch reference on CPU",
        choices=ATTENTION_BACKENDS,
    )
    cuda_graph_max_bs: int = option(
        256, "largest decode batch replayed from a captured CUDA graph (Triton attention)"
    )
    disable_cuda_graph: bool = option(False, "run every decode step eagerly")
    disable_prefix_caching: bool = option(
        False,
        "compute every prompt whole (no reuse of earlier requests' KV pages)",
        aliases=("--no-enable-prefix-caching",),
        negation="--enable-prefix-caching",
    )
    disable_overlap_schedule: bool = option(
        False, "schedule each step after the previous one's tokens are back (no overlap)"
    )
    tp_size: int = option(
        1,
        "tensor-parallel ranks (GPUs) one worker's model is split over: cuda:N.. cuda:N+size-1 "
        "from --device, or gloo processes on CPU",
        aliases=("--tensor-parallel-size",),
    )
    nnodes: int = option(1, "nodes a tensor-parallel worker spans (--tp-size ranks split evenly)")
    node_rank: int = option(
        0, "this node's place in the worker's nodes: 0 serves HTTP, the others run ranks only"
    )
    dist_init_addr: str | None = option(
        None, "HOST:PORT on node 0 where the worker's nodes meet (needed with --nnodes > 1)"
    )
    disable_custom_all_reduce: bool = option(
        False, "tensor parallelism: NCCL for every all-reduce (no one-shot over GPU memory)"
    )
    enable_two_batch_overlap: bool = option(
        False,
        "tensor parallelism: long prefill passes run as two halves, each half's all-reduces "
        "overlapping the other's compute",
    )
    stream_interval: int = option(
        1,
        "new tokens a request's output carries before the engine sends it to the front end "
        "(its first and last go at once); more: a chunkier stream, less front-end work a token",
    )
    cpu_threads: int | None = option(
        None,
        "torch threads of each engine process on CPU (default: this machine's cores less one, "
        "split between the engine processes of a worker or launch; or OMP_NUM_THREADS)",
    )
    two_batch_min_tokens: int = 2048
    cpu_kv_cache_cap: int = 1 << 30
    # The module a tensor-parallel worker's other ranks run (`python -m ...`): a disaggregated
    # role's adds its ranks' KV links (`pdserve.disagg.rank_worker`).
    rank_worker_module: str = "pdserve.engine.ranks.rank_worker"
    speculative: SpecSettings | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.rank_worker_module not in RANK_WORKER_MODULES:
            raise ValueError(
                f"rank_worker_module must be one of {RANK_WORKER_MODULES}, "
                f"got {self.rank_worker_module!r}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}"
            )
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"--tp-size {self.tp_size} does not split evenly over --nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and not _is_host_port(self.dist_init_addr):
            raise ValueError(
                f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address), "
                f"got {self.dist_init_addr!r}"
            )
        if self.two_batch_min_tokens < 2:
            raise ValueError(
                f"two_batch_min_tokens must be >= 2 (a pass splits in two), "
                f"got {self.two_batch_min_tokens}"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def prefill_token_budget(self) -> int:
        """Prompt tokens computed per step across all requests."""
        return (
            self.chunked_prefill_size if self.chunked_prefill_size > 0 else self.max_prefill_tokens
        )

    @property
    def two_batch_overlap_tokens(self) -> int:
        """The fewest tokens of a pass that runs as two halves (0: none does)."""
        return self.two_batch_min_tokens if self.enable_two_batch_overlap else 0

    @property
    def split_prompts(self) -> bool:
        return self.chunked_prefill_size > 0


def _is_host_port(address: str | None) -> bool:
    host, _, port = (address or "").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
