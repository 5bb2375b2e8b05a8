"""stale_docstrings: an ``Args:`` section documenting parameters the function lost goes."""

from harness import assert_rewrites, rewrite
from hfrewrite.passes import stale_docstrings
from plans import llama_like

BEFORE = '''\
class CohereDecoderLayer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """
        Args:
            hidden_states (`torch.FloatTensor`): input to the layer of shape `(batch, seq_len, embed_dim)`
            attention_mask (`torch.FloatTensor`, *optional*):
                attention mask of size `(batch_size, sequence_length)`
            use_cache (`bool`, *optional*):
                If set to `True`, `past_key_values` key value states are returned
        """
        residual = hidden_states
        return residual


def sparsemixer(scores, jitter_eps, training):
    """
    Sparse mixer function to select top-k experts.

    Args:
        scores (torch.Tensor): Input scores tensor.
        top_k (int): Number of top experts to select.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: Multiplier and selected experts tensors.
    """
    return scores


def dropout_add(x, residual, prob, training):
    """
    Dropout add function

    Args:
        x (`torch.tensor`):
            input tensor
        residual (`torch.tensor`):
            residual tensor
        prob (`float`):
            dropout probability
        training (`bool`):
            training mode
    """
    return x + residual
'''

AFTER = '''\
class CohereDecoderLayer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        return residual


def sparsemixer(scores, jitter_eps, training):
    """
    Sparse mixer function to select top-k experts.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: Multiplier and selected experts tensors.
    """
    return scores


def dropout_add(x, residual, prob, training):
    """
    Dropout add function

    Args:
        x (`torch.tensor`):
            input tensor
        residual (`torch.tensor`):
            residual tensor
        prob (`float`):
            dropout probability
        training (`bool`):
            training mode
    """
    return x + residual
'''


def test_args_documenting_lost_parameters_go_and_current_ones_stay():
    assert_rewrites(stale_docstrings, BEFORE, AFTER, llama_like())


def test_a_section_not_laid_out_as_entries_stays():
    source = '''\
def f(x):
    """Args:
    the input, and also attention_mask (unused)
  continued at another indentation
    """
    return x
'''
    assert rewrite(stale_docstrings, source, llama_like()) == source
