"""Fitted routing profiles (``moesim trace fit`` writes them, ``moesim trace synth --fit`` and
``trace: {synth: {fit: ...}}`` read them): read, validate, write, and synthesise a trace.

Kept apart from :mod:`traces.fit`, whose fitting replays traces through the engine, so that
the engine can load a profile without importing the module that imports it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from moesim.errors import MoesimError
from moesim.files import read_yaml
from moesim.traces.schema import ModelInfo
from moesim.traces.synth import RoutingParams, generate
from moesim.traces.trace import Trace

PROFILE_VERSION = 1


def synthesise(profile: dict[str, Any], *, requests: int | None = None, tokens: int | None = None,
               seed: int = 0, prompt_tokens: int = 0, probs: bool = False, pred_next: bool = False,
               pred_noise: float = 1.0) -> Trace:
    """A trace from a fitted profile (shape defaults to the fitted trace's), with a prefill of
    ``prompt_tokens`` per request and the optional columns a preset's trace can have: the full
    router probabilities (``probs``) and a next-layer predictor (``pred_next``, ``pred_noise``)."""
    model = ModelInfo.from_dict(profile["model"], "profile")
    w = profile["weights"]
    shape = profile["shape"]
    return generate(model, requests=requests or shape["requests"], tokens=tokens or shape["tokens"],
                 seed=seed, prompt_tokens=prompt_tokens, probs=probs, pred_next=pred_next, pred_noise=pred_noise,
                 params=RoutingParams(skew=0.0, reuse=w["reuse"], corr=w["corr"]),
                 popularity=np.asarray(profile["popularity"], dtype=np.float64),
                 affinity=_dense_affinity(profile, model), batch_corr=w["batch"],
                 capture={"source": "moesim trace synth --fit", "profile": profile.get("name")})


def _dense_affinity(profile: dict[str, Any], model: ModelInfo) -> np.ndarray:
    aff = np.zeros((model.num_layers, model.num_experts, model.num_experts))
    for layer, rows in profile["affinity"].items():
        aff[int(layer)] = np.asarray(rows, dtype=np.float64)
    return aff


def write_profile(profile: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a fitted routing profile as YAML atomically."""
    from moesim.files import write_yaml_atomic

    return write_yaml_atomic(profile, path)


PROFILES_DIR = Path(__file__).with_name("profiles")


def shipped_profiles() -> list[str]:
    """Names of the fitted profiles shipped with moesim."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> dict[str, Any]:
    """A profile from a path or a shipped name; errors name the file and the fix."""
    p = Path(name_or_path)
    if not p.is_file():
        p = PROFILES_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        raise MoesimError(f"fitted profile '{name_or_path}': no such file or shipped profile "
                          f"(shipped: {', '.join(shipped_profiles()) or 'none'}); make one with "
                          "`moesim trace fit TRACE --out profile.yaml`.")
    data = read_yaml(p, "fitted profile", "")
    if not isinstance(data, dict) or data.get("profile_version") != PROFILE_VERSION:
        raise MoesimError(f"fitted profile {p}: not a version-{PROFILE_VERSION} moesim profile; "
                          "re-create it with `moesim trace fit`.")
    for key in ("model", "shape", "weights", "popularity", "affinity"):
        if key not in data:
            raise MoesimError(f"fitted profile {p}: lacks '{key}'; re-create it with `moesim trace fit`.")
    model = ModelInfo.from_dict(data["model"], f"fitted profile {p}")
    pop = np.asarray(data["popularity"], dtype=np.float64)
    if pop.shape != (model.num_layers, model.num_experts):
        raise MoesimError(f"fitted profile {p}: popularity is {pop.shape}, expected "
                          f"({model.num_layers}, {model.num_experts}).")
    return data
