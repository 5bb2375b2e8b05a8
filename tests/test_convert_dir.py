"""Converting a local checkpoint directory through the real pipeline."""

import json
import subprocess
import sys
from pathlib import Path

HFREWRITE = Path(sys.executable).parent / "hfrewrite"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_local_dir_with_another_architecture_name(tmp_path):
    """A config may name an architecture the modeling source does not define (fine-tunes,
    renamed heads): the source's causal-LM class is rewritten, and since the modeling
    source is the same, the body equals the golden's."""
    model = tmp_path / "my-model"
    model.mkdir()
    config = {"model_type": "llama", "architectures": ["MyLlamaForCausalLM"], "hidden_size": 256}
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    subprocess.run([str(HFREWRITE), "convert", "--no-verify", str(model), "-o", str(out)], check=True, capture_output=True)
    text = (out / "llama.py").read_text()
    assert "class LlamaForCausalLM(" in text
    body = lambda t: t.split("\n\n", 1)[1]  # noqa: E731  (after the header naming the source)
    assert body(text) == body((GOLDEN / "llama.py").read_text())
