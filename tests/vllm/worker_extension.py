"""vLLM worker extension for the server-mode tests (see `cpu_weight_sync` for why it exists).

Passed to `trl vllm-serve` as `--worker-extension-cls tests.vllm.worker_extension.SafetensorsWeightSync` (with the
repository root on the server's PYTHONPATH); vLLM mixes it into its CPU worker, and the trainer calls it through the
server's development endpoint `/collective_rpc` (enabled by `trl vllm-serve`, which sets `VLLM_SERVER_DEV_MODE=1`).
"""

from __future__ import annotations

RPC_METHOD = "exgrpo_test_load_weights_file"


class SafetensorsWeightSync:
    """Adds `exgrpo_test_load_weights_file(path)` to vLLM's worker: load a safetensors file into the model in place."""

    def exgrpo_test_load_weights_file(self, path: str) -> int:
        from safetensors.torch import load_file

        from .cpu_weight_sync import layerwise_reload

        weights = load_file(path)
        runner = self.model_runner
        with layerwise_reload(runner.model, runner.model_config):
            runner.model.load_weights(weights=iter(weights.items()))
        return len(weights)
