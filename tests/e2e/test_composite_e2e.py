"""Multimodal checkpoints served as their text model (passes/composite_text.py), in real vLLM
against Hugging Face: the goldens of ``llama4`` (Llama-4's released layout:
``Llama4ForConditionalGeneration``, text model under ``language_model.``), ``gemma3``
(Gemma-3 4B and up), ``got_ocr2`` (whose text model is Qwen2's, from another modeling
file) and ``fuyu`` (Persimmon's text model beside a linear patch embedding, its config
holding a vocabulary size of its own besides its text config's) load tiny random multimodal checkpoints saved by transformers, vision tower included,
and generate what the multimodal class generates from text. A Gemma-3 checkpoint written
with transformers 5's names in memory (``model.language_model.``) loads the same. vLLM's
own classes for these architectures are multimodal: the comparison is with Hugging Face.

A file whose subclass skipped the text model's tensors instead of renaming them is caught:
vLLM refuses the model whose weights were not loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from safetensors.torch import load_file, save_file

from hfrewrite.analyze.composite import text_part, with_text
from hfrewrite.cli import main
from hfrewrite.verify.compare import LOGPROB_TOL, VerifyCase, verify_many
from hfrewrite.verify.fixtures import TINY_DEFAULTS, save_random_checkpoint

pytestmark = pytest.mark.vllm

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
TEXT = {
    "llama4": {
        "num_local_experts": 8,
        "intermediate_size": 64,
        "intermediate_size_mlp": 256,
        "attention_chunk_size": 32,
    }
}
CASES = ("llama4", "gemma3", "got_ocr2", "gemma3-in-memory-names", "fuyu")


def _checkpoint(model_type: str, out: Path, seed: int) -> Path:
    config = transformers.AutoConfig.for_model(model_type)
    text = type(text_part(config))(**{**TINY_DEFAULTS, "num_hidden_layers": 2, **TEXT.get(model_type, {})})
    return save_random_checkpoint(with_text(config, text), out, seed=seed)


def _in_memory_names(ckpt: Path) -> None:
    """Rename a saved Gemma-3 checkpoint's tensors to transformers 5's names in memory."""
    path = ckpt / "model.safetensors"
    renames = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower."}
    renames["multi_modal_projector."] = "model.multi_modal_projector."
    tensors = {}
    for name, tensor in load_file(path).items():
        old = next((p for p in renames if name.startswith(p)), None)
        tensors[renames[old] + name[len(old) :] if old else name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    found = {}
    for i, case in enumerate(CASES):
        model_type = case.split("-")[0]
        found[case] = _checkpoint(model_type, tmp_path_factory.mktemp(case), seed=i)
        if case.endswith("in-memory-names"):
            _in_memory_names(found[case])
    return found


@pytest.fixture(scope="module")
def reports(checkpoints):
    cases = [VerifyCase(ckpt, GOLDEN / f"{case.split('-')[0]}.py") for case, ckpt in checkpoints.items()]
    return dict(zip(checkpoints, verify_many(cases, native=False)))


@pytest.mark.parametrize("case", CASES)
def test_the_golden_serves_the_multimodal_checkpoints_text_model(reports, case):
    report = reports[case]
    assert report.problems == (), report.summary()
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()


def test_a_file_skipping_the_text_model_is_refused_at_load(tmp_path, capsys, checkpoints):
    text = (GOLDEN / "gemma3.py").read_text()
    planted = '"language_model.model.": "model.",'
    assert text.count(planted) == 1
    path = tmp_path / "gemma3.py"
    path.write_text(text.replace(planted, '"language_model.model.": None,'))
    code = main(["verify", str(checkpoints["gemma3"]), "--generated", str(path)])
    out = capsys.readouterr().out
    assert code != 0
    assert "FAILED" in out
