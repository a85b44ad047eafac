"""A fork's token-level advantage whitening over the step, as a batch transform with an option and its hand case:
one file, no edit elsewhere (`GRPO_PLUGIN_MODULES=example_token_transform`). Train with
`... --advantage-batch-transforms token_whiten --transform.token-whiten.no-center`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpo.advantage_kit import TransformCase, register_transform_case
from grpo.advantages import AdvantageBatch, register_batch_transform


@dataclass(frozen=True)
class TokenWhitenOptions:
    """Options of token_whiten."""

    center: bool = True
    """Subtract the token-weighted mean too (False: only divide by the token-weighted std)."""

    @property
    def keeps_zero_advantages(self) -> bool:
        return not self.center  # centring moves a zero advantage


@register_batch_transform("token_whiten", TokenWhitenOptions())
def token_whiten(batch: AdvantageBatch, opts: TokenWhitenOptions) -> np.ndarray:
    """Whiten the advantages over the step's trained tokens (each rollout weighted by its trained tokens)."""
    weights = batch.trained_tokens.astype(np.float64)
    if weights.sum() <= 0:
        return batch.advantages
    mean = (weights * batch.advantages).sum() / weights.sum()
    std = np.sqrt((weights * (batch.advantages - mean) ** 2).sum() / weights.sum())
    centred = batch.advantages - mean if opts.center else batch.advantages
    return centred / (std + 1e-8)


# by hand: advantages (2, -1, 1), trained tokens (1, 2, 1): token mean (2 - 2 + 1) / 4 = 0.25; token variance
# (1.75^2 + 2 * 1.25^2 + 0.75^2) / 4 = (3.0625 + 3.125 + 0.5625) / 4 = 1.6875
register_transform_case("token_whiten", TransformCase(
    advantages=(2.0, -1.0, 1.0), group_ids=(0, 0, 1), trained_tokens=(1, 2, 1),
    want=tuple((a - 0.25) / (1.6875 ** 0.5 + 1e-8) for a in (2.0, -1.0, 1.0))))
