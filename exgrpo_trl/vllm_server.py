"""A vLLM server (`trl vllm-serve`, TRL's server mode) that dies or stops answering mid-run: told in one line within a
bound, instead of a traceback after a minute of retries, or a hang.

TRL 1.16's `VLLMClient` sends every request through one `requests` session with no timeout, retrying a failed
connection 5 times (backoff 2-32 s) and a failed read 5 times: a server killed mid-run is found after about a minute
and reported as a `MaxRetryError` traceback; a server that stops answering without dying (SIGSTOP, a hung worker)
leaves the request waiting forever, and with it every other rank, blocked in the collective that waits for the
main process's completions. `guard_client` mounts an adapter on that session which keeps TRL's retries but gives
every request a read timeout (`vllm_server_request_timeout`) after which it is not sent again (a request unanswered
that long is not answered by sending it again), and turns a failure into `VLLMServerError`, one line that names the
server and its address and says how to go on. The main process then exits, and `accelerate launch` stops
the other ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 10.0  # to open a connection to the server (each of TRL's connection retries)


class VLLMServerError(ConnectionError):
    """The vLLM server could not be reached or stopped answering; the message is the whole line to show."""


def guard_client(client, read_timeout: float, then: Callable[[], str]) -> None:
    """Mount the guarding adapter on `client`'s session (a TRL `VLLMClient`), for http and https. `then()`: what the
    user does next (start the server again, rerun the command), said after what happened."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.exceptions import MaxRetryError, ReadTimeoutError
    from urllib3.util.retry import Retry

    class NoRetryAfterTimeout(Retry):
        """TRL's retries (a refused or reset connection, a 5xx), except a read that timed out: not sent again."""

        def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
            if isinstance(error, ReadTimeoutError):
                raise MaxRetryError(_pool, url, error) from error
            return super().increment(method, url, response, error, _pool, _stacktrace)

    old = client.session.get_adapter(client.base_url)
    r = old.max_retries
    retries = NoRetryAfterTimeout(
        total=r.total, connect=r.connect, read=r.read, status=r.status, status_forcelist=r.status_forcelist,
        backoff_factor=r.backoff_factor, allowed_methods=r.allowed_methods,
    )  # fmt: skip

    class Guarded(HTTPAdapter):
        def send(self, request, **kwargs):
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = (CONNECT_TIMEOUT_S, read_timeout)
            path = urlparse(request.url).path or "/"
            try:
                return super().send(request, **kwargs)
            except requests.exceptions.ConnectionError as error:  # ReadTimeout too; urllib3's MaxRetryError over
                if _timed_out(error):  # a ReadTimeoutError arrives as a ConnectionError
                    what = (
                        f"stopped answering (no answer to {path} in {read_timeout:g} s, vllm_server_request_timeout)"
                    )
                else:
                    what = f"cannot be reached (a request to {path} failed, retried as TRL retries: {_reason(error)})"
                raise VLLMServerError(_line(client.base_url, what, then)) from error

    adapter = Guarded(max_retries=retries, pool_maxsize=getattr(old, "_pool_maxsize", 10))
    client.session.mount("http://", adapter)
    client.session.mount("https://", adapter)


def _timed_out(error: BaseException) -> bool:
    """Whether a request failed because its read timed out (requests' ReadTimeout, or urllib3's ReadTimeoutError
    as the reason of its retry error)."""
    import requests
    from urllib3.exceptions import ReadTimeoutError

    if isinstance(error, requests.exceptions.ReadTimeout):
        return True
    inner = error.args[0] if error.args else None
    return isinstance(getattr(inner, "reason", None), ReadTimeoutError)


def _reason(error: BaseException) -> str:
    """The operating system's words for the failure (a refused connection, a reset), else the first line."""
    text = " ".join(str(error).split())
    found = re.search(r"\[Errno -?\d+\] [^'\")(]+", text)
    return found.group(0).strip() if found else text[:160]


def _line(base_url: str, what: str, then: Callable[[], str]) -> str:
    return f"the vLLM server at {base_url} {what}: nothing of this generation batch was trained or saved; {then()}"
