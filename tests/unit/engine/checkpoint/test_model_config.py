import pytest

from pdserve.engine.checkpoint.model_config import ModelConfig, UnsupportedModelError
from pdserve.protocol.metadata_spec import spec_hidden_size_of

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def test_spec_hidden_size_is_hidden_size_without_hc_mult():
    assert ModelConfig.from_dict(BASE).spec_hidden_size == 64
    assert spec_hidden_size_of({**BASE, "hc_mult": 1}) == 64


def test_hc_mult_two_doubles_spec_hidden_size():
    assert ModelConfig.from_dict({**BASE, "hc_mult": 2}).spec_hidden_size == 128


def test_head_dim_and_kv_heads_defaults():
    config = ModelConfig.from_dict(BASE)
    assert (config.head_dim, config.num_kv_heads) == (16, 4)
    explicit = ModelConfig.from_dict({**BASE, "head_dim": 32, "num_key_value_heads": 2})
    assert (explicit.head_dim, explicit.num_kv_heads) == (32, 2)


@pytest.mark.parametrize(
    ("arch", "qkv_bias", "qk_norm"),
    [
        ("LlamaForCausalLM", False, False),
        ("MistralForCausalLM", False, False),
        ("Qwen2ForCausalLM", True, False),
        ("Qwen3ForCausalLM", False, True),
    ],
)
def test_architecture_features(arch, qkv_bias, qk_norm):
    config = ModelConfig.from_dict({**BASE, "architectures": [arch]})
    assert (config.qkv_bias, config.qk_norm) == (qkv_bias, qk_norm)


def test_rope_parameters_read_from_both_config_formats():
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    )
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    )
    assert old.rope_parameters == new.rope_parameters
    assert old.rope_parameters["rope_theta"] == 5e5


def test_sliding_window_only_when_used():
    assert ModelConfig.from_dict({**BASE, "sliding_window": 16}).sliding_window == 16
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        ModelConfig.from_dict({**BASE, "architectures": ["FalconForCausalLM"]})


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors"])
def test_a_quantized_config_is_refused_naming_its_method(method):
    config = {**BASE, "quantization_config": {"quant_method": method, "bits": 4}}
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_dict(config)
    assert str(refused.value).startswith(f"'{method}' quantized checkpoints are not supported")
    assert "\n" not in str(refused.value)


def test_compression_config_and_a_method_less_quantization_config_are_refused_too():
    with pytest.raises(UnsupportedModelError, match="has a compression_config"):
        ModelConfig.from_dict({**BASE, "compression_config": {"format": "float-quantized"}})
    with pytest.raises(UnsupportedModelError, match=r"^quantized checkpoints are not supported"):
        ModelConfig.from_dict({**BASE, "quantization_config": {"bits": 4}})
