"""Context managers around TRL and transformers that the trainer uses: quiet about warnings TRL's own code raises,
attributes set for one block, and a model saved under the weight names a resume loads."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings


@contextlib.contextmanager
def quiet_checkpointing_deprecation():
    """TRL 1.16's generation and `disable_gradient_checkpointing` call the model's `is_gradient_checkpointing`,
    `gradient_checkpointing_disable` and `_enable`, which transformers 5 deprecates: FutureWarnings about TRL's code
    (not the user's) at every generation and entropy-scoring pass, whether checkpointing is on or off."""
    with warnings.catch_warnings():
        deprecated = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
        yield


@contextlib.contextmanager
def swapped(obj, **values):
    """Within the block, `obj`'s attributes hold `values` (where TRL reads them from); restored afterwards."""
    saved = {name: getattr(obj, name, None) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextlib.contextmanager
def own_key_names(model):
    """Within the block, `model.save_pretrained` writes the model's own weight names. transformers saves a model that
    has a checkpoint conversion mapping (Qwen2-VL, LLaVA and other vision-language models) under its original names,
    but resumes a checkpoint with a plain `load_state_dict`, which then matches no weight and trains on from the base
    model's (transformers#43701): a checkpoint must hold the names it is resumed with. For other models the two are
    the same and nothing changes."""
    save = type(model).save_pretrained
    if "save_original_format" not in inspect.signature(save).parameters:  # a PEFT model or an older transformers
        yield
        return
    model.save_pretrained = functools.partial(save, model, save_original_format=False)
    try:
        yield
    finally:
        del model.save_pretrained


@contextlib.contextmanager
def plain_cpu_map_location():
    """Within the block `torch.load` maps an indexed CPU device (``cpu:1``) to plain ``"cpu"``: transformers 5.17 (the
    newest the CPU build of vLLM allows) loads the optimizer state of a run of several processes onto `args.device`,
    which on CPU ranks carries an index torch cannot restore to ("don't know how to restore data location"), so that
    no such run could resume. A GPU device, or any other map, passes as it is."""
    import torch

    real = torch.load

    def load(*args, map_location=None, **kwargs):
        if str(map_location).startswith("cpu:"):  # a torch.device("cpu", 1) or the text "cpu:1"
            map_location = "cpu"
        return real(*args, map_location=map_location, **kwargs)

    with swapped(torch, load=load):
        yield
