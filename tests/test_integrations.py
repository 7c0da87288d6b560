"""The recipes of docs/integrations.md, each run with the real package (tiny configs, two or three steps) and
compared with the same run in eager.

Dropout is off in every model (``model_zoo``'s builders zero it): a compiled graph draws its random numbers from
another generator than eager's kernels (docs/numerics.md), so a layer that samples (dropout, label dropout)
gives a different, equally valid run, which no comparison with eager could judge.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from neuron_compile import STATS

from .model_zoo import LLAMA_LIKE, VOCAB, _build_hf, _tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Parameters after a few steps of a float32 run: the compiled graphs round differently than eager's kernels.
_TRAINED = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch: pytest.MonkeyPatch) -> Any:
    """accelerate keeps one process-wide state (and Trainer sets ACCELERATE_DYNAMO_BACKEND): each run starts
    from none, as in a new process."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _tiny_llama() -> torch.nn.Module:
    """model_zoo's llama with one layer: the recipes test the package around the model, not its depth."""
    return _build_hf("LlamaConfig", "LlamaForCausalLM", vocab_size=VOCAB, **(LLAMA_LIKE | {"num_hidden_layers": 1}))


def _assert_same_parameters(compiled: torch.nn.Module, eager: torch.nn.Module) -> None:
    trained = dict(eager.named_parameters())
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param, trained[name], **_TRAINED, msg=lambda m: f"{name}: {m}")


# -- Hugging Face Trainer (torch_compile_backend="neuron") fine-tuning a PEFT LoRA model --------------------------------
def _lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(_tiny_llama(), config)


def _trainer_run(backend: str | None, tmp_path: Any) -> torch.nn.Module:
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
    os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
    model = _lora_llama()
    rows = [{"input_ids": ids, "labels": ids} for ids in _tokens(5, (6, 12))]
    args = TrainingArguments(
        output_dir=str(tmp_path / (backend or "eager")), max_steps=3, per_device_train_batch_size=2,
        learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, seed=0, data_seed=0, torch_compile_backend=backend,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=rows).train()
    return model


def test_hf_trainer_fine_tunes_a_peft_lora_model_as_eager(tmp_path: Any) -> None:
    """Two recipes in one compile (the suite's time): Trainer compiles the model it is given, here PEFT's LoRA
    wrapper of a Llama, and trains the adapters (AdamW, three steps) to eager's values."""
    torch._dynamo.reset()
    STATS.reset()
    compiled = _trainer_run("neuron", tmp_path)
    assert STATS.count() >= 2  # a forward and a backward reached the backend
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in compiled.named_parameters())  # adapters trained
    _assert_same_parameters(compiled, _trainer_run(None, tmp_path))


# -- accelerate: dynamo_backend="neuron", a partial last batch under dynamic=None ------------------------------------
def _accelerate_run(backend: str) -> tuple[list[float], torch.nn.Module]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    AcceleratorState._reset_state(True)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(10, 8, generator=g), torch.randn(10, 1, generator=g))  # batches 4, 4, 2
    accelerator = Accelerator(dynamo_backend=backend, cpu=True)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=4))
    losses = []
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, accelerator.unwrap_model(model, keep_torch_compile=False)


def test_accelerate_partial_last_batch_compiles_one_more_graph() -> None:
    """accelerate passes dynamic=None: the last batch of 2 (after batches of 4) compiles its own static forward
    and backward instead of a symbolic graph (NeuronDynamicShapeError before graph_checks.keep_shapes_static)."""
    torch._dynamo.reset()
    STATS.reset()
    losses, model = _accelerate_run("neuron")
    assert STATS.count() == 4  # forward and backward for batch 4, then for batch 2
    eager_losses, eager_model = _accelerate_run("no")
    torch.testing.assert_close(losses, eager_losses, **_TRAINED)
    _assert_same_parameters(model, eager_model)


