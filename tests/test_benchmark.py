"""Pure helpers of benchmarks/throughput: no timing, no vLLM, no subprocess."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks.throughput import (
    gemms,
    orders,
    plot,
    report,
    stats,
    targets,
    workloads,
)

MARK = "hfrewrite_bench::decoder_layer"


def test_summarize_median_min_max_spread():
    s = stats.summarize([100.0, 120.0, 110.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (110.0, 100.0, 120.0, 3)
    assert s["spread"] == pytest.approx(20 / 110)
    assert stats.summarize([])["median"] is None
    assert stats.summarize([None, 4.0])["n"] == 1


def test_paired_ratios():
    assert stats.paired_ratios([110, 90], [100, 100]) == [1.1, 0.9]
    assert stats.paired_ratios([1.0], [0]) == []


def test_agreement_counts_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    same = stats.agreement(ref, ref)
    assert same["identical"] == 2 and same["token_match"] == 1.0
    assert same["first_divergence"] is None
    diff = stats.agreement([[1, 2, 3, 4], [5, 6, 0, 0]], ref)
    assert diff["identical"] == 1
    assert diff["first_divergence"] == 2
    assert diff["token_match"] == pytest.approx(6 / 8)


def test_agreements_each_pair_once():
    toks = {"generated": [[1]], "native": [[1]], "hf": [[2]], "transformers": None}
    pairs = stats.agreements(toks)
    assert set(pairs) == {"generated~native", "hf~native", "generated~hf"}
    assert pairs["generated~hf"]["identical"] == 0


def test_is_gemm_names():
    for name in ("aten::mm", "aten::addmm", "aten::linear", "_C::onednn_mm"):
        assert gemms.is_gemm(name)
    for name in ("aten::add", "_C::rms_norm", "aten::scaled_dot_product_attention"):
        assert not gemms.is_gemm(name)
    assert gemms.is_moe_kernel("_C::cpu_fused_moe")
    assert not gemms.is_moe_kernel("_C::onednn_mm")


def test_count_gemms_outermost_inside_layers():
    layer = ("model", MARK)
    events = [
        (MARK, ("model",)),
        ("aten::linear", layer),
        ("aten::addmm", (*layer, "aten::linear")),  # nested in linear: not again
        ("_C::onednn_mm", layer),
        ("aten::bmm", (*layer, "aten::scaled_dot_product_attention")),  # attention
        ("_C::cpu_fused_moe", layer),
        (MARK, ("model",)),
        ("_C::onednn_mm", ("model", MARK)),
        ("_C::onednn_mm", ("model",)),  # lm_head: outside the layers
    ]
    c = gemms.count_gemms(events, MARK)
    assert c["layer_calls"] == 2
    assert c["gemm_in_layers"] == {"aten::linear": 1, "_C::onednn_mm": 2}
    assert c["gemm_per_layer"] == 1.5
    assert c["gemm_outside_layers"] == {"_C::onednn_mm": 1}
    assert c["gemm_total"] == 4
    assert c["moe_kernels_per_layer"] == 0.5


def test_throughput_verdict():
    assert targets.throughput_verdict(0.99, 0.01) is True
    assert targets.throughput_verdict(0.95, 0.10) == "yes, within noise"
    assert targets.throughput_verdict(0.95, 0.03) is False


def test_balanced_orders_each_pair_adjacent_equally():
    for n in (2, 3, 4, 5):
        rows = orders.balanced_orders(n)
        assert all(sorted(r) == list(range(n)) for r in rows)
        follows = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    assert orders.run_order(["g", "n"], -1) == ["n", "g"]


def test_rotate_interleaves():
    xs = ["a", "b", "c"]
    assert [orders.rotate(xs, k) for k in range(3)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
    ]


def test_golden_types_reads_source_header(tmp_path):
    (tmp_path / "llama.py").write_text(
        '# hfrewrite-source: {"hfrewrite": "0.1.0", "model": "llama"}\nx = 1\n'
    )
    (tmp_path / "notes.py").write_text("x = 1\n")
    assert workloads.golden_types(tmp_path) == ["llama"]


def _variant(tps, startup, gemm_in=None, cpu=None):
    v = {
        "tps": tps,
        "cpu_s": cpu or [1.0] * len(tps),
        "throughput": stats.summarize(tps),
        "startup_s": startup,
        "startup_first_s": startup[0],
        "model_class": "x.Cls",
        "tokens": [[1, 2]],
    }
    if gemm_in is not None:
        v["gemm"] = {
            "layer_calls": 2,
            "gemm_in_layers": {"_C::onednn_mm": gemm_in * 2},
            "gemm_outside_layers": {"_C::onednn_mm": 2},
            "moe_kernels_in_layers": {},
            "gemm_per_layer": float(gemm_in),
            "gemm_total": gemm_in * 2 + 2,
            "forwards": 2,
        }
    return v


def _results():
    var = {
        "generated": _variant([101.0, 104.0, 99.0], [3.0, 3.1], 4),
        "native": _variant([101.0, 100.0, 99.0], [3.0, 3.0], 4),
        "hf": _variant([60.0, 61.0, 59.0], [0.5], 7),
    }
    mres = {
        "variants": var,
        "agreement": stats.agreements({n: v["tokens"] for n, v in var.items()}),
        "ratios": stats.ratios_to_native(var),
    }
    return {
        "meta": {"workload": workloads.FULL.__dict__, "machine": {"cpu": "Test CPU"}},
        "models": {
            "llama": {"description": "Dense Llama", "modes": {"eager": mres}},
            "qwen3_moe": {"skipped": "no golden"},
        },
        "convert": {
            "import_baseline_s": [3.0, 3.2],
            "types": {"llama": {"samples": [8.0], "ok": True, "same_as_golden": True}},
        },
    }


def test_ratios_and_targets():
    res = _results()
    r = res["models"]["llama"]["modes"]["eager"]["ratios"]["generated"]
    assert r["throughput_paired"]["median"] == pytest.approx(1.0)
    assert r["gemm_per_layer"] == (4.0, 4.0)
    assert r["startup_of_medians"] == pytest.approx(3.05 / 3.0)
    (t,) = targets.targets(res)
    assert t["throughput_ok"] is True and t["gemm_ok"] is True
    assert t["startup_ok"] is True


def test_render_markdown_has_tables_and_skips():
    text = report.render_markdown(_results())
    assert "## Targets" in text
    assert "| llama | eager | yes (yes) | 1.000" in text
    assert "4 vs 4 per layer" in text
    assert "Skipped: no golden." in text
    assert "`_C::onednn_mm` x4" in text
    assert "3/1" not in text and "1/1 sequences identical" in text
    assert report.REPRODUCE in text


def test_plot_writes_png(tmp_path):
    plot.plot(_results(), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
