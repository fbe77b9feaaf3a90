"""`mlx finetune --recipe crt`: adversarial training of a classifier, then fine-tuning for a new attack.

Two phases, one run class:
  * train (`--attacks linf[,..]`): from a model config (fresh weights) or a trained model;
    the recipe's `train` steps and learning rate.
  * finetune (`--new-attack l2`): from a trained model, with a fresh optimiser and the
    recipe's `finetune` steps and learning rate. The old attacks are those the model was
    trained against (its manifest records them) unless `--attacks` names them.
Each step draws one attack from the run's attacks with probability ∝ its running robust
training error (`sampler`), trains on the adversarial cross-entropy of the batch plus the
logit-distance regulariser (`regularizers`) and updates that attack's running accuracy.
The data order, the attack drawn and every random start are functions of the seed and the
step, so the step, the optimiser, the weights and the sampler's state are the whole state.

Work in progress lives beside the output, in `.<out>.crt-work/` (run key, latest checkpoint,
log); a rerun of the same command resumes there and ends with the same weights as an
uninterrupted run. The output (weights, config.json, log, manifest) is written atomically.
Every check of the user's input runs before the work directory is created, so a refused
run leaves nothing behind.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mlxkit.engines.core.manifest import MANIFEST_NAME, Manifest, content_hash
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.core.seeds import derive_seed, seeded_generator
from mlxkit.engines.core.threads import one_intra_op_thread
from mlxkit.engines.errors import InputError, NonFiniteError
from mlxkit.engines.robust.attacks import ATTACK_NAMES, Attack, cross_entropy_objective, make_attack
from mlxkit.engines.robust.classifier import (Classifier, build_classifier, is_classifier_dir, load_classifier,
                                              read_classifier_config, save_classifier_files)
from mlxkit.engines.robust.data import read_npz, split_held_out
from mlxkit.engines.robust.evaluation import robustness_report
from mlxkit.engines.robust.recipe import CrtRecipe
from mlxkit.engines.robust.regularizers import alr_point, logit_distance, uniform_point
from mlxkit.engines.robust.sampler import ContinualSampler
from mlxkit.engines.training.checkpointer import Checkpointer
from mlxkit.engines.training.device import Placement
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.run import TrainingOptions, TrainingRun
from mlxkit.engines.training.loop import StepOutcome
from mlxkit.engines.training.schedule import batch_indices
from mlxkit.engines.training.spec import build_optimizer
from mlxkit.engines.training.step import clip_and_step, set_learning_rate
from mlxkit.engines.training.work import check_run_key, finished_run_key, refuse_existing_output

LOG_NAME = "crt_log.jsonl"
TRAINED_ATTACKS_KEY = "attacks_trained"  # manifest settings: every attack the model has been trained against


@dataclass(frozen=True)
class CrtOptions(TrainingOptions):
    model: str                        # a model config (.json/.yaml) or a trained classifier directory
    data: Path
    out: Path
    recipe: CrtRecipe
    attacks: tuple[str, ...] = ()     # train: the attacks; finetune: the old attacks (default: the model's record)
    new_attack: str | None = None     # set: fine-tune for this attack
    eval_data: Path | None = None


def build_attacks(recipe: CrtRecipe, names: list[str], *, for_eval: bool = False) -> dict[str, Attack]:
    """The named attacks with the recipe's budgets; `for_eval` uses each attack's evaluation steps."""
    attacks = {}
    for name in names:
        spec = recipe.attacks.get(name)
        steps = spec.eval_steps if for_eval else spec.steps
        attacks[name] = make_attack(name, spec.budget, steps, spec.step_size_for(steps), recipe.data.low,
                                    recipe.data.high)
    return attacks


def trained_attacks(model_dir: Path) -> list[str] | None:
    """The attacks a trained classifier was trained against, from its manifest (None when not recorded)."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text()).get("settings", {}).get(TRAINED_ATTACKS_KEY)
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(recorded, list) or not all(isinstance(n, str) and n in ATTACK_NAMES for n in recorded):
        return None
    return recorded


