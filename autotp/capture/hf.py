"""Hugging Face transformers conventions, handled so users pass models as they are.

A transformers model returns a KV cache (``DynamicCache``) from ``forward`` by
default, which is neither needed in a training graph nor exportable. While
autotp captures a model with a ``config.use_cache`` flag, the flag is off; the
user's model is left as it was afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def capture_settings(model):
    """Temporarily turn off ``config.use_cache`` on a transformers model (no-op otherwise)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    saved = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = saved
