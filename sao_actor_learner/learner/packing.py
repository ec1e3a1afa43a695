"""Padding-free micro-batches: the rollouts of a micro-batch concatenated into one row.

config `micro_batch_layout=packed` (docs/DESIGN.md section 8, "Packed micro-batches"). A
micro-batch of b rollouts with lengths L_0..L_{b-1} (a `Batch` right-padded to width w) becomes
ONE row of N = sum L_i tokens: rollout 0's tokens, then rollout 1's, ...; its position ids restart
at 0 with every rollout (0..L_0-1, 0..L_1-1, ...), so rotary embeddings see what they see in the
padded row. The model's body runs on that row with `position_ids` and no attention mask (and no
KV cache), and attends within each rollout only; which attention does that depends on the
implementation the model was loaded with (`prepare_packed_attention`, once per body):

  sdpa (the default here)       switched to `per_rollout_sdpa` (registered with transformers
                                as "sao_per_rollout_sdpa"): torch's scaled_dot_product_attention
                                called causally on each rollout's slice of the packed row, so
                                attention costs sum L_i^2 and no mask is built, on CPU and GPU
                                alike. Any other call (a padded batch with its mask, a single
                                sequence) is plain sdpa with transformers' usual mask.
  eager, flex_attention, and    transformers' own packed-sequence detection
  sdpa on sliding-window models (`masking_utils.find_packed_sequence_indices`: a new rollout
                                wherever the position does not grow by 1) builds a
                                block-diagonal causal mask [1, 1, N, N]: attention over the
                                whole N x N square, cost and mask memory O(N^2) (keep
                                micro_batch_tokens to a few thousand);
  flash_attention_2 / _3        varlen attention from cumulative lengths derived from the
                                position ids (GPU): no mask, attention cost sum L_i^2.

`check_packed_attention(body)` (run by `prepare_packed_attention`) runs two short rollouts
packed and one by one before training and refuses a model whose attention would see across
rollouts (another implementation, or a transformers version without the detection), instead of
training on mixed rollouts silently.

Everything per token goes back to the padded layout exactly (`PackedRow.unpack`: the value of
packed position j lands at (rollout, position) of token j; padding gets 0), so the loss, its
normalisation and every statistic see the same [b, w] tensors as with padded micro-batches. A
log-prob (or entropy) at a rollout's first token is predicted from the previous rollout's last
hidden state in the packed row; it is set to 0, as position 0 of a padded row is.
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
from absl import logging

LAYOUTS = ("padded", "packed")
PER_ROLLOUT_SDPA = "sao_per_rollout_sdpa"
# The attention implementations that keep packed rollouts apart (see the module docstring).
PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3",
                    PER_ROLLOUT_SDPA)


@dataclasses.dataclass
class PackedRow:
    """One packed row of a padded micro-batch [b, w] (see the module docstring).

    tokens [1, N] and position_ids [1, N] (long); index [N]: the flat position (row * w + col)
    in the padded [b, w] layout of each packed token; starts [1, N] bool: True at each rollout's
    first token; shape (b, w): the padded layout.
    """
    tokens: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    starts: torch.Tensor
    shape: tuple

    @classmethod
    def pack(cls, tokens: torch.Tensor, lengths: torch.Tensor) -> "PackedRow":
        """The packed row of right-padded `tokens` [b, w] whose row i holds lengths[i] tokens."""
        b, w = tokens.shape
        lengths = lengths.to(tokens.device)
        if b and int(lengths.max()) > w:
            raise ValueError(f"a length {int(lengths.max())} exceeds the batch width {w}")
        cols = torch.arange(w, device=tokens.device).expand(b, w)
        real = cols < lengths[:, None]                 # row-major: rollout by rollout
        position_ids = cols[real]
        return cls(tokens=tokens[real][None], position_ids=position_ids[None],
                   index=real.reshape(-1).nonzero()[:, 0], starts=(position_ids == 0)[None],
                   shape=(b, w))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def unpack(self, values: torch.Tensor, zero_starts: bool = False) -> torch.Tensor:
        """[1, N, ...] packed values -> [b, w, ...] padded (0 on padding), differentiable;
        `zero_starts`: each rollout's first position gets 0 (a prediction across rollouts)."""
        if values.shape[:2] != self.tokens.shape:
            raise ValueError(f"packed values {tuple(values.shape)} do not match the packed "
                             f"row {tuple(self.tokens.shape)}")
        flat = values[0]
        if zero_starts:
            keep = ~self.starts[0].reshape((-1,) + (1,) * (flat.ndim - 1))
            flat = torch.where(keep, flat, torch.zeros_like(flat))
        b, w = self.shape
        out = flat.new_zeros((b * w,) + tuple(flat.shape[1:]))
        return out.index_copy(0, self.index, flat).reshape((b, w) + tuple(flat.shape[1:]))


