"""Reaching the Hugging Face hub, and noticing quickly when it cannot be reached."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

_TRUE = {"1", "true", "yes", "on"}


def hub_offline_by_env() -> bool:
    return any(os.environ.get(name, "").lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 2.0) -> bool:
    """True when the hub endpoint answers a TCP connect within `timeout_s`.

    huggingface_hub itself retries for tens of seconds before giving up; a single
    connect attempt tells us in about a second whether trying is worthwhile.
    """
    if hub_offline_by_env():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
