"""A vLLM server that dies or stops answering mid-run (exgrpo_trl/vllm_server.py): one line naming the server and its
address within a bound, never a hang.

The first tests give TRL's client session (its retrying adapter, as `VLLMClient` mounts it, backoff shortened) a port
where nothing listens and a server that accepts a connection and never answers (what SIGSTOP leaves). The slow test
runs the real thing: `trl vllm-serve` (the CPU build) killed, and stopped with SIGSTOP, in the middle of a server-mode
run on one process and on two, then started again; the same run resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.vllm]


def trl_session(backoff: float = 0.01):
    """A requests session with TRL 1.16's retrying adapter (VLLMClient.__init__), its backoff shortened."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    retry = Retry(total=5, connect=5, read=5, status=3, status_forcelist=[500, 502, 503], backoff_factor=backoff,
                  allowed_methods=["POST", "GET"])  # fmt: skip
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry, pool_maxsize=64)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_server():
    """A server that accepts connections and reads requests but never answers (a stopped process's listening socket
    still completes the handshake in the kernel)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def guarded(base_url: str, timeout: float):
    from exgrpo_trl.vllm_server import guard_client

    client = SimpleNamespace(session=trl_session(), base_url=base_url)
    guard_client(client, timeout, lambda: "start the server again, then run the same command")
    return client


def test_a_killed_server_is_one_line_after_the_connection_retries():
    from exgrpo_trl.vllm_server import VLLMServerError

    base = f"http://127.0.0.1:{_free_port()}"  # nothing listens: what a killed server leaves
    client = guarded(base, 30)
    start = time.monotonic()
    with pytest.raises(VLLMServerError) as info:
        client.session.post(f"{base}/v1/completions", json={"prompt": [1, 2]})
    assert time.monotonic() - start < 10
    assert str(info.value) == (
        f"the vLLM server at {base} cannot be reached (a request to /v1/completions failed, retried as TRL retries: "
        "[Errno 111] Connection refused): nothing of this generation batch was trained or saved; start the server "
        "again, then run the same command"
    )


def test_a_server_that_stops_answering_is_one_line_after_the_timeout_and_not_retried():
    from exgrpo_trl.vllm_server import VLLMServerError

    with silent_server() as base:
        client = guarded(base, 1.5)
        start = time.monotonic()
        with pytest.raises(VLLMServerError) as info:
            client.session.post(f"{base}/v1/completions", json={"prompt": [1, 2]})
        seconds = time.monotonic() - start
    # one read of 1.5 s, not sent again: TRL's 5 read retries would have made it 9 s (without the timeout, forever)
    assert 1.5 <= seconds < 4, seconds
    assert str(info.value) == (
        f"the vLLM server at {base} stopped answering (no answer to /v1/completions in 1.5 s, "
        "vllm_server_request_timeout): nothing of this generation batch was trained or saved; start the server "
        "again, then run the same command"
    )
    assert "\n" not in str(info.value)


def test_without_the_guard_a_silent_server_holds_the_request():
    """Today's behaviour, which the guard replaces: TRL's session gives the request no timeout, so it is still
    waiting when this test stops looking (after 5 s)."""
    import requests

    with silent_server() as base:
        session, done = trl_session(), threading.Event()

        def post():
            with contextlib.suppress(requests.RequestException):
                session.post(f"{base}/v1/completions", json={"prompt": [1, 2]})
            done.set()

        threading.Thread(target=post, daemon=True).start()
        assert not done.wait(5.0)


# ---------------------------------------------------------------------------------------------------- the real server
def _server_processes(base_url: str) -> list:
    """The `trl vllm-serve` processes (API server and engine) listening at `base_url` or started by it."""
    import psutil

    port = int(base_url.rsplit(":", 1)[1])
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(c.laddr and c.laddr.port == port and c.status == "LISTEN" for c in proc.net_connections()):
                return [proc, *proc.children(recursive=True)]
    raise AssertionError(f"no process listens at {base_url}")


def _run_until_failure(command, env, cwd, base_url: str, how: str, after_step: int, limit: float):
    """Start the run, and once it has printed STEP `after_step`, kill the server (`how` = "kill") or stop it
    (SIGSTOP, "stop"); returns (exit code, seconds from the failure to the run's exit, stdout, stderr)."""
    import signal
    import subprocess

    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == f"STEP {after_step}":
            break
    victims = _server_processes(base_url)
    for victim in victims:
        with contextlib.suppress(Exception):
            victim.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    failed = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        import os

        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, time.monotonic() - failed, "".join(lines) + stdout, stderr, victims
    return proc.returncode, time.monotonic() - failed, "".join(lines) + stdout, stderr, victims


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_server_killed_or_stopped_mid_run_stops_the_run_in_one_line_and_the_run_resumes(
    tmp_path, how, processes, capsys
):
    """The server is killed (SIGKILL) or stopped (SIGSTOP) once checkpoint-4 is written; the run must end within the
    bound (a stopped server: the request timeout, 20 s here, plus a step; a killed one: TRL's connection retries,
    about 62 s), with exit 1 and one line naming the server, no rank left behind; then, the server started again at
    the same address, the same command resumes from the newest complete checkpoint and finishes."""
    import os
    import sys

    from exgrpo_trl.checkpoints import find_resumable_checkpoint

    from .helpers import REPO, build_model_dir, trl_vllm_serve, vllm_env

    model = build_model_dir(tmp_path / "model")
    env = {**os.environ, **vllm_env(tmp_path), "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    script = [str(REPO / "tests" / "vllm" / "server_failure_run.py")]
    if processes == 2:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(REPO / "recipes" / "accelerate" / "cpu_ddp.yaml"), "--num_processes", "2"]  # fmt: skip
    else:
        launch = [sys.executable]
    bound = 20 + 30 if how == "stop" else 62 + 30
    with trl_vllm_serve(model, tmp_path, vllm_env(tmp_path)) as base:
        command = [*launch, *script, "--base-url", base, "--model", model, "--out", str(tmp_path / "run"),
                   "--max-steps", "10", "--request-timeout", "20"]  # fmt: skip
        code, seconds, stdout, stderr, victims = _run_until_failure(command, env, REPO, base, how, 4, 4 * bound)
        for victim in victims:  # let the stopped server go (its context stops it)
            with contextlib.suppress(Exception):
                victim.kill()
    with capsys.disabled():
        print(f"\n{how} at step 4, {processes} process(es): stopped after {seconds:.1f} s, exit {code}")
    assert code not in (0, None), (code, stderr[-3000:])
    assert seconds < bound, (seconds, stderr[-3000:])
    errors = [line for line in stderr.splitlines() if line.startswith("exgrpo train: error:")]
    assert len(errors) == 1, stderr[-3000:]
    what = "stopped answering (no answer to" if how == "stop" else "cannot be reached (a request to"
    assert errors[0].startswith(f"exgrpo train: error: the vLLM server at {base} {what}"), errors[0]
    newest, _ = find_resumable_checkpoint(str(tmp_path / "run" / "out"))
    assert newest is not None and int(newest.rsplit("-", 1)[1]) >= 4
    assert errors[0].endswith(f"(`exgrpo train` resumes from the newest complete checkpoint, {newest})")
    # the server back at the same address: the same command resumes and finishes
    port = int(base.rsplit(":", 1)[1])
    with trl_vllm_serve(model, tmp_path, vllm_env(tmp_path), port=port) as again:
        assert again == base
        import subprocess

        rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"DONE 10 FROM {newest}" in rerun.stdout
