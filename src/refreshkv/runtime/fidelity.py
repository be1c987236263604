"""How far a method pulls the model away from `full`, measured on `full`'s own answer (teacher forcing).

After `full` decodes greedily, each method is fed `full`'s tokens from its own prefilled cache (from the same shared
prefill: no extra prefill, one forward per answer token), and at every step its next-token distribution is compared
with `full`'s. This measures every method on every example, including those where `full`'s answer scores 0.
"""

from __future__ import annotations

import torch


def fidelity(
    reference_logits: list[torch.Tensor],
    method_logits: list[torch.Tensor],
    tokens: list[int],
    reference_name: str = "full",
) -> dict:
    """Per answer token t of the reference method (named `reference_name`; `tokens`, chosen from `reference_logits[t]`):
    the method's logits at t, fed the reference's tokens before t. Returns the mean KL(reference || method) in nats
    (`kl_to_<reference>`: `kl_to_full` against full), the share of steps whose greedy token is the reference's, and
    the first step where it is not (None: never)."""
    reference = torch.cat(reference_logits).float().log_softmax(-1)  # (steps, vocab)
    method = torch.cat(method_logits).float().log_softmax(-1)
    kl = (reference.exp() * (reference - method)).sum(-1)
    agree = method.argmax(-1) == torch.tensor(tokens, device=method.device)
    disagree = (~agree).nonzero()
    return {
        f"kl_to_{reference_name}": round(float(kl.clamp(min=0).mean()), 6),
        "top1_agreement": round(float(agree.float().mean()), 4),
        "first_divergence": int(disagree[0, 0]) if len(disagree) else None,
    }