class CrtRun(TrainingRun):
    """crt: setup, train and save over the shared training core."""

    work_kind = "crt"
    log_name = LOG_NAME

    def __init__(self, options: CrtOptions, reporter: Reporter | None = None):
        super().__init__(options, reporter)
        self.phase_name = "train" if options.new_attack is None else "finetune"
        self.phase = self.recipe.train if options.new_attack is None else self.recipe.finetune
        self.lr_schedule = self.phase.lr_schedule()

    def resolve_placement(self) -> Placement:
        # The classifier trains in float32: its ops are too small for a lower precision to pay.
        return Placement(Placement.resolve(self.options.device, self.options.dtype).device, torch.float32)

    def join_processes(self) -> Distributed:
        return Distributed(device=self.placement.device)  # one process: these classifiers are too small to share out

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Check everything and load; the work directory appears only once all checks passed."""
        options, recipe = self.options, self.recipe
        if not options.overwrite:
            refuse_existing_output(self.out, self.work, self.dist)
        self.model_path = Path(options.model).expanduser()
        self._check_attack_names()
        if is_classifier_dir(self.model_path):
            self.model: Classifier = load_classifier(self.model_path)
        elif self.model_path.is_dir():
            raise InputError(f"model '{self.model_path}' is a directory without config.json (pass a trained "
                             "classifier directory or a model config file)")
        elif not self.model_path.is_file():
            raise InputError(f"model '{options.model}' does not exist (pass a model config .json/.yaml, or a "
                             "trained classifier directory)")
        elif options.new_attack is not None:
            raise InputError("--new-attack fine-tunes a trained classifier: --model must be the directory an "
                             "earlier `mlx finetune --recipe crt` wrote, not a model config")
        else:
            config = read_classifier_config(self.model_path)
            self.model = build_classifier(config, derive_seed(options.seed, "crt-init"))
        config = self.model.config
        self.attack_names, self.old_attacks = self._attack_names()
        if "stadv" in self.attack_names and not config.is_image:
            raise InputError(f"the stadv attack moves pixels: the model's input_shape must be [C, H, W] "
                             f"(got {config.input_shape})")
        data = recipe.data
        loaded = read_npz(options.data, config.input_shape, config.num_classes, data.low, data.high)
        if options.eval_data is not None:
            self.train_data = loaded
            held = read_npz(options.eval_data, config.input_shape, config.num_classes, data.low, data.high)
            self.eval_data = held.subset(torch.arange(min(len(held), data.held_out_examples)))
        else:
            self.train_data, self.eval_data = split_held_out(loaded, data.held_out_examples, options.seed)
        self.model.to(self.placement.device)
        self.train_data, self.eval_data = self.train_data.to(self.placement.device), \
            self.eval_data.to(self.placement.device)
        self.attacks = build_attacks(recipe, self.attack_names)
        self.eval_attacks = build_attacks(recipe, self.attack_names, for_eval=True)
        spec = recipe.optim
        self.optimizer = build_optimizer(self.model.parameters(), spec.optimizer, lr=self.phase.lr,
                                         weight_decay=spec.weight_decay, momentum=spec.momentum)
        self.sampler = ContinualSampler({name: 0.0 for name in self.attack_names}, recipe.sampler.momentum)
        check_run_key(self.work, self._run_key(), self.dist, what="an unfinished CRT run", reporter=self.reporter)
        self.checkpointer = Checkpointer(self.work, self.dist, sharded=False)
        resumed = self.start_or_resume(self.model, f"crt {self.phase_name}", self.phase.steps)
        if resumed is not None:
            self.sampler = ContinualSampler.from_state(resumed.extra["sampler"])

    def _check_attack_names(self) -> None:
        options = self.options
        for name in (*options.attacks, *([options.new_attack] if options.new_attack else [])):
            if name not in ATTACK_NAMES:
                raise InputError(f"unknown attack '{name}' (available: {', '.join(ATTACK_NAMES)})")
        if len(set(options.attacks)) != len(options.attacks):
            raise InputError(f"--attacks names an attack twice ({','.join(options.attacks)})")
        if options.new_attack is None and not options.attacks:
            raise InputError("crt training needs --attacks (e.g. --attacks linf), or --new-attack NAME to "
                             "fine-tune a trained model")

    def _attack_names(self) -> tuple[list[str], list[str]]:
        """(every attack this run trains against, the old ones)."""
        options = self.options
        if options.new_attack is None:
            return list(options.attacks), []
        old = list(options.attacks) or trained_attacks(self.model_path)
        if not old:
            raise InputError(f"model '{self.model_path}' does not record the attacks it was trained against; name "
                             "them with --attacks")
        if options.new_attack in old:
            raise InputError(f"the model is already trained against '{options.new_attack}' "
                             f"(old attacks: {', '.join(old)})")
        return [*old, options.new_attack], old

    def _run_key(self) -> dict[str, Any]:
        def hashed(path: Path | None) -> Any:
            return None if path is None else {"spec": str(path), "hash": content_hash(path)}

        return {"model": hashed(self.model_path), "data": hashed(self.options.data),
                "eval_data": hashed(self.options.eval_data), "seed": self.options.seed,
                "attacks": self.attack_names, "new_attack": self.options.new_attack,
                "recipe": self.recipe.model_dump(exclude={"name", "description", "schedule"})}

    # ------------------------------------------------------------------ train
    def _initial_accuracy(self) -> None:
        """Start the sampler from each attack's measured robust accuracy on a seeded sample of training data."""
        if len(self.attack_names) == 1:
            return  # one attack is always drawn
        count = min(self.recipe.sampler.probe_examples, len(self.train_data))
        order = torch.randperm(len(self.train_data), generator=seeded_generator(self.options.seed, "crt-probe"))
        probe = self.train_data.subset(order[:count])
        report = robustness_report(self.model, probe, self.attacks, derive_seed(self.options.seed, "crt-probe"))
        self.sampler = ContinualSampler(dict(report["attacks"]), self.recipe.sampler.momentum)  # type: ignore[arg-type]

    def _regularizer_point(self, x: torch.Tensor, attack: Attack, generator: torch.Generator) -> torch.Tensor:
        spec = self.recipe.regularizer
        if spec.kind == "alr":
            return alr_point(self.model, x, attack, generator)
        return uniform_point(x, spec.sigma, self.recipe.data.low, self.recipe.data.high, generator)

    def train_step(self, step: int) -> StepOutcome:
        """One optimiser step on the batch of `step`, against the attack the sampler draws for it."""
        recipe, seed, phase = self.recipe, self.options.seed, self.phase_name
        self.model.train()
        indices = torch.tensor(batch_indices(step, recipe.optim.batch_size, len(self.train_data), seed),
                               device=self.placement.device)
        x, y = self.train_data.x[indices], self.train_data.y[indices]
        name = self.sampler.choose(seeded_generator(seed, "crt-attack", phase, step))
        attack = self.attacks[name]
        generator = seeded_generator(seed, "crt-perturb", phase, step)
        set_learning_rate(self.optimizer, self.lr_schedule.lr_at(step, self.phase.steps))
        x_adv = attack.perturb(self.model, x, cross_entropy_objective(y), generator)
        logits = self.model(x_adv)
        adversarial = F.cross_entropy(logits, y)
        loss = adversarial
        terms: dict[str, Any] = {"attack": name}
        if recipe.regularizer.kind != "none":
            penalty = logit_distance(self.model, x, self._regularizer_point(x, attack, generator))
            loss = adversarial + recipe.regularizer.weight * penalty
            terms["logit_distance"] = float(penalty.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_and_step(self.optimizer, list(self.model.parameters()), recipe.optim.grad_clip)
        if not math.isfinite(loss.item()):
            raise NonFiniteError(f"the crt loss became non-finite at step {step} (try a lower learning rate)")
        accuracy = float((logits.detach().argmax(dim=1) == y).float().mean())
        self.sampler.update(name, accuracy)
        self.state.extra["sampler"] = self.sampler.state()
        terms = {**terms, "loss": loss.item(), "adversarial_ce": adversarial.item(), "robust_accuracy": accuracy,
                 "probabilities": self.sampler.probabilities()}
        return StepOutcome(terms, recipe.optim.batch_size, {"loss": terms["loss"], "attack": name})

    def evaluate(self) -> dict[str, object]:
        return robustness_report(self.model, self.eval_data, self.eval_attacks, self.options.seed)

    def train(self) -> dict[str, Any] | None:
        """Run the remaining steps; returns the summary, or None when stopped early."""
        loop = self.step_loop(self.phase.steps, self.recipe.schedule, unit="examples")

        def first_record() -> dict[str, Any]:
            self._initial_accuracy()
            return {"step": 0, "sampler": self.sampler.state()}

        finished = loop.run(title=f"crt {self.phase_name} ({','.join(self.attack_names)}): {self.phase.steps} steps",
                            step=self.train_step, evaluate=self.evaluate, optimizer=self.optimizer,
                            first_record=first_record,
                            checkpoint=lambda: self.checkpointer.save(self.model, self.optimizer, self.state))
        return self._summary(loop.records()) if self.finish_training(finished, self.model) else None

    def _summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        counts = {name: sum(1 for r in records if "step_s" in r and r["attack"] == name) for name in self.attack_names}
        return {"method": "crt", "phase": self.phase_name, "attacks": self.attack_names,
                "old_attacks": self.old_attacks, "new_attack": self.options.new_attack,
                "regularizer": self.recipe.regularizer.kind, "regularizer_weight": self.recipe.regularizer.weight,
                **self.common_summary(records, unit="examples"),
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "attack_counts": counts, "sampler": {"accuracy": self.sampler.accuracy,
                                                     "probabilities": self.sampler.probabilities()}}

    # ------------------------------------------------------------------ save
    def save(self, summary: dict[str, Any]) -> Path:
        options = self.options
        manifest = Manifest(verb="finetune", started=self.started)
        manifest.add_input("model", options.model, self.model_path)
        manifest.add_input("data", str(options.data), options.data)
        if options.eval_data is not None:
            manifest.add_input("eval_data", str(options.eval_data), options.eval_data)
        manifest.seeds = {"seed": options.seed}
        manifest.settings = {"recipe": self.recipe.model_dump(), "phase": self.phase_name,
                             TRAINED_ATTACKS_KEY: self.attack_names, "new_attack": options.new_attack,
                             "run_key": finished_run_key(self.work),
                             **options.manifest_extra}
        self.model.eval()
        # a classifier of arrays, not a model the Hub's card fields describe: no card
        return self.write_output(manifest, summary, lambda tmp: save_classifier_files(self.model, tmp), card=False)


def run_crt(options: CrtOptions, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train (or resume) and save; returns the summary ({} when stopped early)."""
    # These classifiers are small: each op is microseconds of work, so thread hand-offs dominate
    # (on a shared 2-core machine a 64x128 linear layer ran about 50x slower on two threads than on one).
    with one_intra_op_thread():
        return CrtRun(options, reporter).execute()

