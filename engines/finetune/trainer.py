"""`mlx finetune`: H-Tuning (mix-order LoRA), first-order LoRA and full fine-tuning, resumably.

One run class serves the three recipes; only the gradient of a step differs
(`steps.first_order_step` for lora and full, `steps.mix_order_step` for htuning). Each
optimiser step takes a global batch of `batch_sequences` sequences, split over the
processes of a torchrun launch and then into micro-batches (see `steps`).

Work in progress lives beside the output, in `.<out>.finetune-work/`: the run key, the
latest checkpoint (the trainable tensors, the optimiser, the RNG, the step; the step fixes
the learning rate, the batch order and the SPSA seed) and the log. A rerun of the same
command resumes from the checkpoint and ends with the same weights as an uninterrupted run.
The result is written atomically to `out` with the log and a manifest, and the work
directory is removed. Every check of the user's input runs before the work directory is
created, so a refused run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlxkit.engines.core.manifest import Manifest, content_hash
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.core.seeds import derive_seed
from mlxkit.engines.errors import InputError
from mlxkit.engines.finetune.data import (Batch, Examples, LabelledTexts, classification_examples, lm_examples,
                                          read_raw)
from mlxkit.engines.finetune.model import build_model, fo_layer_parameters, save_outputs
from mlxkit.engines.finetune.recipe import FinetuneRecipe
from mlxkit.engines.finetune.steps import MixOrderSplit, first_order_step, mix_order_step
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.training.budget import check_data_vs_batch, check_training_fits, optimiser_bytes
from mlxkit.engines.training.checkpointer import Checkpointer
from mlxkit.engines.training.run import TrainingOptions, TrainingRun
from mlxkit.engines.training.loop import StepOutcome, log_interval
from mlxkit.engines.training.schedule import batch_indices
from mlxkit.engines.training.spec import build_adamw, gradient_checkpointing_on
from mlxkit.engines.training.sharding import build_sharded, meta_model, sharding_on
from mlxkit.engines.training.step import (check_global_batch, clip_and_step, enable_gradient_checkpointing,
                                          place_trainable, release_freed_host_memory, set_learning_rate)
from mlxkit.engines.training.work import check_run_key, finished_run_key, refuse_existing_output

LOG_NAME = "finetune_log.jsonl"


@dataclass(frozen=True)
class FinetuneOptions(TrainingOptions):
    model: str
    data: Path
    out: Path
    recipe: FinetuneRecipe
    eval_data: Path | None = None   # held-out text for a causal LM (default: a split of --data)
    text_field: str = "text"
    merge: bool = False             # adapter recipes: write the merged model instead of the adapter
    allow_pickle: bool = False


class FinetuneRun(TrainingRun):
    """finetune: setup, train and save over the shared training core."""

    work_kind = "finetune"
    log_name = LOG_NAME

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Check everything, load and prepare; the work directory appears only once all checks passed."""
        from mlxkit.engines.models.loading import (check_local_weights, load_config, load_model, load_tokenizer,
                                                   resolve_spec, source_dtype)

        recipe, options = self.recipe, self.options
        self._check_options()
        text_field, label_field = options.text_field, recipe.data.label_field
        raw = read_raw(options.data, recipe.objective, text_field, label_field)
        eval_raw = None
        if options.eval_data is not None:
            eval_raw = read_raw(options.eval_data, "causal_lm", text_field, label_field)
        # Under sharding only rank 0 reads the weights; the other ranks build the model on the meta device and
        # receive their shards from rank 0 (`build_sharded`), so no process but rank 0 holds the whole model.
        self.sharded = self._sharded()
        self.source = resolve_spec(options.model, self.reporter)
        if self.dist.is_main or not self.sharded:
            loaded = load_model(self.source, allow_pickle=options.allow_pickle, reporter=self.reporter)
            self.tokenizer, lm = loaded.tokenizer, loaded.model
            del loaded
        else:
            check_local_weights(self.source, options.allow_pickle)
            self.tokenizer = load_tokenizer(self.source)
            lm = meta_model(load_config(options.model, reporter=self.reporter), torch.float32)
        self.save_dtype = self.placement.save_dtype(source_dtype(self.source), options.save_dtype)
        prefer_sdpa(lm.config)
        positions = getattr(lm.config, "max_position_embeddings", None)
        if positions and recipe.data.seq_len > positions:
            raise InputError(f"data.seq_len {recipe.data.seq_len} exceeds the model's {positions} positions")
        # peft's LoRA A matrices, the classification head and any dropout draw from torch's global RNG.
        torch.manual_seed(derive_seed(options.seed, "finetune"))
        labels = raw.label_names if isinstance(raw, LabelledTexts) else None
        self.model, self.peft = build_model(lm, recipe, labels, model_spec=f"model '{options.model}'")

        def prepare(model: torch.nn.Module) -> None:
            if gradient_checkpointing_on(recipe.gradient_checkpointing, self.placement.device):
                enable_gradient_checkpointing(model)

        if self.sharded:
            build_sharded(lm, self.placement, self.dist, dtype=torch.float32, trainable=True, prepare=prepare)
        else:
            place_trainable(self.model, self.placement)
            prepare(lm)
        self.labels = labels
        self.params = [p for _, p in self.model.trainable()]
        if recipe.method == "htuning":
            assert recipe.htuning is not None
            fo_ids = fo_layer_parameters(self.model, recipe.htuning.fo_layers)
            self.split = MixOrderSplit(zo=[p for p in self.params if id(p) not in fo_ids],
                                       fo=[p for p in self.params if id(p) in fo_ids])
            if not self.split.zo:
                raise InputError("htuning leaves no tensor to the zeroth-order estimate (lower htuning.fo_layers)")
        self.train_data, self.val_data = self._examples(raw, eval_raw)
        self._check_budget(lm)
        self.units_per_sequence = 1 if labels is not None else recipe.data.seq_len - 1
        self.steps = recipe.schedule.steps
        spec = recipe.optim
        self.optimizer = build_adamw(self.params, spec)
        check_run_key(self.work, self._run_key(), self.dist, what="an unfinished fine-tuning run", reporter=self.reporter)
        self.checkpointer = Checkpointer(self.work, self.dist, sharded=self.sharded,
                                         trainable_only=self.peft is not None)
        self.start_or_resume(self.model, recipe.method, self.steps)

    def _check_budget(self, lm) -> None:
        """Refuse, before the optimiser allocates, a run the machine or device cannot hold; say when one batch
        dwarfs the data."""
        spec = self.recipe.optim
        weights = sum(p.numel() * p.element_size() for p in lm.parameters())
        state = weights + optimiser_bytes(sum(p.numel() for p in self.params))
        check_training_fits(state, lm.config, min(spec.micro_batch_sequences, spec.batch_sequences),
                            self.recipe.data.seq_len, self.placement,
                            f"{self.recipe.method} fine-tuning of '{self.options.model}'",
                            shards=self.dist.world_size if self.sharded else 1)
        check_data_vs_batch(len(self.train_data), spec.batch_sequences, self.reporter)

    def _sharded(self) -> bool:
        """FSDP for plain LoRA and full fine-tuning of a causal LM; the other runs stay replicated, with a notice."""
        if not sharding_on(self.options.sharding, self.dist):
            return False
        recipe = self.recipe
        reason = ("H-Tuning's SPSA perturbs whole tensors" if recipe.method == "htuning" else
                  "the classification head lives outside the language model" if recipe.objective != "causal_lm" else
                  "--merge folds the adapter into whole weights" if self.options.merge else None)
        if reason is None:
            return True
        if self.options.sharding == "fsdp":
            raise InputError(f"--sharding fsdp cannot serve this run: {reason} (use --sharding none)")
        self.reporter.notice(f"{self.dist.world_size} processes keep full replicas: {reason}")
        return False

    def _plain_model(self) -> tuple[tuple[Any, Any], torch.nn.Module]:
        """For a sharded run's weights gathered onto rank 0: the base read again on the CPU and made trainable
        the same way, as (model, peft wrapper), with the language model the weights load into."""
        from mlxkit.engines.models.loading import load_model

        lm = load_model(self.source, with_tokenizer=False, allow_pickle=self.options.allow_pickle).model
        torch.manual_seed(derive_seed(self.options.seed, "finetune"))
        return build_model(lm, self.recipe, self.labels, model_spec=f"model '{self.options.model}'"), lm

    def _check_options(self) -> None:
        recipe, options = self.recipe, self.options
        if not options.overwrite:
            refuse_existing_output(self.out, self.work, self.dist)
        check_global_batch(recipe.optim.batch_sequences, self.dist.world_size, "optim.batch_sequences")
        if options.merge and recipe.method == "full":
            raise InputError("--merge folds an adapter into the base; the full recipe already writes whole weights")
        if options.eval_data is not None and recipe.objective != "causal_lm":
            raise InputError("--eval-data is held-out text for the causal-LM objective; classification holds out "
                             "data.held_out_sequences examples of --data")

    def _examples(self, raw, eval_raw) -> tuple[Examples, Examples]:
        data, seed = self.recipe.data, self.options.seed
        if isinstance(raw, LabelledTexts):
            return classification_examples(self.tokenizer, raw, seq_len=data.seq_len,
                                           held_out=data.held_out_sequences, seed=seed)
        needed = self.recipe.schedule.steps * self.recipe.optim.batch_sequences
        return lm_examples(self.tokenizer, raw, seq_len=data.seq_len, train_sequences=needed,
                           held_out=data.held_out_sequences, seed=seed, eval_texts=eval_raw)

    def _run_key(self) -> dict[str, Any]:
        def hashed(path: Path | None) -> Any:
            return None if path is None else {"spec": str(path), "hash": content_hash(path)}

        model_path = self.source.path
        return {"model": {"spec": self.source.spec,
                          "hash": content_hash(model_path) if model_path is not None else None},
                "data": hashed(self.options.data), "eval_data": hashed(self.options.eval_data),
                "text_field": self.options.text_field, "seed": self.options.seed, "steps": self.steps,
                "compute_dtype": str(self.placement.dtype),
                "recipe": self.recipe.model_dump(exclude={"name", "description", "schedule"})}

    # ------------------------------------------------------------------ train
    def _pieces(self, indices: list[int]) -> list[Batch]:
        micro = self.recipe.optim.micro_batch_sequences
        return [self.train_data.batch(indices[lo:lo + micro]).to(self.placement.device)
                for lo in range(0, len(indices), micro)]

    def train_step(self, step: int) -> StepOutcome:
        """One optimiser step on the global batch of `step`; its loss terms are global means."""
        spec = self.recipe.optim
        indices = batch_indices(step, spec.batch_sequences, len(self.train_data), self.options.seed)
        rank, world = self.dist.rank, self.dist.world_size
        units = spec.batch_sequences * self.units_per_sequence
        set_learning_rate(self.optimizer, spec.lr_at(step, self.steps))
        self.optimizer.zero_grad(set_to_none=True)
        if self.recipe.method == "htuning":
            ht = self.recipe.htuning
            assert ht is not None
            fo_mine = indices[rank:ht.fo_sequences:world]  # this rank's part of the first fo_sequences
            terms = mix_order_step(self.model, self.split, self._pieces(indices[rank::world]), self._pieces(fo_mine),
                                   units, ht.fo_sequences * self.units_per_sequence, ht,
                                   derive_seed(self.options.seed, "spsa", step), self.dist, self.placement)
        else:
            terms = first_order_step(self.model, self.params, self._pieces(indices[rank::world]), units, self.dist,
                                     self.placement)
        clip_and_step(self.optimizer, self.params, spec.grad_clip)
        release_freed_host_memory(self.placement.device)
        return StepOutcome(terms, int(self.train_data.lengths[indices].sum()), {"loss": terms["loss"]})

    def evaluate(self) -> dict[str, float]:
        with contextlib.nullcontext() if self.sharded else self.placement.autocast():
            return self.model.evaluate(self.val_data, self.recipe.optim.micro_batch_sequences)

    def train(self) -> dict[str, Any] | None:
        """Run the remaining steps; returns the summary, or None when stopped early or on a non-main rank."""
        loop = self.step_loop(self.steps, self.recipe.schedule, collective=self.sharded,
                              log_every=log_interval(self.placement.device), loss_name="the fine-tuning loss")
        finished = loop.run(title=f"{self.recipe.method}: {self.steps} steps of {self.recipe.optim.batch_sequences} "
                                  "sequences", step=self.train_step, evaluate=self.evaluate, optimizer=self.optimizer,
                            checkpoint=lambda: self.checkpointer.save(self.model, self.optimizer, self.state))
        if not self.finish_training(finished, self.model.lm):
            return None  # every rank meets the others again in cleanup()
        return self._summary(loop.records())

    def _summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {"method": self.recipe.method, "objective": self.recipe.objective,
                "batch_sequences": self.recipe.optim.batch_sequences, "seq_len": self.recipe.data.seq_len,
                **self.common_summary(records), "saved_dtype": str(self.save_dtype).removeprefix("torch."),
                "trainable_parameters": sum(p.numel() for p in self.params),
                "parameters": sum(p.numel() for p in self.model.parameters())}

    # ------------------------------------------------------------------ save
    def save(self, summary: dict[str, Any]) -> Path:
        options = self.options
        manifest = Manifest(verb="finetune", started=self.started)
        manifest.add_input("model", options.model, self.source.path)
        manifest.add_input("data", str(options.data), options.data)
        if options.eval_data is not None:
            manifest.add_input("eval_data", str(options.eval_data), options.eval_data)
        manifest.seeds = {"seed": options.seed}
        manifest.settings = {"recipe": self.recipe.model_dump(), "merge": options.merge,
                             "run_key": finished_run_key(self.work), **options.manifest_extra}
        model, peft = self.checkpointer.unsharded((self.model, self.peft), self._plain_model)
        model.eval()
        return self.write_output(manifest, summary, lambda tmp: {
            "format": save_outputs(model, peft, self.tokenizer, tmp, merge=options.merge, dtype=self.save_dtype)})


def run_finetune(options: FinetuneOptions, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train (or resume) and save; returns the summary ({} on non-main ranks or when stopped early)."""
    return FinetuneRun(options, reporter).execute()
