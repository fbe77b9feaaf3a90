"""The model being fine-tuned: a causal LM (LoRA from peft, or every weight), plus a classification head.

`FinetuneModel` holds the language model (with peft's LoRA layers injected in place, when
the method uses an adapter) and, for sequence classification, a new linear head on the
hidden state of each sequence's last token. It computes both objectives' losses as sums,
so callers normalise once over the global batch:

* causal LM: Σ −log p(next token) over positions 0..T−2 predicting tokens 1..T−1 (the
  convention of `engines/eval/metrics.py`), chunked over positions so a batch's
  [positions, vocab] logits never exist at once;
* classification: Σ cross-entropy of the head's logits against the labels.

Outputs: an adapter run writes a peft adapter directory (`adapter_config.json`,
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(base, DIR)` loads; `merge`
folds the adapter into the base (`merge_and_unload`) and writes a whole checkpoint, as full
fine-tuning does. A classification head is saved beside either, with its label names.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mlxkit.engines.distill.losses import logit_term_sums
from mlxkit.engines.errors import InputError
from mlxkit.engines.finetune.data import Batch, Examples
from mlxkit.engines.finetune.recipe import FinetuneRecipe
from mlxkit.engines.training.step import decoder_states

HEAD_WEIGHTS = "classification_head.safetensors"
HEAD_CONFIG = "classification_head.json"


class FinetuneModel(torch.nn.Module):
    """The language model (`lm`) and, for classification, its head (`classifier`)."""

    def __init__(self, lm: torch.nn.Module, classifier: torch.nn.Linear | None = None,
                 label_names: list[str] | None = None):
        super().__init__()
        self.lm = lm
        self.classifier = classifier
        self.label_names = label_names

    @property
    def objective(self) -> str:
        return "causal_lm" if self.classifier is None else "classification"

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        # The model's own forward (through any injected LoRA layers), so a sharded model gathers its root weights.
        return decoder_states(self.lm, ids)[1]

    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """The objective summed over the batch's loss terms (see the module docstring)."""
        hidden = self.hidden_states(batch.ids)
        if self.classifier is None:
            head = self.lm.get_output_embeddings()
            return logit_term_sums(hidden, hidden, batch.ids, head, head, with_kl=False, with_nll=True).nll
        logits = self.classify(hidden, batch.lengths)
        return F.cross_entropy(logits.float(), batch.labels, reduction="sum")

    def classify(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Class logits from the hidden state at each sequence's last token (right padding is never attended to)."""
        pooled = hidden[torch.arange(hidden.shape[0]), lengths - 1]
        return self.classifier(pooled)

    def decoder_layers(self) -> torch.nn.ModuleList | None:
        layers = getattr(self.lm.base_model, "layers", None)
        return layers if isinstance(layers, torch.nn.ModuleList) else None

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.named_parameters() if p.requires_grad]

    @torch.no_grad()  # not inference_mode: a sharded model reuses the weights it gathers here in training
    def evaluate(self, examples: Examples, batch_sequences: int = 8) -> dict[str, float]:
        """Held-out loss (mean NLL per predicted token, or mean cross-entropy) and, for classification, accuracy."""
        was_training = self.training
        self.eval()
        if self.classifier is None:
            from mlxkit.engines.eval.language_model import evaluate

            result = evaluate(self.lm, examples.ids)
            self.train(was_training)
            return {"loss": result.nll, "perplexity": result.perplexity}
        total, correct = 0.0, 0
        for lo in range(0, len(examples), batch_sequences):
            batch = examples.batch(list(range(lo, min(lo + batch_sequences, len(examples)))))
            logits = self.classify(self.hidden_states(batch.ids), batch.lengths).float()
            total += F.cross_entropy(logits, batch.labels, reduction="sum").item()
            correct += int((logits.argmax(-1) == batch.labels).sum())
        self.train(was_training)
        return {"loss": total / len(examples), "accuracy": correct / len(examples)}


