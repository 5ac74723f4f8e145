"""What every route of an API process works with: its ranks, its requests on them, the model's
tokenizers and chat format, its limits and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from deepinfer.serve.api.limits import RequestLimits
from deepinfer.serve.api.request_fields import UnknownFields
from deepinfer.serve.api.shutdown import Drain
from deepinfer.serve.chat.format import ChatFormat
from deepinfer.serve.metrics.server import ServerMetrics
from deepinfer.serve.ranks.request_stream import RequestStream
from deepinfer.serve.ranks.supervisor import RankSupervisor


@dataclass
class ServerState:
    supervisor: RankSupervisor  # the ranks: their health, stats and control calls
    requests: RequestStream  # this process's requests on them
    tokenizer: Any
    model_name: str
    model_dir: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = 0
    prompt_tokenizer: Any = None  # a VerifiedTokenizer; encode(text, add_special_tokens)
    grammars: Any = None  # a GrammarPool (serve/grammar/pool.py): constraints compile there
    limits: RequestLimits = RequestLimits()
    sampling_defaults: dict[str, Any] | None = None  # the checkpoint's generation config
    metrics_public: bool = False  # with an API key: /metrics still open
    chat_format: ChatFormat | None = None  # None: found from model_dir once, here
    trust_remote_code: bool = False  # the model folder's own Python may run (encoding.py)
    tool_call_parser: str = "auto"  # --tool-call-parser: a name, or auto (from the checkpoint)
    large_bodies: Any = None  # a LargeBodyParser (serve/api/body_parse.py); None: all on the loop
    drain: Drain | None = None  # admission while the server stops (serve/api/shutdown.py)
    # request fields no table knows: a 400, or ignored (--ignore-unknown-fields)
    unknown_fields: UnknownFields = field(default_factory=UnknownFields)

    def __post_init__(self) -> None:
        if self.chat_format is None:
            self.chat_format = ChatFormat.of(self.model_dir, self.trust_remote_code,
                                             self.tool_call_parser)


def server_state(request: Request) -> ServerState:
    """The app's ServerState (create_app puts it on app.state.server): every route's
    dependency."""
    return request.app.state.server
