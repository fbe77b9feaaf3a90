"""The parent as the search's stages before GKD hold it."""

from __future__ import annotations

from typing import Any

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.training.device import Placement


class SearchParent:
    """The parent, read once into the compute dtype on the device for the stages before GKD: refinement
    measures children against it, assembly copies its kept blocks, evaluation compares with it.
    `release()` frees it before GKD loads the parent as its teacher."""

    def __init__(self, spec: str, placement: Placement, allow_pickle: bool, reporter: Reporter):
        self.spec, self.placement, self.allow_pickle, self.reporter = spec, placement, allow_pickle, reporter
        self._loaded: Any = None
        self._converted: Any = None

    @property
    def loaded(self):
        """The parent as `load_model` returns it (model, tokenizer, source)."""
        if self._loaded is None:
            from mlxkit.engines.models.loading import load_model

            self._loaded = load_model(self.spec, dtype=self.placement.dtype, device=self.placement.device,
                                      allow_pickle=self.allow_pickle, reporter=self.reporter)
        return self._loaded

    @property
    def converted(self):
        """The parent in the child's (DeciLM) form, run by assembly, refinement and evaluation."""
        if self._converted is None:
            from mlxkit.engines.models.decilm.convert import from_parent

            self._converted = from_parent(self.loaded.model)
            prefer_sdpa(self._converted.config)
        return self._converted

    def release(self) -> None:
        import gc

        self._loaded = self._converted = None
        gc.collect()
