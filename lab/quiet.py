"""Quiet library output for the command-line tools whose own output is the point (demo, study)."""

from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def quiet():
    """Silence library warnings, info logs and library progress bars; errors still show. Restores all on exit."""
    import datasets
    import transformers

    t_level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    t_bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" etc.
    ds_logger = logging.getLogger("DeepSpeed")  # "Setting accelerator to CPU" when deepspeed is installed
    ds_level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    d_bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    exgrpo_logger = logging.getLogger("exgrpo_trl")
    e_level = exgrpo_logger.level
    exgrpo_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(t_level)
        if t_bars:
            transformers.utils.logging.enable_progress_bar()
        ds_logger.setLevel(ds_level)
        if d_bars:
            datasets.utils.logging.enable_progress_bar()
        exgrpo_logger.setLevel(e_level)
