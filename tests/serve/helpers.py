"""What the serve tests share: the served folder's contents, a live ``ortpa serve`` subprocess, raw HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "fixtures" / "llama_sdpa_op18.onnx"  # vocab 256, 256 positions
VOCAB = 256
CONTEXT = 256
MODEL_NAME = "tiny"
EOS = 1
WORDS = ["<s>", "</s>", "user", "assistant", "system", "hello", "world", "the", "paged", "latent", "cache"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['role'] }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
)


def write_tokenizer(path: Path):
    """Word level: WORDS, then w11, w12, ... and [UNK] last; <s> and </s> special; decodes with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = WORDS + [f"w{i}" for i in range(len(WORDS), VOCAB - 1)] + ["[UNK]"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0, headers: dict | None = None) -> tuple[int, bytes]:
    status, _, body = request("GET", url, None, timeout, headers)
    return status, body


def request(
    method: str, url: str, body: bytes | None, timeout: float = 30.0, headers: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A raw HTTP exchange (the openai client cannot send malformed JSON): status, headers, body."""
    req = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(base: str, name: str) -> float:
    """The value of one unlabelled sample of /metrics."""
    _, text = get(base + "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text.decode()}")


@dataclass
class Server:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    log: Path

    @property
    def api(self) -> str:
        return self.base + "/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lines_with(self, text: str, timeout_s: float = 15.0) -> list[str]:
        """The log's lines holding ``text``, waiting up to ``timeout_s`` for the first: the server writes a
        request's access line after the response is sent, so a loaded machine may show it a moment later."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = [line for line in self.output().splitlines() if text in line]
            if lines or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)


@contextlib.contextmanager
def serve(
    folder: Path, *extra: str, startup_s: float = 90.0, model: str | None = None, env: dict | None = None
) -> Iterator[Server]:
    """``ortpa serve`` on ``folder`` (or ``model``, a repo id, with its log beside ``folder``), on a port the system
    picks (``--port 0``, read from its "on http://..." line): parallel test workers never race for one."""
    log = Path(tempfile.mkstemp(prefix="serve-", suffix=".log", dir=folder.parent)[1])
    cmd = [sys.executable, "-m", "ortpa", "serve", model or str(folder), "--port", "0"]
    cmd += ["--served-model-name", MODEL_NAME, *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(proc, "", log)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"ortpa serve exited with {proc.returncode}:\n{server.output()}")
            if not server.base:
                found = re.search(r" on (http://127\.0\.0\.1:\d+)/v1 ", server.output())
                server.base = found.group(1) if found else ""
            with contextlib.suppress(OSError):
                if server.base and get(server.base + "/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"ortpa serve not healthy after {startup_s} s:\n{server.output()}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
