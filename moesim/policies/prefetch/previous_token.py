"""Previous-token prefetch: the experts the next layer used for the previous token."""

from __future__ import annotations

from moesim.policies.prefetch.base import REGISTRY, _Routed


@REGISTRY.register("previous-token")
class PreviousToken(_Routed):
    """Prefetch for the next layer the experts that layer used for the previous token (the
    previous decode pass of the same batch); needs no hidden state."""

    piecewise = True
    reads_previous_pass = True
