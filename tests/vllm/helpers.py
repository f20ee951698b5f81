"""The environment the vLLM tests run vLLM in."""

from __future__ import annotations

from pathlib import Path


def vllm_env(work: Path) -> dict[str, str]:
    """Keep vLLM on loopback, small, offline, and inside the work directory."""
    (work / "tmp").mkdir(exist_ok=True)
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; otherwise the KV cache takes ~90% of RAM
        "VLLM_HOST_IP": "127.0.0.1",  # otherwise vLLM binds its internal queues to the external interface
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TMPDIR": str(work / "tmp"),  # vLLM leaves sockets and compile caches behind
        "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
    }
