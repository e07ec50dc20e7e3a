"""pdserve: prefill/decode-disaggregated LLM serving.

`LLM`, `SamplingParams` and `__version__` are looked up lazily so that torch-free parts
(`pdserve.protocol`, `pdserve.router`) do not pull in torch through this package, and
importing any part stays cheap (the version reads the installed package's metadata).
"""

__all__ = ["LLM", "SamplingParams", "__version__"]

# NOTE: the version of a source tree that is not installed; pyproject.toml's (a test holds
# them equal).
SOURCE_VERSION = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "__version__":
        global __version__
        __version__ = _installed_version()
        return __version__
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")


def _installed_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return SOURCE_VERSION
