"""Previous-token prefetch: the experts the next layer used for the previous token."""

from __future__ import annotations

from collections.abc import Sequence

from moesim.policies.prefetch.base import (
    REGISTRY,
    PrefetchPolicy,
    _keys_of,
    _previous_pass,
)


@REGISTRY.register("previous-token")
class PreviousToken(PrefetchPolicy):
    """Prefetch for the next layer the experts that layer used for the previous token (the
    previous decode pass of the same batch); needs no hidden state."""

    piecewise = True
    reads_previous_pass = True

    def propose(self, pass_index: int, layer: int) -> Sequence[int]:
        prev = _previous_pass(self.ctx, pass_index)
        if prev is None or layer + 1 >= self.ctx.num_layers:
            return ()
        return _keys_of(self.ctx, prev, layer + 1)
