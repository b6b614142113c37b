"""Write ``moesim/jitplan.json``, the plan of :mod:`moesim.jitplan`, from a compile (
not part of the test run).

Runs the kernel warm-up (:mod:`moesim.studies._kernel_loaded`) in a fresh process with an
empty numba cache and no helper, records each of moesim's compiled functions as numba starts
compiling it, with its argument types, and writes them in that order. Run it after a change to
the compiled code's functions or argument types (``tests/test_jitplan.py`` says when the plan
is stale): ``python tools/jit_plan.py``; ``--check`` compares instead of writing (exit 1 when
they differ)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RECORD = r"""
import json, sys
from numba.core import event
from moesim.jitplan import compiled_function, decode_type, encode_type
seen = []
class Listener(event.Listener):
    def on_start(self, ev):
        d = ev.data["dispatcher"]
        module, name = d.py_func.__module__, d.py_func.__qualname__
        if module.startswith("moesim."):
            seen.append((d, module, name, tuple(ev.data["args"])))
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
import moesim.studies._kernel_loaded  # the warm-up compiles as it is imported
compiles, left = [], []
for d, module, name, args in seen:
    try:
        spec = [encode_type(a) for a in args]
        same = tuple(decode_type(s) for s in spec) == args
    except TypeError as err:
        spec, same = None, False
    if compiled_function(module, name) is d and same:
        compiles.append({"module": module, "function": name, "args": spec})
    else:
        left.append(f"{module}.{name}")
json.dump({"compiles": compiles, "left": left}, sys.stdout)
"""


def record() -> dict:
    """The plan, recorded from a compile in a fresh process (numba's cache in a temporary
    folder), with the functions left out (not reachable by name, or an argument type the plan
    cannot write) under ``left``."""
    import numba

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "MOESIM_NO_JIT_HELPER": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("NUMBA_DISABLE_JIT", None)
        out = subprocess.run([sys.executable, "-c", _RECORD], env=env, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    kinds: list[str] = []  # each argument type once, as JSON text: the compiles name them by number
    compiles = []
    for entry in found["compiles"]:
        numbers = []
        for spec in entry["args"]:
            text = json.dumps(spec, separators=(",", ":"))
            if text not in kinds:
                kinds.append(text)
            numbers.append(kinds.index(text))
        compiles.append({"module": entry["module"], "function": entry["function"], "args": numbers})
    return {"numba": numba.__version__,
            "made_by": "python tools/jit_plan.py (the kernel warm-up, moesim.studies._kernel_loaded, compiled "
                       "with an empty numba cache)",
            "types": [json.loads(k) for k in kinds], "compiles": compiles, "left": found["left"]}


def _text(plan: dict) -> str:
    """The plan as JSON, one type and one compile a line."""
    lines = ["{", f' "numba": {json.dumps(plan["numba"])},', f' "made_by": {json.dumps(plan["made_by"])},',
             f' "left": {json.dumps(plan["left"])},', ' "types": [']
    for key in ("types", "compiles"):
        if key == "compiles":
            lines.append(' "compiles": [')
        items = [json.dumps(x, separators=(",", ":")) for x in plan[key]]
        lines += [f"  {x}," for x in items[:-1]] + [f"  {items[-1]}"]
        lines.append(" ]," if key == "types" else " ]")
    return "\n".join([*lines, "}"]) + "\n"


def main(argv: list[str]) -> int:
    plan = record()
    path = ROOT / "moesim" / "jitplan.json"
    text = _text(plan)
    if "--check" in argv:
        same = path.is_file() and json.loads(path.read_text()) == json.loads(text)
        print("the plan is current" if same else "the plan is stale: run python tools/jit_plan.py")
        return 0 if same else 1
    path.write_text(text)
    print(f"{path}: {len(plan['compiles'])} compiles; left out: {', '.join(plan['left']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