def packed_hidden(body: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """[1, N, H] last hidden state of a Hugging Face transformer body on the packed row:
    position ids given, no attention mask and no KV cache, so attention stays within each
    rollout (module docstring)."""
    return body(input_ids=row.tokens, position_ids=row.position_ids, attention_mask=None,
                use_cache=False).last_hidden_state


def rollout_bounds(position_ids: torch.Tensor) -> Optional[List[int]]:
    """[start of each rollout ..., N] of a packed row's position ids [1, N] (each rollout's
    positions start at 0); None unless it is one row starting at position 0."""
    if position_ids.ndim != 2 or position_ids.shape[0] != 1 or int(position_ids[0, 0]) != 0:
        return None
    starts = (position_ids[0] == 0).nonzero()[:, 0].tolist()
    return starts + [int(position_ids.shape[1])]


def per_rollout_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     dropout: float = 0.0, scaling: Optional[float] = None, **kwargs):
    """A transformers attention function: on a packed row (no mask, one row, position ids
    restarting at 0 per rollout) causal sdpa on each rollout's slice ([1, heads, N, d] ->
    [1, N, heads, d]); any other call is transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    kwargs.pop("is_causal", None)
    bounds = None if attention_mask is not None or position_ids is None or \
        query.shape[0] != 1 else rollout_bounds(position_ids)
    if bounds is None or len(bounds) <= 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                   None, dropout=dropout, scaling=scaling, is_causal=True,
                                   **kwargs)[0] for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1), None


def _mask_unless_unpadded(*args, **kwargs):
    """The mask function of PER_ROLLOUT_SDPA: sdpa's mask for a batch with a padding mask;
    None (no mask: causal, or per rollout) without one."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def _register_per_rollout_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PER_ROLLOUT_SDPA, per_rollout_sdpa)
    AttentionMaskInterface.register(PER_ROLLOUT_SDPA, _mask_unless_unpadded)


def _full_attention_only(config) -> bool:
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return set(layer_types) == {"full_attention"} and \
        not getattr(config, "use_sliding_window", False)


def prepare_packed_attention(body: torch.nn.Module, what: str = "the policy") -> str:
    """Makes `body` (a transformer body) attend within packed rollouts: an sdpa body of
    full-attention layers is switched to PER_ROLLOUT_SDPA (module docstring), others keep their
    implementation; then `check_packed_attention`. Returns the implementation in use."""
    if attention_implementation(body) == "sdpa" and _full_attention_only(body.config):
        _register_per_rollout_sdpa()
        body.set_attn_implementation(PER_ROLLOUT_SDPA)
    check_packed_attention(body, what)
    impl = attention_implementation(body)
    logging.info("micro_batch_layout=packed: %s attends within rollouts with %s", what, impl)
    return impl


def attention_implementation(body: torch.nn.Module) -> str:
    config = getattr(body, "config", None)
    return str(getattr(config, "_attn_implementation", None))


def check_packed_attention(body: torch.nn.Module, what: str = "the policy",
                           atol: float = 1e-3) -> None:
    """Raises ValueError unless `body`'s attention keeps packed rollouts apart: two short
    rollouts run packed give the hidden states they give one by one (float32, no gradient,
    eval mode; the body's training mode is restored)."""
    impl = attention_implementation(body)
    if impl not in PACKED_ATTENTION:
        raise ValueError(f"micro_batch_layout='packed': {what}'s attention implementation "
                         f"{impl!r} is not one transformers packs by position ids "
                         f"{PACKED_ATTENTION}; load the model with one of them or use "
                         "--micro_batch_layout=padded")
    param = next(body.parameters())
    vocab = int(getattr(body.config, "vocab_size", 2))
    lengths = torch.tensor([5, 3], device=param.device)
    tokens = (torch.arange(10, device=param.device).reshape(2, 5) * 7 + 1) % max(vocab, 2)
    row = PackedRow.pack(tokens, lengths)
    was_training = body.training
    body.eval()
    try:
        with torch.no_grad():
            packed = row.unpack(packed_hidden(body, row).float())
            alone = [body(input_ids=tokens[i:i + 1, :int(n)], use_cache=False)
                     .last_hidden_state.float()[0] for i, n in enumerate(lengths.tolist())]
    finally:
        body.train(was_training)
    worst = max(float((packed[i, :a.shape[0]] - a).abs().max()) for i, a in enumerate(alone))
    scale = max(float(a.abs().max()) for a in alone)
    if not worst <= atol * max(scale, 1.0):
        raise ValueError(f"micro_batch_layout='packed': {what}'s attention ({impl!r}) sees "
                         f"across packed rollouts (hidden states differ by {worst:.3g} from "
                         "one-by-one forwards): this transformers version or model does not "
                         "pack by position ids; use --micro_batch_layout=padded")


def maybe_pack(batch, layout: str) -> Optional[PackedRow]:
    """The packed row of a micro-batch under layout `packed`; None under `padded`."""
    if layout == "packed":
        return PackedRow.pack(batch.tokens, batch.lengths)
    if layout != "padded":
        raise ValueError(f"micro_batch_layout={layout!r}: must be one of {LAYOUTS}")
    return None
