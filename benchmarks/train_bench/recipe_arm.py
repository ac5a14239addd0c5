"""The recipe's arm: the engine :mod:`recipe.train` builds, stepped by the recipe's own
:func:`recipe.training.step.train_step` (never re-implemented here)."""

from __future__ import annotations

import torch

from _common import TextSpec, build_recipe_arm  # noqa: E402  (puts the repository on sys.path)

from .runner import Runner

__all__ = ["RecipeRunner"]


class RecipeRunner(Runner):
    """The recipe: the engine :mod:`recipe.train` builds (DeepSpeed, SRAdamW over the CLIP paper's
    groups) stepped by the recipe's own :func:`recipe.training.step.train_step`."""

    def __init__(
        self,
        preset: str,
        loss_mode: str,
        ckpt: bool,
        ds_config: str,
        device: torch.device,
        batch: int,
        seed: int = 0,
        accumulation: int = 1,
        contrastive_batch: str = "global",
        compile: bool = False,
    ) -> None:
        from recipe.loss import ClipLoss
        from recipe.training.precision import read_ds_config
        from recipe.training.step import TrainState

        ds = read_ds_config(ds_config)  # a bad JSON is named, as in training
        if batch % accumulation:
            raise ValueError(f"batch {batch} is not a multiple of the accumulation {accumulation}")
        ds["train_micro_batch_size_per_gpu"] = batch // accumulation
        ds["gradient_accumulation_steps"] = accumulation
        ds.pop("train_batch_size", None)
        self.arm = build_recipe_arm(preset, ds, seed, grad_checkpointing=ckpt)
        self.loss_fn = ClipLoss(mode=loss_mode, validate=False)
        self.state = TrainState()
        self.device = device
        self.name = f"recipe-{loss_mode}"
        self.accumulation, self.contrastive_batch = accumulation, contrastive_batch
        self.description = (
            f"recipe {preset}, DeepSpeed {self.arm.precision.label} (SR text, exact-master image), ClipLoss {loss_mode}"
        )
        if accumulation > 1:
            self.description += f", {accumulation} micro-batches per step, contrastive batch {contrastive_batch}"
        if compile:  # after deepspeed.initialize: fine under ZeRO 0-2 (compile_towers refuses ZeRO-3 here)
            from recipe.training.engine import compile_towers

            compile_towers(self.arm.model, self.arm.engine.zero_optimization_stage())
            self.description += ", towers compiled (torch.compile)"
        model = self.arm.model
        self.text = TextSpec.of(model)
        self.image_size = int(model.image_data_config()["input_size"][-1])
        self.params = sum(p.numel() for p in model.parameters())

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        from recipe.training.step import train_step

        a, k = self.arm, self.accumulation
        micro = next(iter(inputs.values())).shape[0] // k
        batches = [{n: v[i * micro : (i + 1) * micro] for n, v in inputs.items()} for i in range(k)]
        result = train_step(
            a.engine, a.optimizer, self.loss_fn, a.precision, batches, self.state, max_nonfinite_in_row=10**9,
            contrastive_batch=self.contrastive_batch,
        )
        # host read, once per step in every arm alike: the measurement checks that the losses are finite
        return float(result.loss)
