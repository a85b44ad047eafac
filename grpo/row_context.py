"""The packed row a forward is running, shared by the layers that need it: tree attention sets it
(grpo/tree_attention.py `forward_decoder`), Gated DeltaNet layers read it (grpo/kernels/gdn.py). It lives here, below
both, so neither imports the other.

Row hooks invert the one dependency the other way: code that compiles a layer type whole (grpo/model.py
`compile_model` with `compile_scope=layers_gdn`) registers on the text decoder what must be built per row before the
decoder runs, and `forward_decoder` runs the decoder's hooks without knowing what they build.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo.trie import PackedRow

ACTIVE_ROW: contextvars.ContextVar[PackedRow | None] = contextvars.ContextVar("ACTIVE_ROW", default=None)
"""The PackedRow being forwarded by `forward_hidden` (on the model's device); None outside it."""

_HOOKS_ATTR = "_grpo_row_hooks"


def set_row_hook(decoder, name: str, hook: Callable) -> None:
    """Run `hook(tree_context)` before each packed forward of `decoder` (`name` keys it: setting it again replaces it,
    so compiling twice does not build the tables twice)."""
    hooks = getattr(decoder, _HOOKS_ATTR, None)
    if hooks is None:
        hooks = {}
        setattr(decoder, _HOOKS_ATTR, hooks)
    hooks[name] = hook


def run_row_hooks(decoder, tree_context) -> None:
    """Call `decoder`'s row hooks on the packed forward's context, in the order they were first set."""
    for hook in getattr(decoder, _HOOKS_ATTR, {}).values():
        hook(tree_context)
