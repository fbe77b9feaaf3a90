"""`mlx report DIR`: redraw the pictures of an output mlxkit wrote (and its model card, which embeds them)
from what the output already holds, after the plots extra was installed or mlxkit was upgraded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxkit.engines.core.manifest import MANIFEST_NAME
from mlxkit.engines.errors import BackendError, InputError


def redraw_output(directory: str | Path) -> dict[str, Any]:
    """Redraw every picture `directory` has data for and rewrite its card; what was drawn, and the card."""
    from mlxkit.engines.core.figures import PLOTS_HINT, draw_output_figures, plotting_missing
    from mlxkit.engines.core.model_card import CARD_NAME, write_model_card

    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory} is not a directory mlxkit wrote")
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        raise InputError(f"{directory} is not an output mlxkit wrote (it has no {MANIFEST_NAME})") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{directory / MANIFEST_NAME} cannot be read: {exc}") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{directory / MANIFEST_NAME} is not an mlxkit manifest")
    if plotting_missing() is not None:
        raise BackendError(f"mlx report draws with matplotlib, which is not installed ({PLOTS_HINT})")
    # The card is drawn with its pictures; an output that is not a model (a frontier) has pictures only.
    figures = write_model_card(directory, manifest)
    card = figures is not None
    if figures is None:
        figures = draw_output_figures(directory, manifest)
    return {"out": str(directory), "drawn": [figure.file for figure in figures.drawn],
            "card": str(directory / CARD_NAME) if card else None}
