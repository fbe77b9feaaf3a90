"""Small image/feature classifiers built from a config, so the CLI never needs user code.

A config (JSON or YAML) names an architecture, the shape of one input and the number of
classes. `mlp` flattens the input and stacks ReLU layers of widths `hidden`; `cnn` stacks
3×3 convolutions (ReLU, 2×2 max-pool) of widths `channels` over a [C, H, W] input, then
the same fully connected layers. A trained model is a directory holding `model.safetensors`
and `config.json` (this schema, `model_type` included), beside the mlxkit manifest.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors.torch import load_file, save_file

from mlxkit.engines.core.atomic import atomic_write_json
from mlxkit.engines.core.finite import first_non_finite
from mlxkit.engines.core.yaml_config import read_yaml_mapping, read_yaml_text, validate_model
from mlxkit.engines.errors import InputError, NonFiniteError

MODEL_TYPE = "mlx_robust_classifier"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class ClassifierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: Literal["mlx_robust_classifier"] = MODEL_TYPE
    architecture: Literal["mlp", "cnn"] = "mlp"
    input_shape: list[int] = Field(min_length=1, max_length=3)   # one example: [features] or [C, H, W]
    num_classes: int = Field(ge=2, le=100_000)
    hidden: list[int] = Field(default_factory=lambda: [128])      # fully connected widths before the output
    channels: list[int] = Field(default_factory=lambda: [16, 32])  # cnn only: conv widths, each halves H and W

    @model_validator(mode="after")
    def _consistent(self) -> "ClassifierConfig":
        if any(size < 1 for size in self.input_shape + self.hidden + self.channels):
            raise ValueError("input_shape, hidden and channels take positive sizes only")
        if self.architecture == "cnn":
            if len(self.input_shape) != 3:
                raise ValueError(f"a cnn takes images: input_shape must be [C, H, W] (got {self.input_shape})")
            scale = 2 ** len(self.channels)
            _, height, width = self.input_shape
            if height % scale or width % scale:
                raise ValueError(f"a cnn with {len(self.channels)} conv layers halves H and W that often: "
                                 f"input_shape {self.input_shape} must have H and W divisible by {scale}")
        return self

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3

    @property
    def parameter_count(self) -> int:
        """Weights and biases the network will have, counted from the config alone (nothing allocated)."""
        count = 0
        features = math.prod(self.input_shape)
        if self.architecture == "cnn":
            channels, height, width = self.input_shape
            for width_out in self.channels:
                count += width_out * (channels * 9 + 1)
                channels, height, width = width_out, height // 2, width // 2
            features = channels * height * width
        for width_out in [*self.hidden, self.num_classes]:
            count += width_out * (features + 1)
            features = width_out
        return count


class Classifier(torch.nn.Module):
    """Logits for a batch of inputs shaped [N, *input_shape]."""

    def __init__(self, config: ClassifierConfig):
        super().__init__()
        self.config = config
        layers: list[torch.nn.Module] = []
        features = math.prod(config.input_shape)
        if config.architecture == "cnn":
            channels, height, width = config.input_shape
            for width_out in config.channels:
                layers += [torch.nn.Conv2d(channels, width_out, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
                channels, height, width = width_out, height // 2, width // 2
            features = channels * height * width
        layers.append(torch.nn.Flatten())
        for width_out in config.hidden:
            layers += [torch.nn.Linear(features, width_out), torch.nn.ReLU()]
            features = width_out
        layers.append(torch.nn.Linear(features, config.num_classes))
        self.layers = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def read_classifier_config(path: str | os.PathLike) -> ClassifierConfig:
    """A model config file (.json, .yaml or .yml)."""
    path = Path(path)
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise InputError(f"model config '{path}' must be a .json or .yaml file (or pass a trained model directory)")
    # JSON is a subset of YAML, so one safe loader reads both.
    origin = f"model config {path}"
    return validate_model(ClassifierConfig, read_yaml_mapping(read_yaml_text(path, origin), origin), origin)


def build_classifier(config: ClassifierConfig, seed: int) -> Classifier:
    """A freshly initialised classifier; the seed alone fixes its weights.

    A network whose float32 weights, gradients and AdamW moments alone exceed the machine's memory
    is refused before anything is allocated.
    """
    from mlxkit.engines.training.budget import check_fits, optimiser_bytes

    check_fits(4 * config.parameter_count + optimiser_bytes(config.parameter_count), torch.device("cpu"),
               f"a classifier of {config.parameter_count:,} parameters")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Classifier(config)


def save_classifier_files(model: Classifier, directory: str | os.PathLike) -> None:
    """`model.safetensors` and `config.json` into an existing directory (the caller makes it atomic)."""
    directory = Path(directory)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    bad = first_non_finite(tensors.items())
    if bad is not None:
        raise NonFiniteError(f"the trained classifier has NaN or infinite values in '{bad}'; nothing was written")
    save_file(tensors, str(directory / WEIGHTS_NAME))
    atomic_write_json(directory / CONFIG_NAME, model.config.model_dump(mode="json"))


def is_classifier_dir(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_NAME).is_file()


def load_classifier(directory: str | os.PathLike) -> Classifier:
    """A trained classifier from `directory`, weights checked against its config."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise InputError(f"'{directory}' is not a trained classifier (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_path} is not valid JSON ({exc})") from None
    config = validate_model(ClassifierConfig, raw, f"model config {config_path}")
    model = Classifier(config)
    try:
        model.load_state_dict(load_file(str(weights_path)), strict=True)
    except (RuntimeError, OSError) as exc:
        raise InputError(f"{weights_path} does not match its config ({str(exc).splitlines()[0][:200]})") from None
    return model