# -- diffusers: a DiT compiled for a DDPM sampling loop ----------------------------------------------------------------
def test_diffusers_dit_in_a_sampling_loop_as_eager() -> None:
    """A class-conditional DiT compiled as in a pipeline (``pipe.transformer = torch.compile(...)``), denoising three
    steps of diffusers' DDPM scheduler: the timestep is a tensor input, so every step runs the one graph. In eval
    mode the label dropout of DiT's class embedding is off. (Training a diffusers UNet: tests/test_models.py's
    sd_unet.)"""
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=1, sample_size=8,
        patch_size=2, num_embeds_ada_norm=1000, norm_num_groups=1,
    ).eval()  # fmt: skip
    compiled = torch.compile(dit, backend="neuron")
    g = torch.Generator().manual_seed(6)
    start, labels = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([1, 3])
    STATS.reset()
    results = []
    for model in (compiled, dit):
        scheduler = DDPMScheduler(num_train_timesteps=1000)
        scheduler.set_timesteps(3)
        sample, g = start.clone(), torch.Generator().manual_seed(7)
        with torch.no_grad():
            for t in scheduler.timesteps:
                noise_pred = model(sample, timestep=t.expand(2), class_labels=labels, return_dict=False)[0]
                sample = scheduler.step(noise_pred, t, sample, generator=g).prev_sample
        results.append(sample)
    assert STATS.count() == 1
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-5)


# -- Lightning: the inner model compiled ----------------------------------------------------------------------------
def _lightning_run(backend: str | None) -> torch.nn.Module:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(2)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            # The inner model, not the LightningModule: Dynamo fails on self.log in training_step.
            self.forward_net = torch.compile(self.net, backend=backend) if backend else self.net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.forward_net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g))
    module = Regressor()
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=2))
    return module.net


def test_lightning_with_the_inner_model_compiled() -> None:
    torch._dynamo.reset()
    STATS.reset()
    compiled = _lightning_run("neuron")
    assert STATS.count() == 2
    _assert_same_parameters(compiled, _lightning_run(None))


# -- torchtitan: its Llama 3 debug model compiled per TransformerBlock by its own apply_compile ------------------------
_TITAN_SEQ = 16


def _torchtitan_run(backend: str | None) -> tuple[list[float], list[dict[str, torch.Tensor]], torch.nn.Module]:
    """torchtitan's llama3 ``debugmodel`` (dim 256, 16 heads, vocab 2048; two of its six blocks) trained three
    steps. Its language models take FlexAttention or varlen only, and its apply_compile refuses a FlexAttention
    model under any backend but inductor and aot_eager; varlen is a CUDA flash kernel. The blocks here take
    torchtitan's own ScaledDotProductAttention (the one its Flux model builds), which apply_compile accepts: it
    then compiles each TransformerBlock with ``backend="neuron", fullgraph=True`` and the loss with the backend,
    as ``--compile.enable --compile.backend neuron`` does."""
    import dataclasses

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    layers = []
    for layer in config.layers[:2]:
        rope = dataclasses.replace(layer.attention.rope, max_seq_len=_TITAN_SEQ)  # as its trainer sets seq_len
        attention = dataclasses.replace(layer.attention, inner_attention=ScaledDotProductAttention.Config(), rope=rope)
        layers.append(dataclasses.replace(layer, attention=attention))
    torch.manual_seed(0)
    model = dataclasses.replace(config, layers=layers).build()
    model.init_states()
    compile_config = CompileConfig(enable=backend is not None, backend=backend or "inductor")
    if backend is not None:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(model, compile_config=compile_config, parallel_dims=dims)
        assert all(block._compiled_call_impl is not None for block in model.layers.values())
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=compile_config)
    # SGD, not the debug config's AdamW: Adam divides by sqrt(v), so a weight whose gradient is near zero moves by
    # up to lr on rounding noise, which would hide the comparison of the backend's numbers in the optimizer's.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(3):
        tokens = torch.randint(0, 2048, (2, _TITAN_SEQ + 1), generator=g)
        loss, _ = loss_fn(model(tokens[:, :-1]), tokens[:, 1:], global_valid_tokens=torch.tensor(2 * _TITAN_SEQ))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, model


def test_torchtitan_llama3_blocks_compiled_by_its_apply_compile_as_eager() -> None:
    """The losses, every step's gradients and the parameters after three SGD steps match eager's."""
    torch._dynamo.reset()
    STATS.reset()
    # apply_compile sets these process-wide; the patch gives the other tests their values back
    with torch._dynamo.config.patch(capture_scalar_outputs=False, skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        losses, grads, model = _torchtitan_run("neuron")
    # the block's forward and backward (the two blocks share one graph), the loss's forward and backward
    assert STATS.count() == 4
    eager_losses, eager_grads, eager_model = _torchtitan_run(None)
    torch.testing.assert_close(losses, eager_losses, **_TRAINED)
    for step, (grad, eager_grad) in enumerate(zip(grads, eager_grads)):
        for name, value in grad.items():
            torch.testing.assert_close(value, eager_grad[name], **_TRAINED, msg=lambda m: f"step {step} {name}: {m}")
    _assert_same_parameters(model, eager_model)
