"""pdserve: prefill/decode-disaggregated LLM serving.

`LLM` and `SamplingParams` are imported lazily so that torch-free parts (`pdserve.protocol`,
`pdserve.router`) do not pull in torch through this package.
"""

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