def build_model(lm: torch.nn.Module, recipe: FinetuneRecipe, label_names: list[str] | None = None,
                model_spec: str = "the model") -> tuple[FinetuneModel, Any]:
    """Make `lm` trainable as the recipe says; returns the model and the peft wrapper (None for full fine-tuning).

    Call under a seeded RNG: peft's LoRA A matrices and the classification head draw their
    initial values from torch's global generator.
    """
    peft_model = None
    if recipe.method == "full":
        lm.requires_grad_(True)
    else:
        from peft import LoraConfig, get_peft_model

        spec = recipe.lora
        assert spec is not None  # the recipe validator guarantees it
        config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                            target_modules=spec.target_modules, task_type="CAUSAL_LM")
        try:
            with warnings.catch_warnings():  # transformers deprecation noise from peft's own calls
                warnings.simplefilter("ignore", FutureWarning)
                peft_model = get_peft_model(lm, config)
        except ValueError as exc:  # peft's NoMatchingPeftModuleError is a ValueError
            raise InputError(f"LoRA cannot be applied to {model_spec}: {str(exc).splitlines()[0]} "
                             f"(lora.target_modules is {spec.target_modules!r}; list the model's module names, "
                             "e.g. --set 'lora.target_modules=[q_proj,v_proj]')") from None
    classifier = None
    if label_names is not None:
        classifier = torch.nn.Linear(lm.config.hidden_size, len(label_names), dtype=next(lm.parameters()).dtype)
        output = lm.get_output_embeddings()
        if output is not None and output.weight is not lm.get_input_embeddings().weight:
            output.requires_grad_(False)  # an untied LM head takes no part in classification
    return FinetuneModel(lm, classifier, label_names), peft_model


def fo_layer_parameters(model: FinetuneModel, fo_layers: int) -> set[int]:
    """ids of the tensors H-Tuning trains first-order: those of the last `fo_layers` decoder layers, and the head."""
    chosen: set[int] = set()
    if fo_layers:
        layers = model.decoder_layers()
        if layers is None:
            raise InputError("htuning.fo_layers needs a model whose backbone has a `layers` list; "
                             "set htuning.fo_layers=0")
        if fo_layers >= len(layers):
            raise InputError(f"htuning.fo_layers is {fo_layers} but the model has {len(layers)} decoder layers; "
                             "leave at least one layer to the zeroth-order estimate")
        chosen |= {id(p) for layer in layers[len(layers) - fo_layers:] for p in layer.parameters() if p.requires_grad}
    if model.classifier is not None:
        chosen |= {id(p) for p in model.classifier.parameters()}
    return chosen


def save_outputs(model: FinetuneModel, peft_model: Any, tokenizer, directory: Path, *, merge: bool,
                 dtype: torch.dtype | None = None) -> str:
    """Write the trained weights into `directory` (a fresh temporary one), in `dtype` when given (the
    model is cast in place); returns the format written."""
    from mlxkit.engines.models.saving import save_model_files

    from mlxkit.engines.core.finite import first_non_finite
    from mlxkit.engines.errors import NonFiniteError

    if dtype is not None:
        model.to(dtype)
        model.lm.config.dtype = dtype
    # the adapter and the head are written by peft and safetensors directly, so checked here (after the cast)
    trained = [*(peft_model or model.lm).state_dict().items(),
               *(model.classifier.state_dict().items() if model.classifier is not None else [])]
    bad = first_non_finite(trained)
    if bad is not None:
        raise NonFiniteError(f"the trained weights have NaN or infinite values in '{bad}'; nothing was written")

    if peft_model is None:
        save_model_files(model.lm, tokenizer, directory)
        kind = "full"
    elif merge:
        merged = peft_model.merge_and_unload()
        save_model_files(merged, tokenizer, directory)
        kind = "merged"
    else:
        peft_model.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        kind = "adapter"
    if model.classifier is not None:
        save_file({k: v.detach().contiguous() for k, v in model.classifier.state_dict().items()},
                  str(directory / HEAD_WEIGHTS))
        (directory / HEAD_CONFIG).write_text(json.dumps(
            {"labels": model.label_names, "hidden_size": model.classifier.in_features,
             "pooling": "last_token", "bias": model.classifier.bias is not None}, indent=1) + "\n")
    return kind


def load_classification_head(directory: str | Path) -> tuple[torch.nn.Linear, list[str]]:
    """The head and label names a classification run saved beside its adapter or checkpoint."""
    directory = Path(directory)
    config = json.loads((directory / HEAD_CONFIG).read_text())
    state = load_file(str(directory / HEAD_WEIGHTS))
    head = torch.nn.Linear(config["hidden_size"], len(config["labels"]), bias=config["bias"],
                           dtype=state["weight"].dtype)
    head.load_state_dict(state)
    return head.eval(), list(config["labels"])
