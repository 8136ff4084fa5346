"""A grammar compiler in a child process, killed when its time is up (xgrammar cannot be
interrupted inside a thread); a crash takes down only the child. Frames: length-prefixed msgpack.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from typing import BinaryIO

import msgpack

_HEADER = struct.Struct(">I")


class CompilerDied(Exception):
    """The child process exited (killed on purpose, or crashed) before it answered."""


def write_frame(stream: BinaryIO, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_frame(stream: BinaryIO) -> dict | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return msgpack.unpackb(body, raw=False)


class CompilerProcess:
    """One child process compiling one grammar at a time. `compile` blocks; `kill` from any
    thread ends a compile at once (CompilerDied)."""

    def __init__(self, tokenizer_info_json: str):
        # -P: the working directory stays off sys.path (a user's `worker.py` cannot shadow us).
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "inferline.worker.engine.grammar_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._ready = False
        self._send({"info": tokenizer_info_json})

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self) -> None:
        """Blocks until the child has imported xgrammar and read the tokenizer."""
        if not self._ready:
            if self._receive() != {"ready": True}:
                raise CompilerDied("the grammar compiler process did not start")
            self._ready = True

    def compile(self, kind: str, text: str) -> str:
        """The compiled grammar as xgrammar's JSON; ValueError for an invalid grammar;
        CompilerDied when the process was killed or crashed meanwhile."""
        self.wait_ready()
        self._send({"kind": kind, "text": text})
        reply = self._receive()
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["compiled"]

    def kill(self) -> None:
        self._proc.kill()

    def close(self) -> None:
        """Ends the child at once, even mid-compile."""
        self._proc.kill()
        for stream in (self._proc.stdin, self._proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._proc.wait()

    def _send(self, message: dict) -> None:
        try:
            write_frame(self._proc.stdin, message)
        except (OSError, ValueError) as exc:  # ValueError: pipe closed by close()
            raise CompilerDied(str(exc)) from exc

    def _receive(self) -> dict:
        try:
            reply = read_frame(self._proc.stdout)
        except (OSError, ValueError) as exc:
            raise CompilerDied(str(exc)) from exc
        if reply is None:
            raise CompilerDied(f"the grammar compiler process exited ({self._proc.poll()})")
        return reply


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """The child's loop: compile what the parent sends until its stdin closes."""
    import xgrammar as xgr

    from inferline.worker.engine.request import StructuredSpec
    from inferline.worker.engine.structured_output import compile_spec

    first = read_frame(stdin)
    if first is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(first["info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(stdout, {"ready": True})
    while (job := read_frame(stdin)) is not None:
        try:
            compiled = compile_spec(compiler, StructuredSpec("", job["kind"], job["text"]))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises many types for bad input
            write_frame(stdout, {"error": str(exc) or type(exc).__name__})
            continue
        write_frame(stdout, {"compiled": compiled.serialize_json()})


if __name__ == "__main__":
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(
        sys.stderr.fileno(), sys.stdout.fileno()
    )  # a library's print must not corrupt the frames
    serve(sys.stdin.buffer, protocol)
