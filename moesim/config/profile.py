"""Hardware profiles (``moesim calibrate fit``) as configuration input: reading and checking
one. Here, not in ``moesim.calibration``, because ``hardware.profile`` is read while a scenario
is configured, and configuration must not import the calibration that imports it."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from moesim.errors import MoesimError
from moesim.files import read_yaml

PROFILE_VERSION = 1


def load_profile(path: str, where: str) -> dict[str, Any]:
    """A profile YAML, checked: version, links with positive bandwidth and non-negative latency,
    monotone token tables with positive times. Errors name the file, key and fix."""
    p = Path(path)
    data = read_yaml(p, f"{where}: hardware profile", "Make one with `moesim calibrate fit`.")
    if not isinstance(data, dict) or data.get("profile_version") != PROFILE_VERSION:
        raise MoesimError(f"{where}: hardware profile {p}: not a version-{PROFILE_VERSION} profile (key "
                          "'profile_version'); re-create it with `moesim calibrate fit`.")
    links = data.get("links")
    if not isinstance(links, dict) or ("h2d_pageable" not in links and "h2d_pinned" not in links):
        raise MoesimError(f"{where}: hardware profile {p}: key 'links' needs h2d_pinned or h2d_pageable.")
    for name, link in links.items():
        bw, lat = (link or {}).get("bandwidth_gbps"), (link or {}).get("latency_us")
        if not isinstance(bw, int | float) or not bw > 0 or not isinstance(lat, int | float) or lat < 0:
            raise MoesimError(f"{where}: hardware profile {p}: key 'links.{name}' needs bandwidth_gbps > 0 and "
                              f"latency_us >= 0 (got {bw!r}, {lat!r}).")
    for shape, by_dtype in (data.get("expert_time") or {}).items():
        for dt, tab in by_dtype.items():
            toks, secs = tab.get("tokens"), tab.get("seconds")
            if (not isinstance(toks, list) or not isinstance(secs, list) or len(toks) != len(secs) or not toks
                    or any(b <= a for a, b in itertools.pairwise(toks)) or any(not s > 0 for s in secs)):
                raise MoesimError(f"{where}: hardware profile {p}: key 'expert_time.{shape}.{dt}' needs increasing "
                                  "tokens and positive seconds of the same length.")
    return data
