"""Hand mutants of the policy hooks (issue 34; not part of the test run): each mutant is one
replacement in one of the kernel's modules (``moesim/simulator/kernel*.py``, whichever holds the
line) or ``moesim/policies/hooks.py``; the file is
changed, a selection of ``tests/test_hooks.py`` runs with ``NUMBA_DISABLE_JIT=1`` (the kernel's
source as plain Python: no recompile per mutant), and the file is restored. mutmut does not
reach compiled code, and a kernel recompile per mutant takes minutes.

Usage: ``python tools/hook_mutants.py [NAME ...]``; prints a line per mutant (killed or
SURVIVED, and pytest's last line). Results of 2026-11-26 are in ``docs/mutation.md``."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
K, H = "moesim/simulator/kernel*.py", "moesim/policies/hooks.py"
FAST = ("(builtin_rows and (none-layer or oracle-per-expert)) or gate_weight or readme_mru or kept_priority or "
        "state_after or (prefetch_hook and not does_not_compile)")
MUTANTS = [
 ("access stamps not", K, "    elif ev == EV_HOOK:\n        _stamp(key, IS, K)\n", "    elif ev == EV_HOOK:\n"),
 ("insert weight 0", K, "w = float(_weight(key, ai, IS, DI, A)) if demand else 0.0", "w = 0.0"),
 ("insert demand always", K, "A[U][U_INSERT][0](key, demand != 0, w,", "A[U][U_INSERT][0](key, True, w,"),
 ("ties newest first", K, "f, s = prios[j], K[key].stamp", "f, s = prios[j], -K[key].stamp"),
 ("remove hook not called", K, "        A[U][U_REMOVE][0](key, A[U][U_CLOCK], A[U][U_SI], A[U][U_SF])\n", "        pass\n"),
 ("kept priority not kept", K, "    if IS[C_STABLE]:\n        K[key].prio", "    if IS[C_STABLE] and False:\n        K[key].prio"),
 ("tick off by one", K, "    clock[CLOCK_TICK] = IS[S_SEQ]\n", "    clock[CLOCK_TICK] = IS[S_SEQ] - 1\n"),
 ("clock layer is pass", K, "    clock[CLOCK_LAYER] = IS[S_LAYER]\n", "    clock[CLOCK_LAYER] = IS[S_PASS]\n"),
 ("weight search dropped", K, "    if ai < 0:  # a speculative run of an expert the layer routes has its access's weight\n", "    if ai < -1:  # mutant\n"),
 ("built-in form not run", K, "        fns = hooks.addresses(form)\n", "        fns = hooks.no_hooks()\n"),
 ("stable ignored", K, "    IS[C_STABLE] = ev == EV_HOOK and hook_form(type(sim.eviction)).stable_priority", "    IS[C_STABLE] = 0"),
 ("simpy ties ignore stamp", H, "key=lambda k: (float(prio(k, clock, si, sf)), stamp[k])", "key=lambda k: float(prio(k, clock, si, sf))"),
 ("simpy tick frozen", H, "            clock[CLOCK_TICK] += 1\n", "            pass\n"),
 ("simpy keep skipped on access", H, "            raise _raised(self, \"access\", exc) from None\n        self._keep(key, clock)\n", "            raise _raised(self, \"access\", exc) from None\n"),
 ("simpy insert weight always", H, "self._weight(key) if demand else 0.0", "self._weight(key)"),
 ("check allows key == n", H, "bad = out[:n][(out[:n] < 0) | (out[:n] >= len(out))]", "bad = out[:n][(out[:n] < 0) | (out[:n] > len(out))]"),
 ("drive allows key == n", H, "            if out[j] < 0 or out[j] >= num_keys:", "            if out[j] < 0 or out[j] > num_keys:"),
 ("drive no growth check", H, "        if used + n > keys.shape[0]:\n            return g, used\n", "        if used + n > keys.shape[0] + 64:\n            return g, used\n"),
 ("view group from off", H, "i64(wl.pass_group), i64(wl.row_order)", "i64(wl.off), i64(wl.row_order)"),
 ("pass index shifted", H, "n = select[0](first + g // num_l, g % num_l, trace, out)", "n = select[0](first + g // num_l, (g + 1) % num_l, trace, out)"),
]
only = sys.argv[1:]
results = []
for name, f, old, new in MUTANTS:
    if only and name not in only:
        continue
    paths = [p for p in sorted(ROOT.glob(f)) if old in p.read_text()]
    assert len(paths) == 1, (name, paths)
    path = paths[0]
    src = path.read_text()
    assert src.count(old) == 1, (name, src.count(old))
    path.write_text(src.replace(old, new))
    try:
        r = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                            "tests/test_hooks.py", "-k", FAST], cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "NUMBA_DISABLE_JIT": "1"})
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
        killed = r.returncode != 0
    finally:
        path.write_text(src)
    results.append((name, "killed" if killed else "SURVIVED", last))
    print(f"{name}: {'killed' if killed else 'SURVIVED'} ({last})", flush=True)
