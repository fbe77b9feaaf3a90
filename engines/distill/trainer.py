"""`mlx distill --gkd` and `--kd`: train a student against a frozen teacher, resumably.

One loop serves both modes; the recipe's loss weights are the difference:

* GKD (global distillation of a Puzzle child): cosine distance between the teacher's and
  the student's hidden states after every layer, plus KL(teacher || student) on the
  logits, and no LM loss. The student must have the teacher's layer count and width.
* KD: any student with the teacher's tokenizer; T²·KL at temperature T mixed with
  cross-entropy on the data.

Each optimiser step takes a global batch of `batch_sequences` sequences, split over the
processes of a torchrun / accelerate launch (rank r takes sequences r, r+W, ...) and then
into micro-batches. Every piece's loss is its sum over positions divided by the global
batch's position count and gradients are summed over ranks, so W processes compute the
gradient one process computes for the same global batch.

Work in progress lives beside the output, in `.<out>.distill-work/`: the run key, the
token blocks, the latest checkpoint and the log. A rerun of the same command resumes from
the checkpoint; the finished student is saved atomically to `out` with the log and a
manifest, and the work directory is removed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from mlxkit.engines.core.atomic import atomic_file, atomic_write_json
from mlxkit.engines.core.manifest import Manifest, content_hash
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.distill.losses import cosine_distance_sum, logit_term_sums
from mlxkit.engines.distill.recipe import DistillRecipe
from mlxkit.engines.errors import InputError
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.models.heads import OutputHead
from mlxkit.engines.training.checkpointer import Checkpointer
from mlxkit.engines.training.distributed import gradients
from mlxkit.engines.training.run import TrainingOptions, TrainingRun
from mlxkit.engines.training.loop import StepOutcome, log_interval
from mlxkit.engines.training.schedule import batch_indices
from mlxkit.engines.training.spec import build_adamw, gradient_checkpointing_on
from mlxkit.engines.training.sharding import build_sharded, is_sharded, meta_model, sharding_on
from mlxkit.engines.training.step import (check_global_batch, clip_and_step, decoder_states,
                                          enable_gradient_checkpointing, place_frozen, place_trainable,
                                          release_freed_host_memory, set_learning_rate, term_sums)
from mlxkit.engines.training.work import check_run_key, finished_run_key, refuse_existing_output

Mode = Literal["gkd", "kd"]
LOG_NAME = "distill_log.jsonl"
# Without --data, training text is sampled from the teacher; sampling is slow on a CPU, so
# at most this many sequences are sampled and the steps cycle over them.
MAX_SAMPLED_SEQUENCES = 32


@dataclass(frozen=True)
class DistillationOptions(TrainingOptions):
    mode: Mode
    teacher: str
    student: str
    out: Path
    recipe: DistillRecipe
    data: Path | None = None
    text_field: str = "text"
    tokens: int | None = None
    allow_pickle: bool = False


class DistillationRun(TrainingRun):
    """distill: setup, train and save over the shared training core."""

    work_kind = "distill"
    log_name = LOG_NAME

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from mlxkit.engines.models.loading import (check_local_weights, load_config, load_model, load_tokenizer,
                                                   resolve_spec, source_dtype)

        if not self.options.overwrite:
            refuse_existing_output(self.out, self.work, self.dist)
        spec = self.recipe.optim
        check_global_batch(spec.batch_sequences, self.dist.world_size, "optim.batch_sequences")
        # The teacher only runs forwards: it is read straight into the compute dtype. The student's
        # float32 copy is its master weights. Under sharding only rank 0 reads the weights: the other
        # ranks build both models on the meta device and receive their shards from rank 0
        # (`build_sharded`), so no process but rank 0 holds a whole model, and no GPU does.
        self.sharded = sharding_on(self.options.sharding, self.dist)
        reads_weights = self.dist.is_main or not self.sharded
        self.teacher_source = resolve_spec(self.options.teacher, self.reporter)
        if reads_weights:
            teacher = load_model(self.teacher_source, dtype=self.placement.dtype,
                                 allow_pickle=self.options.allow_pickle, reporter=self.reporter)
            self.teacher, teacher_tokenizer = teacher.model, teacher.tokenizer
            del teacher
        else:
            check_local_weights(self.teacher_source, self.options.allow_pickle)
            self.teacher = meta_model(load_config(self.options.teacher, reporter=self.reporter), self.placement.dtype)
            teacher_tokenizer = load_tokenizer(self.teacher_source)
        self.student_source = resolve_spec(self.options.student, self.reporter)
        check_local_weights(self.student_source, self.options.allow_pickle)
        student_config = load_config(self.options.student, reporter=self.reporter)
        self.tokenizer = load_tokenizer(self.student_source)
        self._check_pair(self.teacher.config, teacher_tokenizer, student_config, self.tokenizer)
        self.trained_layers = self._trained_layers(student_config)
        self._check_memory(self.teacher, student_config)
        self.save_dtype = self.placement.save_dtype(source_dtype(self.student_source), self.options.save_dtype)
        prefer_sdpa(self.teacher.config)
        if not self.sharded:
            place_frozen(self.teacher, self.placement)
        self.seq_len = self.recipe.data.seq_len
        positions = getattr(student_config, "max_position_embeddings", None)
        if positions and self.seq_len > positions:
            raise InputError(f"data.seq_len {self.seq_len} exceeds the student's {positions} positions")
        tokens = self.options.tokens or self.recipe.schedule.tokens
        self.steps = max(1, math.ceil(tokens / (spec.batch_sequences * self.seq_len)))
        self._check_or_write_run_key()
        self.train_ids, self.val_ids = self._token_blocks()  # may sample from the whole teacher on rank 0
        self.teacher_cache = None
        if self.recipe.loss.teacher_top_k is not None:
            if self.sharded:
                # A sharded teacher's forward is collective: every rank would have to miss together.
                raise InputError("loss.teacher_top_k needs a replicated teacher: run with --sharding none")
            from mlxkit.engines.distill.teacher_cache import TeacherLogitCache

            self.teacher_cache = TeacherLogitCache(_source_key(self.teacher_source), self.recipe.loss.teacher_top_k,
                                                   self.recipe.loss.temperature,
                                                   str(self.placement.dtype).removeprefix("torch."))
        if self.sharded:
            self.teacher = build_sharded(self.teacher, self.placement, self.dist, dtype=self.placement.dtype,
                                         trainable=False)
            gc.collect()
        if reads_weights:
            student = load_model(self.student_source, with_tokenizer=False, allow_pickle=self.options.allow_pickle,
                                 reporter=self.reporter).model
        else:
            student = meta_model(student_config, torch.float32)
        self.generation_config = student.generation_config
        prefer_sdpa(student.config)

        def prepare(model: torch.nn.Module) -> None:
            if self.trained_layers is not None:
                model.requires_grad_(False)
                for index in self.trained_layers:
                    model.model.layers[index].requires_grad_(True)
            if gradient_checkpointing_on(self.recipe.gradient_checkpointing, self.placement.device):
                enable_gradient_checkpointing(model)

        if self.sharded:
            self.student = build_sharded(student, self.placement, self.dist, dtype=torch.float32, trainable=True,
                                         prepare=prepare)
            gc.collect()
        else:
            place_trainable(student, self.placement)
            prepare(student)
            self.student = student
        del student
        self.params = [p for p in self.student.parameters() if p.requires_grad]
        self.optimizer = build_adamw(self.params, spec)
        self.checkpointer = Checkpointer(self.work, self.dist, sharded=self.sharded)
        self.start_or_resume(self.student, self.options.mode.upper(), self.steps)

    @property
    def _autocast(self):
        """Autocast lowers a replicated run's compute; a sharded run's lower-precision weights come from FSDP."""
        return contextlib.nullcontext() if self.sharded else self.placement.autocast()

    def _check_pair(self, t, teacher_tokenizer, s, student_tokenizer) -> None:
        """Teacher config `t` and student config `s` must share a vocabulary (and, for GKD, widths and depth)."""
        if t.vocab_size != s.vocab_size or (teacher_tokenizer is not None and student_tokenizer is not None
                                            and teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab()):
            raise InputError(f"teacher '{self.options.teacher}' and student '{self.options.student}' have different "
                             f"vocabularies ({t.vocab_size} vs {s.vocab_size} tokens, or different token ids); "
                             "distillation needs a shared tokenizer")
        if self.recipe.loss.cosine_weight > 0:
            if t.hidden_size != s.hidden_size:
                raise InputError(f"the cosine hidden-state loss needs equal widths: teacher hidden size "
                                 f"{t.hidden_size}, student {s.hidden_size} (use --kd, or set loss.cosine_weight=0)")
            if t.num_hidden_layers != s.num_hidden_layers:
                raise InputError(f"the cosine hidden-state loss pairs layers: teacher has {t.num_hidden_layers}, "
                                 f"student {s.num_hidden_layers} (use --kd, or set loss.cosine_weight=0)")

    def _check_memory(self, teacher, student_config) -> None:
        """Refuse, before the student's weights are read, a run whose lower-bound memory exceeds the device's:
        the teacher as loaded, the student's float32 weights with the gradients and AdamW moments of what
        trains, one micro-batch's activations of the student, and the teacher's hidden states for the cosine."""
        from transformers import AutoModelForCausalLM

        from mlxkit.engines.training.budget import check_training_fits, optimiser_bytes

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(student_config)
        student = sum(p.numel() for p in skeleton.parameters())
        if self.trained_layers is None:
            trainable = student
        else:
            trainable = sum(p.numel() for i in self.trained_layers for p in skeleton.model.layers[i].parameters())
        del skeleton
        spec = self.recipe.optim
        state = sum(p.numel() * p.element_size() for p in teacher.parameters()) + 4 * student + \
            optimiser_bytes(trainable)
        hidden = getattr(student_config, "hidden_size", 0) * getattr(student_config, "num_hidden_layers", 0)
        check_training_fits(state, student_config, min(spec.micro_batch_sequences, spec.batch_sequences),
                            self.recipe.data.seq_len, self.placement,
                            f"{self.options.mode.upper()} of '{self.options.student}' against '{self.options.teacher}'",
                            shards=self.dist.world_size if self.sharded else 1,
                            extra_elements_per_token=hidden if self.recipe.loss.cosine_weight > 0 else 0)

    def _trained_layers(self, student_config) -> list[int] | None:
        """The decoder layers that train under `trainable: replaced_blocks` (None: every weight trains)."""
        from mlxkit.engines.models.decilm.blocks import replaced_layers

        if self.recipe.trainable == "all":
            return None
        replaced = replaced_layers(student_config)
        if replaced is None:
            raise InputError(f"trainable=replaced_blocks needs a Puzzle child (a config with block_configs); "
                             f"'{self.options.student}' has none (use trainable=all)")
        if not replaced:
            raise InputError(f"'{self.options.student}' keeps every parent block, so trainable=replaced_blocks "
                             "leaves nothing to train (use trainable=all)")
        n, reach = student_config.num_hidden_layers, self.recipe.neighbours
        layers = sorted({j for i in replaced for j in range(max(0, i - reach), min(n, i + reach + 1))})
        self.reporter.notice(f"training {len(layers)} of {n} decoder layers ({len(replaced)} with replaced blocks, "
                             f"{reach} neighbour(s) either side); the rest of the student stays frozen")
        return layers

    def _run_key(self) -> dict[str, Any]:
        data: Any = "sampled from the teacher"
        if self.options.data is not None:
            data = {"spec": str(self.options.data), "hash": content_hash(self.options.data)}
        return {"mode": self.options.mode, "teacher": _source_key(self.teacher_source),
                "student": _source_key(self.student_source), "data": data, "seed": self.options.seed,
                "steps": self.steps, "world_batch": self.recipe.optim.batch_sequences,
                "compute_dtype": str(self.placement.dtype),
                "recipe": self.recipe.model_dump(exclude={"schedule", "name", "description"})}

    def _check_or_write_run_key(self) -> None:
        check_run_key(self.work, self._run_key(), self.dist, what="an unfinished distillation run", reporter=self.reporter)

    def _token_blocks(self) -> tuple[Any, torch.Tensor]:
        """(training blocks, held-out blocks). Text from --data is tokenised once into memory-mapped shards (see
        `engines/data/token_shards.py`), from which every rank reads only the blocks of its share of each step;
        text sampled from the teacher is small and kept whole in the work directory."""
        held_out = self.recipe.data.held_out_sequences
        needed = self.steps * self.recipe.optim.batch_sequences
        if self.options.data is not None:
            return self._data_blocks(held_out, needed)
        path = self.work / "tokens.pt"
        if self.dist.is_main and not path.exists():
            from mlxkit.engines.data.sampled import sample_tokens

            n_train = min(needed, MAX_SAMPLED_SEQUENCES)
            blocks = sample_tokens(self.teacher, self.tokenizer, n_sequences=n_train + held_out,
                                   seq_len=self.seq_len, seed=self.options.seed, reporter=self.reporter)
            train, val = blocks[held_out:], blocks[:held_out]
            self._announce_data("text sampled from the teacher", train.shape[0], val.shape[0])
            with atomic_file(path) as tmp:
                torch.save({"train": train, "val": val}, tmp)
        self.dist.barrier()
        tokens = torch.load(path, weights_only=True)
        return tokens["train"], tokens["val"]

    def _data_blocks(self, held_out: int, needed: int) -> tuple[Any, torch.Tensor]:
        from mlxkit.engines.data.token_shards import (TokenShards, build_token_shards, default_shard_root,
                                                      split_blocks)

        limit = max((needed + held_out) * self.seq_len, self.recipe.data.corpus_tokens)
        reference = self.work / "tokens.json"
        if self.dist.is_main and not reference.exists():
            shards = build_token_shards(self.options.data, self.tokenizer, default_shard_root(),
                                        text_field=self.options.text_field, max_tokens=limit,
                                        notice=self.reporter.notice)
            atomic_write_json(reference, {"shards": str(shards.path), "limit": limit})
        self.dist.barrier()
        recorded = json.loads(reference.read_text())
        shards = TokenShards(recorded["shards"], limit=recorded["limit"])
        n = shards.num_blocks(self.seq_len)
        if n <= held_out:
            raise InputError(f"--data gives {n} sequence(s) of {self.seq_len} tokens; need more than the "
                             f"{held_out} held out for evaluation")
        train, val = split_blocks(shards, self.seq_len, held_out, self.options.seed)
        if self.dist.is_main:
            self._announce_data(str(self.options.data), train.shape[0], val.shape[0])
        return train, val

    def _announce_data(self, origin: str, n_train: int, n_val: int) -> None:
        from mlxkit.engines.data.token_shards import repeat_message

        batch = self.recipe.optim.batch_sequences
        self.reporter.notice(f"{self.options.mode.upper()} data: {origin} ({n_train} training and {n_val} held-out "
                             f"sequences of {self.seq_len} tokens; {self.steps} steps of {batch} sequences)")
        if self.steps * batch > n_train:
            self.reporter.notice(repeat_message(n_train * self.seq_len, self.steps * batch * self.seq_len))

    # ------------------------------------------------------------------ train
    def train_step(self, step: int) -> StepOutcome:
        """One optimiser step on the global batch of `step`; its loss terms are global means."""
        spec, loss_spec = self.recipe.optim, self.recipe.loss
        indices = batch_indices(step, spec.batch_sequences, self.train_ids.shape[0], self.options.seed)
        mine = indices[self.dist.rank::self.dist.world_size]
        predicted = spec.batch_sequences * (self.seq_len - 1)   # positions with a next token, whole global batch
        positions = spec.batch_sequences * self.seq_len
        n_layers = self.student.config.num_hidden_layers
        set_learning_rate(self.optimizer, spec.lr_at(step, self.steps))
        self.optimizer.zero_grad(set_to_none=True)
        sums = term_sums(3, self.placement.device)  # cosine, kl, nll
        for lo in range(0, len(mine), spec.micro_batch_sequences):
            ids = self.train_ids[mine[lo:lo + spec.micro_batch_sequences]].to(self.placement.device)
            with self._autocast:
                loss = self._piece_loss(ids, sums, positions * n_layers, predicted)
            loss.backward()
            release_freed_host_memory(self.placement.device)
        # A sharded model's gradients were already summed over ranks by FSDP.
        self.dist.all_reduce_sum([*gradients([p for p in self.params if not is_sharded(p)]), sums])
        clip_and_step(self.optimizer, self.params, spec.grad_clip)
        release_freed_host_memory(self.placement.device)
        # Left on the device: the step loop reads them back (and checks them) at logged steps only.
        cosine, kl, nll = sums[0] / (positions * n_layers), sums[1] / predicted, sums[2] / predicted
        total = loss_spec.cosine_weight * cosine + loss_spec.kl_weight * kl + loss_spec.lm_weight * nll
        return StepOutcome({"loss": total, "cosine": cosine, "kl": kl, "nll": nll}, positions,
                           {"loss": total})

    def _piece_loss(self, ids: torch.Tensor, sums: torch.Tensor, cosine_count: int, predicted: int) -> torch.Tensor:
        """One micro-batch's share of the global-mean loss; adds its raw term sums to `sums`."""
        loss_spec = self.recipe.loss
        if self.teacher_cache is not None:
            return self._cached_piece_loss(ids, sums, predicted)
        teacher_layers = teacher_final = None
        if loss_spec.cosine_weight > 0 or loss_spec.kl_weight > 0:  # an LM-loss-only run never needs the teacher
            with torch.no_grad():
                teacher_layers, teacher_final = decoder_states(self.teacher, ids)
            release_freed_host_memory(self.placement.device)
        student_layers, student_final = decoder_states(self.student, ids)
        release_freed_host_memory(self.placement.device)
        loss = student_final.new_zeros((), dtype=torch.float32)
        if loss_spec.cosine_weight > 0:
            cosine = cosine_distance_sum(student_layers, teacher_layers)
            loss = loss + loss_spec.cosine_weight * cosine / cosine_count
            sums[0] += cosine.detach().double()
        if loss_spec.kl_weight > 0 or loss_spec.lm_weight > 0:
            teacher_final = student_final if teacher_final is None else teacher_final
            terms = logit_term_sums(student_final, teacher_final, ids,
                                    OutputHead(self.student), OutputHead(self.teacher),
                                    temperature=loss_spec.temperature, with_kl=loss_spec.kl_weight > 0,
                                    with_nll=loss_spec.lm_weight > 0)
            loss = loss + (loss_spec.kl_weight * terms.kl + loss_spec.lm_weight * terms.nll) / predicted
            sums[1] += terms.kl.detach().double()
            sums[2] += terms.nll.detach().double()
        return loss

    def _cached_piece_loss(self, ids: torch.Tensor, sums: torch.Tensor, predicted: int) -> torch.Tensor:
        """`_piece_loss` with the teacher's top-k log-probabilities from the cache (no cosine term)."""
        from mlxkit.engines.distill.losses import cached_logit_term_sums

        loss_spec = self.recipe.loss
        top_logp, top_index = self.teacher_cache.top_k_for(self.teacher, ids)
        _, student_final = decoder_states(self.student, ids)
        terms = cached_logit_term_sums(student_final, top_logp, top_index, ids, OutputHead(self.student),
                                       temperature=loss_spec.temperature, with_nll=loss_spec.lm_weight > 0)
        sums[1] += terms.kl.detach().double()
        sums[2] += terms.nll.detach().double()
        return (loss_spec.kl_weight * terms.kl + loss_spec.lm_weight * terms.nll) / predicted

    def evaluate(self) -> dict[str, float]:
        from mlxkit.engines.eval.language_model import evaluate

        self.student.eval()
        with self._autocast:
            result = evaluate(self.student, self.val_ids.to(self.placement.device), reference=self.teacher)
        self.student.train()
        return {"kl_div": result.kl_div, "top1_agreement": result.top1_agreement, "perplexity": result.perplexity}

    def train(self) -> dict[str, Any] | None:
        """Run the remaining steps; returns the summary, or None when stopped early or on a non-main rank."""
        loop = self.step_loop(self.steps, self.recipe.schedule, collective=self.sharded,
                              log_every=log_interval(self.placement.device), loss_name="the distillation loss")
        tokens_per_step = self.recipe.optim.batch_sequences * self.seq_len
        finished = loop.run(title=f"{self.options.mode.upper()}: {self.steps} steps of {tokens_per_step} tokens",
                            step=self.train_step, evaluate=self.evaluate, optimizer=self.optimizer,
                            checkpoint=lambda: self.checkpointer.save(self.student, self.optimizer, self.state))
        if finished:
            self.teacher = None  # the last evaluation is done: writing the output needs only the student
        if not self.finish_training(finished, self.student):
            return None  # every rank meets the others again in cleanup()
        return self._summary(loop.records())

    def _summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {"mode": self.options.mode, "seq_len": self.seq_len,
                "batch_sequences": self.recipe.optim.batch_sequences, **self.common_summary(records),
                "saved_dtype": str(self.save_dtype).removeprefix("torch."),
                **({"teacher_cache": {"path": str(self.teacher_cache.path), "hits": self.teacher_cache.hits,
                                      "misses": self.teacher_cache.misses}} if self.teacher_cache else {})}

    # ------------------------------------------------------------------ save
    def save(self, summary: dict[str, Any]) -> Path:
        from mlxkit.engines.models.loading import load_model
        from mlxkit.engines.models.saving import save_model_files

        manifest = Manifest(verb="distill", started=self.started)
        manifest.add_input("teacher", self.options.teacher, self.teacher_source.path)
        manifest.add_input("student", self.options.student, self.student_source.path)
        if self.options.data is not None:
            manifest.add_input("data", str(self.options.data), self.options.data)
        manifest.seeds = {"seed": self.options.seed}
        manifest.settings = {"mode": self.options.mode, "recipe": self.recipe.model_dump(), "steps": self.steps,
                             "run_key": finished_run_key(self.work), **self.options.manifest_extra}

        def plain_student() -> tuple[torch.nn.Module, torch.nn.Module]:
            """A plain copy of the student read on the CPU, for a sharded student's weights gathered onto rank 0."""
            plain = load_model(self.student_source, with_tokenizer=False, allow_pickle=self.options.allow_pickle).model
            return plain, plain

        student = self.checkpointer.unsharded(self.student, plain_student)
        student.eval()
        student.generation_config = self.generation_config
        student.to(self.save_dtype)
        student.config.dtype = self.save_dtype  # the weights and config.json say the same dtype
        return self.write_output(manifest, summary, lambda tmp: save_model_files(student, self.tokenizer, tmp))


def _source_key(source) -> dict[str, Any]:
    path = getattr(source, "path", None)
    return {"spec": source.spec, "hash": content_hash(path) if path is not None and Path(path).exists() else None}


def run_distillation(options: DistillationOptions, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train (or resume) and save; returns the summary ({} on non-main ranks or when stopped early)."""
    return DistillationRun(options, reporter).execute()
