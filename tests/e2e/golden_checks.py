"""What every golden's proof in real vLLM asserts of one verify report."""

from __future__ import annotations

from hfrewrite.verify.compare import LOGPROB_TOL, VerifyReport


def assert_equals_hf(report: VerifyReport) -> None:
    """The generated file ran in vLLM and decoded Hugging Face's greedy tokens (not repeats),
    chosen-token logprobs within the tolerance."""
    assert report.hf_tokens and len(set(report.hf_tokens[3])) > 4, "greedy decoding degenerated into repeats"
    assert report.generated_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_hf is not None and report.logprob_diff_hf <= LOGPROB_TOL, report.summary()
    assert report.generated_class.startswith("hfrewrite_generated_"), report.summary()


def assert_native(report: VerifyReport, equal: bool, differs_because: str) -> None:
    """vLLM's own file decodes Hugging Face's tokens within the tolerance (``equal``), or
    decodes others, for the reason the caller knows (it fails when vLLM changes)."""
    assert report.native_tokens is not None, report.summary()
    if not equal:
        assert report.native_tokens != report.hf_tokens, f"no longer true: {differs_because}"
        return
    assert report.native_tokens == report.hf_tokens, report.summary()
    assert report.logprob_diff_native <= LOGPROB_TOL and report.problems == (), report.summary()
