"""A grammar worker: a process that compiles constraints for an API process.

It runs as `python -m deepinfer.serve.grammar.worker`, reading jobs on stdin and writing
results on stdout (length-prefixed pickles; `serve/grammar/pool.py` starts and kills it). A
compile holds no one else's event loop, GIL or heartbeat, and one that runs too long dies with
its process. It exits when its stdin closes (the API process is gone).
"""
from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, BinaryIO

from deepinfer.core.sampling import StructuredOutput

HEADER = struct.Struct("<Q")  # each message: its length, then its pickle
# How long a compiled grammar may take to be written out. xgrammar writes some grammars (an
# anyOf of many objects) at a size of rules x states (hundreds of MB); past this the worker
# sends none, the rank compiles the constraint itself (about as fast as here), and the worker
# exits, as the write still runs.
SERIALIZE_BUDGET_S = 1.0


READY = "ready"


@dataclass(frozen=True)
class WorkerSetup:
    """The rank's tokenizer facts: a grammar compiled with them loads in the rank."""

    model_dir: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    trust_remote_code: bool = False  # the user's opt-in for a tokenizer class of the folder


@dataclass(frozen=True)
class Compiled:
    serialized: str | None  # CompiledGrammar.serialize_json(); None: the rank compiles it
    error: str | None = None  # the constraint is invalid (a clean one-line message)
    seconds: float = 0.0  # compile time
    retiring: bool = False  # the worker exits after this answer


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def write_message(out: BinaryIO, message: Any) -> None:
    out.write(frame(message))
    out.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return pickle.loads(stream.read(HEADER.unpack(header)[0]))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process stops us
    jobs, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's print must not corrupt the results stream
    setup: WorkerSetup = read_message(jobs)
    if setup is None:
        return
    try:
        compiler = _compiler(setup)
    except ValueError as exc:  # xgrammar is not installed
        write_message(out, str(exc))
        return
    write_message(out, READY)
    while (spec := read_message(jobs)) is not None:
        result = compile_one(compiler, spec)
        write_message(out, result)
        if result.retiring:
            os._exit(0)  # the abandoned write still runs in its thread


def _compiler(setup: WorkerSetup) -> Any:
    from transformers import AutoTokenizer

    from deepinfer.core.structured import import_xgrammar, tokenizer_info

    tokenizer = AutoTokenizer.from_pretrained(setup.model_dir,
                                              trust_remote_code=setup.trust_remote_code)
    info = tokenizer_info(tokenizer, setup.vocab_size, setup.stop_token_ids)
    # The API process caches results; one thread: the pool's size is the parallelism.
    return import_xgrammar().GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_one(compiler: Any, spec: StructuredOutput) -> Compiled:
    from deepinfer.core.structured import compile_constraint

    start = time.perf_counter()
    try:
        compiled = compile_constraint(compiler, spec)
    except ValueError as exc:
        return Compiled(None, str(exc), time.perf_counter() - start)
    seconds = time.perf_counter() - start
    serialized = _serialize(compiled, SERIALIZE_BUDGET_S)
    return Compiled(serialized, None, seconds, retiring=serialized is None)


def _serialize(compiled: Any, budget_s: float) -> str | None:
    """The grammar's JSON text if it is written within the budget (xgrammar writes it without
    the GIL, so this thread can stop waiting)."""
    box: list[str] = []
    writer = threading.Thread(target=lambda: box.append(compiled.serialize_json()),
                              daemon=True)
    writer.start()
    writer.join(budget_s)
    return box[0] if box else None


if __name__ == "__main__":
    # Through the module's own name: its results must unpickle as its classes, not __main__'s.
    from deepinfer.serve.grammar.worker import main as run

    run()
