"""Tests for the offline tiny tokenizer, tiny models and random full-size checkpoints."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve.synthetic.random_model import (
    RANDOM_MODEL_PRESETS,
    _random_tensor,
    make_random_model,
    random_model_tensor_shapes,
)
from pdserve.synthetic.tiny_model import (
    SUPPORTED_ARCHS,
    build_tokenizer,
    default_model_dir,
    make_tiny_model,
)

PROMPT_IDS = torch.tensor([[0, 44, 73, 331, 83, 271, 269, 370]])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module", params=SUPPORTED_ARCHS)
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    out_dir = tmp_path_factory.mktemp(request.param)
    return request.param, make_tiny_model(out_dir, request.param)


def _safetensor_names(model_dir: Path) -> set[str]:
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, framework="pt") as handle:
            names.update(handle.keys())
    return names


# --- tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, the model reads the next token.",
        "emoji 😀🚀👩‍👩‍👧 and 中文字符、日本語のテキスト and ñ é ß",
        "  leading spaces\n\ttabs and trailing  ",
        "def f(x):\n    return x ** 2  # 123,456.78",
        "\x00\x7f control bytes \u200b zero width",
        "",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_has_about_1000_tokens_with_merges(tokenizer) -> None:
    assert 900 <= len(tokenizer) <= 1024
    assert len(tokenizer.encode("the model reads the next token")) < 10


def test_tokenizer_special_token_ids(tokenizer) -> None:
    assert tokenizer.convert_ids_to_tokens(list(range(5))) == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|pad|>",
    ]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 4)


def test_tokenizer_adds_no_special_tokens_by_default(tokenizer) -> None:
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.bos_token_id not in tokenizer.encode("hello")


def test_special_tokens_in_text_encode_to_single_ids(tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 2
    assert ids[-1] == 3


def test_chat_template_with_generation_prompt(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_without_generation_prompt(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nHi!<|im_end|>\n"


def test_build_tokenizer_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    first = {path.name: path.read_bytes() for path in tokenizer_dir.iterdir()}
    second = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert first == second


# --- tiny models -------------------------------------------------------------------------


def test_each_arch_loads_and_runs_forward(arch_dir) -> None:
    _, model_dir = arch_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(PROMPT_IDS).logits
    assert logits.shape == (1, PROMPT_IDS.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert model.config.vocab_size >= len(tokenizer)
    assert model.config.vocab_size % 8 == 0
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_each_arch_tokenizes_like_the_plain_tokenizer(arch_dir, tokenizer) -> None:
    _, model_dir = arch_dir
    arch_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "<|im_start|>user\nHello 12345, café 😀 中文!<|im_end|>\n"
    assert len(arch_tokenizer) == len(tokenizer)
    assert arch_tokenizer.encode(text) == tokenizer.encode(text)


def test_each_arch_has_peaky_logits(arch_dir) -> None:
    _, model_dir = arch_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(PROMPT_IDS).logits
    assert logits.std() > 0.5


def test_generation_config_stops_on_eos_and_im_end(arch_dir) -> None:
    _, model_dir = arch_dir
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [1, 3]


def test_llama_uses_llama3_rope(tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(make_tiny_model(tmp_path, "llama"))
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8, 1, 4)
    assert rope["original_max_position_embeddings"] < config.max_position_embeddings


def test_mistral_has_no_sliding_window(tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(make_tiny_model(tmp_path, "mistral"))
    assert config.sliding_window is None


def test_qwen2_has_qkv_bias_and_tied_embeddings(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2")
    names = _safetensor_names(model_dir)
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert "lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_qwen3_has_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen3")
    config = AutoConfig.from_pretrained(model_dir)
    assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    names = _safetensor_names(model_dir)
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert "model.layers.0.self_attn.k_norm.weight" in names


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", "qwen3", seed=3)
    second = make_tiny_model(tmp_path / "b", "qwen3", seed=3)
    for path in first.iterdir():
        assert path.read_bytes() == (second / path.name).read_bytes(), path.name


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", seed=0)
    second = make_tiny_model(tmp_path / "b", seed=1)
    weights = "model.safetensors"
    assert (first / weights).read_bytes() != (second / weights).read_bytes()


def test_make_tiny_model_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_norm_weights_are_near_one(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path))
    norm = model.model.norm.weight
    assert (norm - 1).abs().max() < 0.5
    assert norm.std() > 0


def test_sharded_save_writes_index_and_loads(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", shard_size="100KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (model_dir / "model.safetensors").exists()
    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]


def test_sharded_and_single_file_hold_the_same_weights(tmp_path: Path) -> None:
    single = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "a"))
    sharded_dir = make_tiny_model(tmp_path / "b", shard_size="100KB")
    sharded = AutoModelForCausalLM.from_pretrained(sharded_dir)
    for (name, expected), (_, actual) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(expected, actual), name


def test_bfloat16_dtype(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path, dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_overrides_reach_the_config(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", rms_norm_eps=1e-6, head_dim=32)
    config = AutoConfig.from_pretrained(model_dir)
    assert (config.rms_norm_eps, config.head_dim) == (1e-6, 32)


def test_unknown_arch_lists_supported_archs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        make_tiny_model(tmp_path, "gpt2")


def test_unknown_override_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_shard_size"):
        make_tiny_model(tmp_path, max_shard_size="1KB")


def test_unknown_dtype_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float8"):
        make_tiny_model(tmp_path, dtype="float8")


# --- default model -----------------------------------------------------------------------


def test_default_model_dir_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = default_model_dir()
    assert first.parent == tmp_path
    assert "v1" in first.name
    modified = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == modified
    AutoModelForCausalLM.from_pretrained(first)


def test_default_model_dir_survives_concurrent_creation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2
    assert results[0] == results[1]
    assert [path.name for path in tmp_path.iterdir()] == [results[0].name]


# --- random full-size models -------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(RANDOM_MODEL_PRESETS))
def test_preset_tensor_shapes_match_transformers(preset: str, tmp_path: Path) -> None:
    config_dict = {**RANDOM_MODEL_PRESETS[preset], "num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
    assert random_model_tensor_shapes(config_dict) == expected


def test_preset_parameter_counts() -> None:
    def billions(preset: str) -> float:
        shapes = random_model_tensor_shapes(RANDOM_MODEL_PRESETS[preset])
        return sum(torch.Size(shape).numel() for shape in shapes.values()) / 1e9

    assert billions("llama-3.2-1b") == pytest.approx(1.24, abs=0.01)
    assert billions("llama-3.1-8b") == pytest.approx(8.03, abs=0.01)
    assert billions("qwen2.5-0.5b") == pytest.approx(0.494, abs=0.001)
    assert billions("qwen2.5-7b") == pytest.approx(7.62, abs=0.01)


@pytest.fixture(scope="module")
def random_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("qwen2.5-0.5b")
    # 100 MB shards put the 272 MB embedding alone in the first of two shards.
    return make_random_model(out_dir, "qwen2.5-0.5b", num_layers=1, max_shard_bytes=100_000_000)


def test_random_model_loads_in_transformers(random_qwen_dir: Path) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(random_qwen_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 1
    with torch.no_grad():
        logits = model(PROMPT_IDS).logits
    assert logits.shape == (1, PROMPT_IDS.shape[1], 151936)


def test_random_model_writes_index_and_tokenizer(random_qwen_dir: Path) -> None:
    index = json.loads((random_qwen_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    expected = random_model_tensor_shapes(json.loads((random_qwen_dir / "config.json").read_text()))
    assert set(index["weight_map"]) == set(expected)
    tokenizer = AutoTokenizer.from_pretrained(random_qwen_dir)
    config = AutoConfig.from_pretrained(random_qwen_dir)
    assert (config.bos_token_id, config.eos_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )


def _transformers_tensors(config) -> dict[str, tuple[int, ...]]:
    """The checkpoint transformers itself expects for `config`: its model's `state_dict()`
    names and shapes (built on the meta device, no memory), less a tied LM head, which
    checkpoints leave out."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    return tensors


