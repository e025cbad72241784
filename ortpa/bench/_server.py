"""A live ``ortpa serve`` in a child process for the serving benchmarks: started on a free port, waited for until
healthy, stopped after."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["live_server"]


@contextlib.contextmanager
def live_server(folder: Path, name: str, extra: Sequence[str] = ()) -> Iterator[str]:
    """``ortpa serve folder`` as model ``name`` (``extra``: more options); yields its base URL
    (``http://127.0.0.1:PORT``)."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ortpa", "serve", str(folder), "--port", str(port), "--served-model-name", name]
    # one ONNX Runtime thread, as the engine benchmark: client and server share the cores, and a spinning
    # thread pool would take them from the event loop and the client (3x slower steps measured on 2 busy cores);
    # --quiet also turns the access log off, whose lines would fill the unread stderr pipe
    cmd += ["--num-blocks", "2048", "--max-num-seqs", "64", "--threads", "1", "--quiet", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ortpa serve exited: {proc.stderr.read().decode(errors='replace')}")
            with contextlib.suppress(OSError), urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("ortpa serve did not become healthy in 120 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
