"""What the vLLM tests share: the environment vLLM runs in, the tiny model it serves, and `trl vllm-serve`."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]
SERVER_START_TIMEOUT = 300.0


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


def build_model_dir(path: Path) -> str:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from exgrpo_trl.tasks.toy import build_char_tokenizer

    tokenizer = build_char_tokenizer(save_dir=path)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    # tied embeddings exercise the tied-embedding repack of the CPU weight-sync glue
    config = tiny_config(LlamaConfig, tokenizer, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         head_dim=64, tie_word_embeddings=True)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(str(path))
    return str(path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def trl_vllm_serve(model_dir: str, work: Path, env: dict[str, str], port: int | None = None):
    """Run `trl vllm-serve` on 127.0.0.1 and `port` (default: a free one); yield its base URL; stop it by its PID."""
    import requests

    port = _free_port() if port is None else port
    trl_cli = Path(sys.executable).with_name("trl")
    command = [
        str(trl_cli), "vllm-serve",
        "--model", model_dir,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--enforce_eager", "true",
        "--max_model_len", "64",
        "--log_level", "warning",
        # forwarded by `trl vllm-serve` to `vllm serve`: the worker side of the CPU weight-sync glue
        "--worker-extension-cls", "tests.vllm.worker_extension.SafetensorsWeightSync",
    ]  # fmt: skip
    server_env = {**os.environ, **env}
    server_env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    log_path = work / "vllm-serve.log"

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-6000:]

    base_url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=server_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"`trl vllm-serve` exited with {proc.returncode} before serving:\n{log_tail()}")
                try:
                    if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() - started > SERVER_START_TIMEOUT:
                    raise RuntimeError(
                        f"`trl vllm-serve` not healthy after {SERVER_START_TIMEOUT:.0f} s:\n{log_tail()}"
                    )
                time.sleep(1.0)
            yield base_url
        finally:
            _stop_by_pid(proc)


def _stop_by_pid(proc: subprocess.Popen) -> None:
    """`trl vllm-serve` execs into vLLM's API server, so `proc.pid` is the server, and its engine-core child follows it
    down on SIGTERM. Any descendant still alive after that is stopped by its own PID."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=30)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
