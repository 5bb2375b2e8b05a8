"""The facts of a sparse MoE block (``MoePlan``), which analysis/moe.py fills in and the
fuse_experts pass reads; re-exported by analyze/plan.py with the other plans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hfrewrite.analyze.expert_layouts import ExpertLayout
from hfrewrite.analyze.router_scorings import Scoring

if TYPE_CHECKING:
    from hfrewrite.analyze.plan import MlpPlan


@dataclass(frozen=True)
class MoePlan:
    """A sparse MoE block: router -> softmax or sigmoid -> (grouped) top-k -> (renormalise,
    scale) -> fused experts, optionally plus a shared expert MLP, scaled by
    ``sigmoid(shared_expert_gate(x))`` when it has a gate."""

    module_class: str  # e.g. "Qwen3MoeSparseMoeBlock"
    router: str  # attribute of the router module, e.g. "gate"
    router_class: str
    experts: str  # attribute of the experts module, e.g. "experts"
    experts_class: str
    num_experts: int
    top_k: int
    scoring: Scoring  # analyze/router_scorings.py
    renormalize: bool  # as traced; the source's own condition is emitted
    activation: str  # the config's activation name
    shared_expert: str | None  # attribute of the shared expert MLP, if any
    shared_expert_gate: str | None  # attribute of its sigmoid gate Linear, if any
    # Per-expert weight names in Hub checkpoints: (gate, down, up), e.g. ("w1", "w2", "w3")
    checkpoint_expert_names: tuple[str, str, str] = (
        "gate_proj",
        "down_proj",
        "up_proj",
    )
    # Hub checkpoint name -> module name substrings, e.g. ((".block_sparse_moe.", ".mlp."),)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Routing beyond softmax top-k (analyze/routing.py), proven by the replay:
    router_linear: str | None = None  # the router's nn.Linear child holding the weight (hunyuan's "wg")
    router_bias: bool = False  # the router linear has a bias
    router_fp32: bool = False  # the router computes its logits in float32
    # the block's tensor added to the scores for the choice only: the router's
    # ("gate.e_score_correction_bias") or the block's own ("e_score_correction_bias")
    correction_bias: str | None = None
    correction_bias_2d: bool = False  # ... held as [1, E] (ernie's moe_statics), else [E]
    n_group: int | None = None  # grouped top-k: groups, and how many of them are kept
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0  # applied to the routed weights
    # (fact, attribute path in the block holding its value), e.g. (("n_group", "gate.num_group"),)
    config_attrs: tuple[tuple[str, str], ...] = ()
    # Each `if` test in the router's forward and what it gave on the traced config, e.g.
    # (('self.topk_method == "greedy"', True),): only the traced branch is proven
    router_branches: tuple[tuple[str, bool], ...] = ()
    # Config switches of the block's ``__init__`` (``if config.ep_size > 1:``) and their value
    # on the traced config: the rewrite keeps the branch taken and refuses the others
    init_switches: tuple[tuple[str, bool], ...] = ()
    # Routing the rules above do not express, run by the source's own router module and
    # handed to the fused experts as a custom routing function: the positions of
    # (weights, expert ids) in what the router returns. ``scoring`` is then ``CARRIED``.
    carried_router: tuple[int, int] | None = None
    # Experts held one module each (an nn.ModuleList): their MLP's facts, and the block
    # attribute holding top_k; None for stacked [E, ...] experts
    expert_mlp: MlpPlan | None = None
    top_k_attr: str | None = None
    # Stacked experts as gpt_oss holds them: gate_up_proj [E, H, 2I] and down_proj [E, I, H]
    # (transposed), gate and up interleaved along 2I, biases; each proven by the replay
    # The block returns a tuple (gpt_oss: hidden states, router scores): the index of the
    # hidden states in it; the emitted block returns them alone
    output_index: int | None = None
    output_module: str | None = None  # a child run on the whole output last (A.X-K1's norm)
    experts_layout: ExpertLayout = ExpertLayout.HALVES  # analyze/expert_layouts.py
    experts_bias: bool = False
    # ... the experts' attributes holding swigluoai's alpha and limit (gpt_oss), if any
    swiglu_attrs: tuple[str, str] | None = None
    # Experts held as three flat [E * I, H] parameters (dbrx): their names in the experts
    # module as (gate, up, down), the down one holding each expert's projection transposed
    flat_experts: tuple[str, str, str] | None = None
    # The experts module's attributes holding (num_experts, hidden_size, intermediate_size),
    # found by value (None where no one attribute holds it), whose source expressions the
    # file keeps; flat experts need all three
    size_attrs: tuple[str | None, str | None, str | None] | None = None
    # A router whose string switch has several branches proven (analyze/moe_variants.py):
    # (the attribute, every string proven), and the test under which routing is grouped
    # (``self.topk_method == 'group_limited_greedy'``) when only some branches group experts
    router_switch: tuple[str, tuple[str, ...]] | None = None
    grouped_when: str | None = None
    # The block scales each chosen expert's input by its weight instead of its output
    # (Llama-4: vLLM's ``apply_router_weight_on_input``, for one expert per token)
    weights_on_input: bool = False

    @property
    def grouped(self) -> bool:
        """Routing vLLM's CPU router computes on its grouped top-k path only."""
        if self.carried_router:
            return False
        return (
            self.scoring is Scoring.SIGMOID
            or self.n_group is not None
            or self.correction_bias is not None
            or self.routed_scaling_factor != 1.0
        )

    def describe_routing(self) -> str:
        """The routing in one line, for --explain and refusals."""
        if self.carried_router:
            return f"{self.router_class} (source, carried) -> top-{self.top_k} weights and ids"
        steps = [
            f"F.linear{' (float32)' if self.router_fp32 else ''}{' + bias' if self.router_bias else ''}",
            self.scoring.label,
        ]
        if self.correction_bias:
            steps.append(f"+ {self.correction_bias} (choice only)")
        if self.n_group:
            steps.append(f"top-{self.topk_group} of {self.n_group} groups")
        elif self.grouped_when:
            steps.append(f"(groups of experts where {self.grouped_when})")
        steps += [f"top-{self.top_k}", f"renormalize={self.renormalize}"]
        if self.routed_scaling_factor != 1.0:
            steps.append(f"x {self.routed_scaling_factor:g}")
        if self.weights_on_input:
            steps.append("weights the experts' input")
        return " -> ".join(steps)
