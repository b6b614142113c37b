"""Studies over many replays: sweeps of a scenario grid (parallel, resumable; ``sweep``), a
ranked comparison of policies (``compare``), miss-ratio curves (``mrc``), and the fingerprint
that decides whether a finished replay's results can be reused (``fingerprint``). They build
on the engine (:mod:`moesim.simulator`), which does not import them."""
