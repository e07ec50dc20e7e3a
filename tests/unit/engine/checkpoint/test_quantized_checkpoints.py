"""A quantized checkpoint is refused at start-up in one line naming its method (`serve`,
`launch`, `LLM(...)`), not loaded as if unquantized nor failing on its scale tensors later."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.cli import build_parser
from pdserve.engine.checkpoint.model_config import UnsupportedModelError
from pdserve.llm import LLM

# Starts engines, processes or sockets: run with `-m integration` (the unit subset skips it).
pytestmark = pytest.mark.integration


def _quantized_copy(tiny: str, where: Path, method: str, scales: bool) -> str:
    """The tiny checkpoint with a `quantization_config` naming `method`; `scales`: with a
    per-tensor `weight_scale` beside each linear weight, as an FP8 checkpoint has."""
    shutil.copytree(tiny, where)
    config = json.loads((where / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "activation_scheme": "dynamic"}
    (where / "config.json").write_text(json.dumps(config))
    if scales:
        weights = load_file(where / "model.safetensors")
        for name in [n for n in weights if n.endswith("proj.weight")]:
            weights[name.removesuffix("weight") + "weight_scale"] = torch.ones(())
        save_file(weights, where / "model.safetensors")
    return str(where)


@pytest.fixture
def awq_plain_weights(tiny_model_dirs, tmp_path):
    return _quantized_copy(tiny_model_dirs("llama"), tmp_path / "awq", "awq", scales=False)


@pytest.fixture
def fp8(tiny_model_dirs, tmp_path):
    return _quantized_copy(tiny_model_dirs("llama"), tmp_path / "fp8", "fp8", scales=True)


def test_llm_refuses_a_quantized_config_over_plain_weights(awq_plain_weights):
    with pytest.raises(UnsupportedModelError, match=r"^'awq' quantized checkpoints are not"):
        LLM(awq_plain_weights, device="cpu")


def test_llm_refuses_an_fp8_checkpoint_before_its_scales(fp8):
    with pytest.raises(UnsupportedModelError, match=r"^'fp8' quantized checkpoints are not"):
        LLM(fp8, device="cpu")


@pytest.mark.parametrize("command", ["serve", "launch"])
def test_serve_and_launch_refuse_a_quantized_checkpoint_before_starting(command, fp8):
    """`configure` raises, so nothing starts; `pdserve` prints the message as one `error:`
    line and exits 2."""
    args = build_parser().parse_args([command, fp8, "--device", "cpu", "--port", "0"])
    with pytest.raises(ValueError) as refused:
        args.configure(args)
    assert str(refused.value) == (
        f"cannot serve {fp8!r}: 'fp8' quantized checkpoints are not supported "
        "(config.json has a quantization_config); pdserve runs unquantized weights "
        "(float32, float16, bfloat16) only: serve the model's unquantized release"
    )
