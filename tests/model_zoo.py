"""The models people bring, tiny and random-init: builders shared by tests/test_models.py and
``python -m benchmarks.steady --zoo``.

Every builder returns a ``ZooCase``: a float32 model in train mode with dropout off (so eager and compiled
see the same function), a batch, and a loss. Configs are tiny (hidden 32, 2 layers, sequence 8-16, batch
2) so a forward+backward compiles in seconds on 2 cores; nothing is downloaded (configs only,
``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
BATCH = 2
SEQ = 12


@dataclass
class ZooCase:
    name: str
    #: float32 model in train mode, dropout off.
    model: nn.Module
    #: keyword inputs of ``model`` (float tensors are cast with the model).
    inputs: dict[str, torch.Tensor]
    #: (model, inputs) -> (loss, outputs to compare); runs the model.
    step: Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, Any]]
    #: Makes a float64 copy of ``model`` runnable as the reference (same function, another implementation
    #: where the model's own has no float64 kernel); None when ``.double()`` suffices.
    prepare_reference: Callable[[nn.Module], None] | None = None

    def reference(self) -> nn.Module:
        """A float64 copy of the model: the high-precision reference of the accuracy checks."""
        ref = copy_as(self.model, torch.float64)
        if self.prepare_reference is not None:
            self.prepare_reference(ref)
        return ref


def cast_inputs(inputs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Float tensors to ``dtype``; integer tensors (token ids, labels) unchanged."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def copy_as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An independent copy of ``model`` with floating parameters and buffers in ``dtype``."""
    return copy.deepcopy(model).to(dtype)


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def _zero_dropout_config(config: Any) -> Any:
    # Every HF family names its dropout probabilities differently (attn_pdrop, dropout_rate,
    # attention_probs_dropout_prob, ...): zero all of them so train mode is deterministic.
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("drop" in key):
            setattr(config, key, 0.0)
    return config


def _tokens(seed: int, shape: tuple[int, ...] = (BATCH, SEQ), high: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, high, shape, generator=torch.Generator().manual_seed(seed))


def _hf_step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    out = model(**inputs)
    return out.loss, {"loss": out.loss, "logits": out.logits}


def _build_hf(config_cls: str, model_cls: str, **config: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = _zero_dropout_config(getattr(transformers, config_cls)(**config))
    return _no_dropout(getattr(transformers, model_cls)(cfg))


def _causal_lm(config_cls: str, model_cls: str, name: str, **config: Any) -> ZooCase:
    model = _build_hf(config_cls, model_cls, vocab_size=VOCAB, **config)
    ids = _tokens(1)
    return ZooCase(name, model, {"input_ids": ids, "labels": ids}, _hf_step)


def gpt2() -> ZooCase:
    return _causal_lm(
        "GPT2Config", "GPT2LMHeadModel", "gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=32,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


LLAMA_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    max_position_embeddings=32,
)  # fmt: skip


def llama() -> ZooCase:
    return _causal_lm("LlamaConfig", "LlamaForCausalLM", "llama", **LLAMA_LIKE)


def gemma() -> ZooCase:
    return _causal_lm("GemmaConfig", "GemmaForCausalLM", "gemma", head_dim=16, **LLAMA_LIKE)


def mixtral(experts_implementation: str | None = None) -> ZooCase:
    """Mixtral with transformers' default experts implementation (grouped_mm: ``histc`` + grouped matmul)
    unless another one is named."""
    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    case = _causal_lm(
        "MixtralConfig", "MixtralForCausalLM", "mixtral", num_local_experts=4, num_experts_per_tok=2,
        **LLAMA_LIKE, **extra,
    )  # fmt: skip
    # torch._grouped_mm has no float64 kernel: the reference computes the same experts as one dense bmm.
    case.prepare_reference = lambda ref: ref.set_experts_implementation("batched_mm")
    return case


def bert() -> ZooCase:
    model = _build_hf(
        "BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    ids = _tokens(2)
    return ZooCase("bert", model, {"input_ids": ids, "labels": _tokens(3)}, _hf_step)


def _seq2seq(config_cls: str, model_cls: str, name: str, **config: Any) -> ZooCase:
    model = _build_hf(config_cls, model_cls, vocab_size=VOCAB, **config)
    return ZooCase(name, model, {"input_ids": _tokens(4), "labels": _tokens(5, (BATCH, 8))}, _hf_step)


def t5() -> ZooCase:
    return _seq2seq(
        "T5Config", "T5ForConditionalGeneration", "t5", d_model=32, d_kv=16, d_ff=64, num_layers=2,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


def bart() -> ZooCase:
    return _seq2seq(
        "BartConfig", "BartForConditionalGeneration", "bart", d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32,
    )  # fmt: skip


def vit() -> ZooCase:
    model = _build_hf(
        "ViTConfig", "ViTForImageClassification", image_size=16, patch_size=4, num_channels=3, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=4,
        # Set, not inferred: the loss writes the inferred value into the config on the first call, a
        # guard change that recompiles the second step.
        problem_type="single_label_classification",
    )  # fmt: skip
    g = torch.Generator().manual_seed(6)
    inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g), "labels": torch.tensor([1, 3])}
    return ZooCase("vit", model, inputs, _hf_step)


def whisper() -> ZooCase:
    # The encoder's two convolutions halve the frames: input frames = 2 * max_source_positions.
    model = _build_hf(
        "WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB, d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, max_target_positions=16,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    inputs = {"input_features": torch.randn(BATCH, 16, 32, generator=g), "labels": _tokens(8, (BATCH, 8))}
    return ZooCase("whisper", model, inputs, _hf_step)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, a projection shortcut when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class TinyResNet(nn.Module):
    """A ResNet-style CNN (stem, max-pool, two stages, global average pool, linear head)."""

    def __init__(self, classes: int = 4, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.stage1 = BasicBlock(width, width, 1)
        self.stage2 = BasicBlock(width, 2 * width, 2)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.stage1(self.pool(self.stem(x))))
        return self.head(x.mean((2, 3)))


def _resnet_step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    logits = model(inputs["x"])
    loss = F.cross_entropy(logits.float(), inputs["labels"])
    return loss, {"loss": loss, "logits": logits}


def resnet() -> ZooCase:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(9)
    inputs = {"x": torch.randn(BATCH, 3, 16, 16, generator=g), "labels": torch.tensor([0, 2])}
    return ZooCase("resnet", TinyResNet().train(), inputs, _resnet_step)


def _denoise_step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    pred = model(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], return_dict=False)[0]
    loss = F.mse_loss(pred.float(), inputs["noise"].float())
    return loss, {"loss": loss, "pred": pred}


def sd_unet() -> ZooCase:
    """A Stable Diffusion-style conditional UNet (diffusers' UNet2DConditionModel: ResNet blocks with
    GroupNorm, cross-attention transformer blocks, sinusoidal timestep embedding, nearest upsampling),
    trained as diffusion models are: predict the noise, MSE against it (the noise drawn outside the model)."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip
    g = torch.Generator().manual_seed(10)
    inputs = {"sample": torch.randn(BATCH, 4, 8, 8, generator=g), "timestep": torch.tensor([10, 700]),
              "encoder_hidden_states": torch.randn(BATCH, 5, 16, generator=g),
              "noise": torch.randn(BATCH, 4, 8, 8, generator=g)}  # fmt: skip
    return ZooCase("sd_unet", _no_dropout(model), inputs, _denoise_step)


ZOO: dict[str, Callable[[], ZooCase]] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "gemma": gemma,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "whisper": whisper,
    "mixtral": mixtral,
    "resnet": resnet,
    "sd_unet": sd_unet,
}
