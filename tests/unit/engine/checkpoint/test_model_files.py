"""Model names resolved to directories: local directories as they are, hub ids from the
Hugging Face cache (a fake one here) or not at all when the hub cannot be reached, GGUF files
checked before any conversion (tiny files written with the `gguf` package), converted once.

Every error names what it was given, so a user can see which argument to fix."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from huggingface_hub import constants

from pdserve import LLM, SamplingParams
from pdserve.engine.checkpoint import gguf_import
from pdserve.engine.checkpoint.errors import ModelNotFoundError
from pdserve.engine.checkpoint.gguf_import import GGUFError
from pdserve.engine.checkpoint.model_config import UnsupportedModelError
from pdserve.engine.checkpoint.model_files import resolve_model_dir
from pdserve.server.local_process import free_port

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A pdserve cache of the test's own: a GGUF check that failed to refuse a file would
    convert it there, not into the user's cache."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "pdserve-cache"))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache that huggingface_hub reads (it reads the constant at each
    call when no cache_dir is passed)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_model(hub_cache: Path, repo_id: str, model_dir: str) -> Path:
    """`model_dir` as the cached snapshot of `repo_id` at its default branch, laid out as
    huggingface_hub lays out its cache."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


# --- local paths ------------------------------------------------------------------------------


def test_a_directory_resolves_to_itself(tiny_model_dirs):
    model = tiny_model_dirs("llama")
    assert resolve_model_dir(model) == Path(model)


def test_a_revision_with_a_local_path_is_refused(tiny_model_dirs):
    with pytest.raises(ModelNotFoundError, match=r"applies to Hugging Face hub ids.*directory"):
        resolve_model_dir(tiny_model_dirs("llama"), revision="main")


def test_a_missing_gguf_file_is_named(tmp_path):
    missing = str(tmp_path / "absent.gguf")
    message = f"GGUF file '{missing}' does not exist"
    with pytest.raises(ModelNotFoundError, match=re.escape(message)):
        resolve_model_dir(missing)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\0" * 16)
    message = f"'{weights}' is a file but not a .gguf file"
    with pytest.raises(ModelNotFoundError, match=re.escape(message)):
        resolve_model_dir(str(weights))


def test_a_name_that_is_no_path_and_no_hub_id_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"'\./missing' does not exist.*hub id"):
        resolve_model_dir("./missing")


def test_trust_remote_code_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"--trust-remote-code is refused.*LlamaForCausalLM"):
        LLM(tiny_model_dirs("llama"), device="cpu", trust_remote_code=True)


# --- hub ids ----------------------------------------------------------------------------------


def test_a_cached_hub_id_resolves_to_its_snapshot_and_generates(tiny_model_dirs, hub_cache):
    snapshot = cache_model(hub_cache, "org/name", tiny_model_dirs("llama"))
    assert resolve_model_dir("org/name").resolve() == snapshot.resolve()
    assert resolve_model_dir("org/name", revision=COMMIT).resolve() == snapshot.resolve()
    llm = LLM("org/name", device="cpu")
    assert llm.engine.model_dir.resolve() == snapshot.resolve()
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    [output] = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    assert len(output.token_ids) == 4


def test_a_hub_id_not_cached_while_offline_names_the_id_and_the_cache(hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as failure:
        resolve_model_dir("org/absent", revision="v2")
    message = str(failure.value)
    assert "'org/absent' at revision 'v2'" in message
    assert f"not in the Hugging Face cache ({hub_cache})" in message
    assert "the hub is offline (HF_HUB_OFFLINE=1)" in message


def test_a_hub_id_not_cached_with_the_hub_unreachable_could_not_be_downloaded(
    hub_cache, monkeypatch
):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ModelNotFoundError) as failure:
        resolve_model_dir("org/absent")
    message = str(failure.value)
    assert f"'org/absent' is not in the Hugging Face cache ({hub_cache})" in message
    assert "could not be downloaded" in message


# --- GGUF checks ------------------------------------------------------------------------------


def write_gguf(path: Path, architecture: str, tensors: dict[str, tuple]) -> Path:
    """A GGUF file of `architecture` holding `tensors`: name -> (array,) for a plain tensor
    or (blocks as bytes [rows, bytes per row], quantization type) for a quantized one."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    for name, spec in tensors.items():
        if len(spec) == 1:
            writer.add_tensor(name, spec[0])
        else:
            blocks, quant_type = spec
            writer.add_tensor(name, blocks, raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.usefixtures("own_cache")
def test_an_unsupported_gguf_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.ones((4, 8)),)})
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        resolve_model_dir(str(path))


@pytest.mark.usefixtures("own_cache")
def test_a_quantization_the_gguf_package_cannot_dequantize_names_type_and_tensor(tmp_path):
    quant_type = gguf.GGMLQuantizationType.Q8_1
    block_bytes = gguf.GGML_QUANT_SIZES[quant_type][1]
    with pytest.raises(NotImplementedError):  # the premise: the package has no dequantizer
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), quant_type)
    blocks = np.zeros((2, block_bytes), np.uint8)
    path = write_gguf(
        tmp_path / "q8_1.gguf",
        "llama",
        {
            "token_embd.weight": (np.ones((4, 8), np.float32),),
            "blk.0.attn_q.weight": (blocks, quant_type),
        },
    )
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.attn_q\.weight is quantized as Q8_1"):
        resolve_model_dir(str(path))


@pytest.mark.usefixtures("own_cache")
@pytest.mark.parametrize(
    "content",
    [
        b"not a gguf file at all" * 8,
        b"",
        # a valid header over garbage: the reader fails past the magic and version
        b"GGUF\x03\x00\x00\x00" + bytes(range(7, 250, 3)) * 4,
    ],
    ids=["junk", "empty", "header-then-garbage"],
)
def test_a_file_that_is_not_gguf_inside_is_not_readable(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=re.escape(f"{path} is not a readable GGUF file")):
        resolve_model_dir(str(path))


# --- the real model ---------------------------------------------------------------------------


def test_a_converted_gguf_is_reused_without_converting_again(
    smollm2_gguf, smollm2_dir, monkeypatch
):
    """`smollm2_dir` converted (or found) the directory; another resolve finds it."""

    def convert_again(gguf_file, out_dir):
        raise AssertionError(f"{gguf_file} converted a second time")

    monkeypatch.setattr(gguf_import, "_convert", convert_again)
    assert resolve_model_dir(str(smollm2_gguf)) == smollm2_dir
    assert (smollm2_dir / "config.json").is_file()


def test_a_converted_gguf_is_readable_by_everyone_sharing_the_cache(smollm2_dir):
    for path in [smollm2_dir, *smollm2_dir.iterdir()]:
        assert path.stat().st_mode & 0o004, f"{path} is not world-readable"
