"""`hfrewrite convert --explain` shows the facts analysis found, through the real pipeline."""

import subprocess
import sys
from pathlib import Path

HFREWRITE = Path(sys.executable).parent / "hfrewrite"


def test_explain_shows_router_facts(tmp_path):
    proc = subprocess.run(
        [
            str(HFREWRITE),
            "convert",
            "--no-verify",
            "qwen3_moe",
            "-o",
            str(tmp_path),
            "--explain",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line for line in proc.stdout.splitlines() if line.startswith("Qwen3MoeSparseMoeBlock")]
    assert any(
        "router gate: F.linear -> softmax -> top-2 -> renormalize=True (emitted renormalize=config.norm_topk_prob)"
        in r
        for r in rows
    ), proc.stdout
    assert any("FusedMoEFactory" in r and "experts.N.{gate_proj,up_proj,down_proj}" in r for r in rows), (
        proc.stdout
    )
    assert (tmp_path / "qwen3_moe.py").exists()


def test_explain_names_why_a_layer_with_kept_norms_is_carried(tmp_path, capsys):
    from hfrewrite.cli import main

    assert main(["convert", "--no-verify", "starcoder2", "-o", str(tmp_path), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "the norms are the source's; the layer's forward is carried from the source" in out
