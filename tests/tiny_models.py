"""The tiny random-weight models the capture tests run (:mod:`moesim.traces.tiny_model`)."""

from moesim.traces.tiny_model import VOCAB, build, configs

__all__ = ["VOCAB", "build", "configs"]
