"""Write ``moesim/jitplan.json``, the plan of :mod:`moesim.jitplan`, from compiles (issue 34;
not part of the test run).

For each form of the kernel it plans (:data:`FORMS`: the kernel warm-up of
:mod:`moesim.studies._kernel_loaded`, then ``moesim run quickstart`` with per-expert execution,
a per-token miss policy and both), runs it in a fresh process with an empty numba cache and no
helper, records each of moesim's compiled functions as numba starts compiling it, with its
argument types, and writes them in that order. Run it after a change to the compiled code's
functions or argument types (``tests/test_jitplan.py`` says when the plan is stale):
``python tools/jit_plan.py``; ``--check`` compares instead of writing (exit 1 when they
differ)."""

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
import contextlib
with contextlib.redirect_stdout(sys.stderr):  # stdout carries the record
    try:
        exec(sys.argv[1])  # the form's compiles
    except SystemExit as stop:  # the command line's end
        if stop.code:
            raise
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


# each form: what it is, and the code that compiles it in a fresh process
_RUN = "from moesim.cli import main; sys.argv = ['moesim', 'run', 'quickstart', '--no-write', '-q'{}]; main()"
FORMS = [("the kernel warm-up (moesim.studies._kernel_loaded): layer execution, fetch on a miss",
          "import moesim.studies._kernel_loaded"),
         ("moesim run quickstart --set expert_compute=per-expert",
          _RUN.format(", '--set', 'expert_compute=per-expert'")),
         ("moesim run quickstart --set policies.miss=drop", _RUN.format(", '--set', 'policies.miss=drop'")),
         ("moesim run quickstart --set expert_compute=per-expert --set policies.miss=drop",
          _RUN.format(", '--set', 'expert_compute=per-expert', '--set', 'policies.miss=drop'"))]


def _record_form(code: str) -> dict:
    """One form's compiles, recorded in a fresh process (numba's cache in a temporary folder),
    with the functions left out (not reachable by name, or an argument type the plan cannot
    write) under ``left``."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "MOESIM_NO_JIT_HELPER": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("NUMBA_DISABLE_JIT", None)
        out = subprocess.run([sys.executable, "-c", _RECORD, code], env=env, capture_output=True, text=True,
                             check=True)
    return json.loads(out.stdout)


def record() -> dict:
    """The plan: each form's compiles, their argument types written once (``types``) and named
    by number."""
    import numba

    kinds: list[str] = []  # each argument type once, as JSON text: the compiles name them by number
    forms, left = [], []
    for what, code in FORMS:
        found = _record_form(code)
        compiles = []
        for entry in found["compiles"]:
            numbers = []
            for spec in entry["args"]:
                text = json.dumps(spec, separators=(",", ":"))
                if text not in kinds:
                    kinds.append(text)
                numbers.append(kinds.index(text))
            compiles.append({"module": entry["module"], "function": entry["function"], "args": numbers})
        forms.append({"made_by": what, "compiles": compiles})
        left += [name for name in found["left"] if name not in left]
    return {"numba": numba.__version__, "made_by": "python tools/jit_plan.py (each form compiled with an empty "
            "numba cache)", "left": left, "types": [json.loads(k) for k in kinds], "forms": forms}


def _text(plan: dict) -> str:
    """The plan as JSON, one type and one compile a line."""
    lines = ["{", f' "numba": {json.dumps(plan["numba"])},', f' "made_by": {json.dumps(plan["made_by"])},',
             f' "left": {json.dumps(plan["left"])},', ' "types": [']
    kinds = [json.dumps(x, separators=(",", ":")) for x in plan["types"]]
    lines += [f"  {x}," for x in kinds[:-1]] + [f"  {kinds[-1]}", " ],", ' "forms": [']
    for number, form in enumerate(plan["forms"]):
        lines += ["  {", f'   "made_by": {json.dumps(form["made_by"])},', '   "compiles": [']
        items = [json.dumps(x, separators=(",", ":")) for x in form["compiles"]]
        lines += [f"    {x}," for x in items[:-1]] + [f"    {items[-1]}", "   ]"]
        lines.append("  }," if number < len(plan["forms"]) - 1 else "  }")
    return "\n".join([*lines, " ]", "}"]) + "\n"


def main(argv: list[str]) -> int:
    plan = record()
    path = ROOT / "moesim" / "jitplan.json"
    text = _text(plan)
    if "--check" in argv:
        same = path.is_file() and json.loads(path.read_text()) == json.loads(text)
        print("the plan is current" if same else "the plan is stale: run python tools/jit_plan.py")
        return 0 if same else 1
    path.write_text(text)
    print(f"{path}: {', '.join(str(len(f['compiles'])) for f in plan['forms'])} compiles in its "
          f"{len(plan['forms'])} forms; left out: {', '.join(plan['left']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