@pytest.mark.parametrize("preset", sorted(RANDOM_MODEL_PRESETS))
def test_random_model_tensors_are_the_ones_transformers_expects(preset: str) -> None:
    raw = RANDOM_MODEL_PRESETS[preset]
    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    assert random_model_tensor_shapes(raw) == _transformers_tensors(config)


def test_each_arch_writes_the_tensors_transformers_expects(arch_dir) -> None:
    _, model_dir = arch_dir
    expected = _transformers_tensors(AutoConfig.from_pretrained(model_dir))
    written = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()
            written.update({name: tuple(handle.get_slice(name).get_shape()) for name in names})
    assert written == expected


def test_random_tensor_depends_only_on_seed_and_name() -> None:
    name = "model.layers.3.mlp.up_proj.weight"
    first = _random_tensor(name, (4, 8), torch.bfloat16, seed=0)
    assert torch.equal(first, _random_tensor(name, (4, 8), torch.bfloat16, seed=0))
    assert not torch.equal(first, _random_tensor(name, (4, 8), torch.bfloat16, seed=1))
    assert first.float().std() == pytest.approx(0.02, rel=0.5)
    norm = _random_tensor("model.norm.weight", (8,), torch.bfloat16, seed=0)
    assert torch.equal(norm, torch.ones(8, dtype=torch.bfloat16))


def test_unknown_preset_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"qwen2\.5-7b"):
        make_random_model(tmp_path, "llama-2-7b")


def test_make_tiny_model_writes_files_others_can_read(tmp_path: Path) -> None:
    from pdserve.cli import main

    previous = os.umask(0o022)
    try:
        assert main(["--log-level", "error", "make-tiny-model", str(tmp_path / "m")]) == 0
    finally:
        os.umask(previous)
    out = tmp_path / "m"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    written = list(out.iterdir())
    assert any(p.suffix == ".safetensors" for p in written)
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
