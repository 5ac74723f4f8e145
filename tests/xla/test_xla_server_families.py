"""deepinfer-serve on the Neuron backend's xla device for each family test_xla_server.py does not
serve (llama, DeepSeek-V3's MLA + MoE, DeepSeek-V4): batched prompts longer than a prefill
bucket (chunked), then a prefix-cache hit, every step audited against its plan (a compilation
after start-up or a host sync inside a step fails it); every greedy token is transformers'
argmax, the hit's too.

Runs in the XLA venv (scripts/xla_env.sh); skipped where torch_xla is not installed."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch_xla")

from tests.models.test_deepseek_v4_parity import make_v4, prompts  # noqa: E402,F401
from tests.models.test_moe_parity import (  # noqa: E402
    _assert_reference_greedy,
    _prompts,
    _reference,
)
from tests.xla.serving import (  # noqa: E402
    complete,
    save_tokenizer_for,
    served_checkpoint,
    xla_server,
)

# test_xla_device.py's buckets (tokens 16, 32; batches 1, 2; context 1, 2, 4 blocks) and its
# prompt seeds, whose greedy paths keep the reference's margin.
SHAPES = ["--dtype", "float32", "--block-size", "16", "--num-kv-blocks", "32",
          "--max-num-batched-tokens", "32", "--max-num-seqs", "2", "--max-model-len", "64"]
SEEDS = {"llama": 2, "deepseek_v3_moe": 4}
# test_xla_deepseek_v4.py's: V4's 128-token pages, tokens 16; batches 1, 2; context 1, 2 pages.
V4_SHAPES = ["--dtype", "float32", "--block-size", "128", "--num-kv-blocks", "8",
             "--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--max-model-len", "256"]


def _serve(path: str, shapes: list[str], log: str, work: list[list[int]],
           hit: list[int]) -> tuple[list[list[int]], dict]:
    """Send `work` at once, then `hit`, to the model served on the xla device; the greedy
    tokens of each and the hit's reply."""
    with xla_server(path, shapes, log) as url:
        with ThreadPoolExecutor(len(work)) as pool:
            replies = list(pool.map(lambda prompt: complete(url, prompt, 16), work))
        replies.append(complete(url, hit, 16))
    errors = [r["error"] for r in replies if "error" in r]
    assert not errors, f"{errors[0]}\n{open(log).read()[-3000:]}"
    return [r["choices"][0]["token_ids"] for r in replies], replies[-1]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3_moe"])
def test_a_family_through_the_server_equals_transformers(family, tmp_path):
    path = served_checkpoint(str(tmp_path / family), family)
    work = _prompts((5, 23, 40), seed=SEEDS[family])  # 40 tokens: chunks of 32 and 8
    tokens, hit = _serve(path, SHAPES, str(tmp_path / "server.log"), work, work[2])
    model = _reference(path)
    for prompt, out in zip(work + [work[2]], tokens):
        _assert_reference_greedy(model, prompt, out)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_deepseek_v4_through_the_server_equals_transformers(tmp_path, prompts):  # noqa: F811
    path = make_v4(str(tmp_path / "v4"), hc_sinkhorn_iters=5)
    save_tokenizer_for(path)
    short, long = prompts[0], prompts[1]  # 41 and 150 tokens: 3 and 10 chunks
    shared = long[:128] + short[:30]  # a page hit: the CSA carry-over resumes from the page
    tokens, hit = _serve(path, V4_SHAPES, str(tmp_path / "server.log"), [short, long], shared)
    model = _reference(path)
    for prompt, out in zip([short, long, shared], tokens):
        _assert_reference_greedy(model, prompt, out)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
