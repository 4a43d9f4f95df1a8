"""Hugging Face transformers conventions, handled so users pass models as they are.

A transformers model returns a KV cache (``DynamicCache``) from ``forward`` by
default, which is neither needed in a training graph nor exportable. While
autotp captures a model with a ``config.use_cache`` flag, the flag is off; the
user's model is left as it was afterwards. Its experts modules (mixture of
experts) are captured as one op each (`autotp.capture.experts`).
"""

from __future__ import annotations

from contextlib import contextmanager

from autotp.capture.experts import experts_as_one_op


@contextmanager
def capture_settings(model):
    """Temporarily turn off ``config.use_cache`` on a transformers model, and run its experts modules as one op
    each (no-op for other models)."""
    config = getattr(model, "config", None)
    with experts_as_one_op(model):
        if config is None or not hasattr(config, "use_cache"):
            yield
            return
        saved = config.use_cache
        config.use_cache = False
        try:
            yield
        finally:
            config.use_cache = saved
