"""Mutation testing of one module at a time with mutmut (not part of the test run).

Usage: ``python tools/mutation.py simulator/cache.py [policies/eviction.py ...]``, or
``python tools/mutation.py --reclassify`` after adding a survivor to ``EQUIVALENT``;
``MUTATE_ONLY="xǁLeastStaleǁ*,x_helper*"`` mutates only those functions (mutmut name patterns),
recorded as a row of its own; ``MUTATE_TESTS="tests/a.py,tests/b.py"`` runs those tests instead of
the module's list below.

For each module it runs ``mutmut run "<module>.*"`` (configured in pyproject's
``[tool.mutmut]``; mutmut runs, for each mutant, the tests that reach the mutated function,
from the default test run: the slow notebooks are not among them), reads mutmut's results for
the module and merges them into ``benchmarks/results/mutation.json``: killed, survived, timed
out, not reached by any test, the kill rate over the non-equivalent mutants, and the names of
the survivors. Survivors judged equivalent (no test can tell them apart: the behaviour is
the same) are listed in ``EQUIVALENT`` below, each with its reason; ``mutmut show NAME`` shows
a mutant. ``MOESIM_SHARED`` is set to ``../shared`` so the real-trace tests run in mutmut's
copy of the tree.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mutation.json"
KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # test failure, pytest error, timeout, type check
SURVIVED = {0}
NO_TESTS = {5, 33}

# the tests that check each module (mutmut runs, per mutant, those of them that reach it)
TESTS: dict[str, list[str]] = {
    "moesim/simulator/cache.py": ["tests/test_cache.py", "tests/test_policies.py", "tests/test_metrics.py",
                           "tests/test_fidelity.py", "tests/test_eviction.py", "tests/test_prefetch.py",
                           "tests/test_kernel.py"],
    "moesim/simulator/copyengine.py": ["tests/test_copyengine.py", "tests/test_metrics.py", "tests/test_prefetch.py",
                                       "tests/test_engine.py", "tests/test_events.py", "tests/test_kernel.py"],
    "moesim/simulator/lookup.py": ["tests/test_fidelity.py", "tests/test_miss_routing.py", "tests/test_engine.py",
                                   "tests/test_kernel.py", "tests/test_budget_hand.py", "tests/test_expert_parallel.py",
                                   "tests/test_speculative.py", "tests/test_prefetch_queue.py"],
    "moesim/simulator/prefetchq.py": ["tests/test_prefetch.py", "tests/test_prefetch_queue.py", "tests/test_fidelity.py",
                                      "tests/test_events.py", "tests/test_calibrate.py",
                                      "tests/test_engine.py", "tests/test_kernel.py"],
    "moesim/simulator/workload.py": ["tests/test_engine.py", "tests/test_workload_arrays.py", "tests/test_kernel.py",
                                     "tests/test_speculative.py", "tests/test_fidelity.py"],
    "moesim/simulator/metrics.py": ["tests/test_metrics.py", "tests/test_summary.py", "tests/test_engine.py",
                             "tests/test_speculative.py", "tests/test_expert_parallel.py"],
    "moesim/policies/eviction/": ["tests/test_eviction_orders.py", "tests/test_eviction.py", "tests/test_fidelity.py",
                                    "tests/test_policies.py", "tests/test_kernel.py", "tests/test_sieve_s3fifo_arc.py"],
    "moesim/policies/prefetch/": ["tests/test_proposals.py", "tests/test_prefetch.py", "tests/test_summary.py",
                                    "tests/test_kernel.py"],
    "moesim/simulator/engine.py": ["tests/test_summary.py", "tests/test_engine.py", "tests/test_fidelity.py", "tests/test_miss_routing.py",
                                   "tests/test_prefetch_queue.py", "tests/test_expert_parallel.py", "tests/test_events.py",
                                   "tests/test_speculative.py", "tests/test_kernel.py", "tests/test_prefetch.py",
                                   "tests/test_metrics.py"],
    # the SimPy process's collaborators (moved out of engine.py)
    "moesim/simulator/expert_compute.py": ["tests/test_engine.py", "tests/test_host.py", "tests/test_fidelity.py",
                                           "tests/test_prefetch_queue.py", "tests/test_kernel.py",
                                           "tests/test_hf_loop.py"],
    "moesim/simulator/host.py": ["tests/test_host.py", "tests/test_hf_loop.py", "tests/test_engine.py"],
    "moesim/simulator/parallel.py": ["tests/test_expert_parallel.py", "tests/test_ep_offload.py", "tests/test_budget_hand.py",
                                     "tests/test_events.py",
                                     "tests/test_serving.py"],
    "moesim/simulator/source.py": ["tests/test_stream.py", "tests/test_serving.py"],
    "moesim/simulator/served_future.py": ["tests/test_serving.py"],
    "moesim/simulator/blocks.py": ["tests/test_summary.py", "tests/test_stream.py", "tests/test_engine.py",
                                   "tests/test_metrics.py"],
    "moesim/simulator/recording.py": ["tests/test_events.py", "tests/test_serving.py"],
    "moesim/calibration/calibrate.py": ["tests/test_calibrate.py", "tests/test_h100_calibration.py"],
    "moesim/policies/budget/": ["tests/test_budget.py", "tests/test_budget_hand.py", "tests/test_budget_exact.py",
                           "tests/test_expert_parallel.py"],
    "moesim/studies/fingerprint.py": ["tests/test_reuse.py"],
    "moesim/output/console.py": ["tests/test_first_steps.py"],
    "moesim/config/reference.py": ["tests/test_reference.py"],
    "moesim/simulator/stream.py": ["tests/test_stream.py"],
    "moesim/jitplan.py": ["tests/test_jitplan.py", "tests/test_workers_server.py"],
    # the reuse path by hand first (tests/test_sweep_reuse_hand.py), then real sweeps
    "moesim/studies/sweep.py": ["tests/test_sweep_reuse_hand.py", "tests/test_sweep.py", "tests/test_workers_server.py", "tests/test_compare.py",
                                "tests/test_reuse.py"],
    # the capacity bisection by hand and its reuse; the slow end-to-end checks are run on the survivors
    "moesim/studies/load.py": ["tests/test_load_tables.py", "tests/test_load_bisection.py", "tests/test_load_compare.py",
                               "tests/test_reuse.py"],
    "moesim/studies/compare.py": ["tests/test_compare.py", "tests/test_reuse.py", "tests/test_first_steps.py"],
    # the quick serving checks per mutant; tests/test_serving_studies.py (M/D/1 over 10,000 requests, compare's
    # bisection) is run on the survivors
    "moesim/simulator/serving.py": ["tests/test_serving.py"],
    "moesim/traces/io.py": ["tests/test_stream.py", "tests/test_traces.py", "tests/test_bad_input.py"],
    # NF4, the throttled link and the router output (the executor's CUDA paths need a GPU)
    "moesim/calibration/hf_loop.py": ["tests/test_hf_loop.py"],
    # the validation protocol's labels by hand, then calibrate validate's rows on the CPU
    "moesim/calibration/protocol.py": ["tests/test_calibrate.py"],
    "moesim/config/execution.py": ["tests/test_host.py"],
    # the validation executor's decisions, buffers and main-thread prefetch queue (its CUDA paths need a GPU)
    "moesim/calibration/executor.py": ["tests/test_calibrate.py"],
}


def tests_of(module: str) -> list[str]:
    """The tests of ``module``: its own entry, or its package's (a key ending in /)."""
    if module in TESTS:
        return TESTS[module]
    return next((t for k, t in TESTS.items() if k.endswith("/") and module.startswith(k)), ["tests"])


# the functions mutated in a module where not all of them are (mutmut name patterns): calibrate.py's
# measure() and timers run for minutes per mutant on the CPU and their CUDA paths need a GPU, so
# its run covers the fit, which turns measurements into the profile every calibrated replay uses
FUNCTIONS: dict[str, list[str]] = {
    "moesim/calibration/calibrate.py": ["x_fit*", "x__check_raw*"],
    "moesim/calibration/hf_loop.py": ["x_nf4*", "xǁLinkǁ*", "xǁHfLoopPoolǁtop_k_index*"],
    # the main thread's prefetch queue; perform and _copy give 466 mutants, many of them
    # endless loops that each run to mutmut's timeout (about 40 s), hours on this machine
    "moesim/calibration/executor.py": ["xǁDevicePoolǁ_issue*", "xǁDevicePoolǁ_pump*", "xǁDevicePoolǁ_upto*",
                                       "xǁDevicePoolǁ_landed*", "xǁDevicePoolǁ_mark*"],
}

# mutant name -> why no test can tell it from the original
EQUIVALENT: dict[str, str] = {
    # routing hooks (moesim/policies/routing/hooked.py, with tests/test_routing_hooks.py)
    **dict.fromkeys((f"moesim.policies.routing.hooked.xǁHookRoutingǁ__init____mutmut_{n}" for n in (19, 21)),
                    "numpy's zeros are float64 unless told otherwise"),
    **dict.fromkeys((f"moesim.policies.routing.hooked.xǁHookRoutingǁroute__mutmut_{n}" for n in (24, 26)),
                    "the router's experts reach route as int64 already (simulator.lookup.plan)"),
    "moesim.policies.routing.cache_aware.xǁCacheAwareǁ_logits__mutmut_4":
        "the logits are taken again at every call: the same numbers, more slowly",
    "moesim.policies.routing.cache_aware.xǁCacheAwareǁroute__mutmut_33": "argsort's default axis is the last, 1 here",
    "moesim.policies.routing.cache_aware.xǁCacheAwareǁroute__mutmut_38":
        "numpy reads a sort's kind by its first letter, in either case",
    # miss hooks (moesim/policies/miss/hooked.py, with tests/test_miss_hooks.py)
    **dict.fromkeys((f"moesim.policies.miss.hooked.xǁHookMissǁ__init____mutmut_{n}" for n in (19, 21)),
                    "numpy's zeros are float64 unless told otherwise"),
    # Belady's future under load (simulator/served_future.py, with tests/test_serving.py)
    # (keep_rows=True is mutant 20 in the whole-module row, made before settle replayed with
    # type(sim); 21 since)
    **dict.fromkeys((f"moesim.simulator.served_future.x_settle__mutmut_{n}" for n in (16, 19, 20, 21)),
                    "the runs that find the future keep their per-pass rows or not: only their schedules are read"),
    **dict.fromkeys((f"moesim.simulator.served_future.xǁPassǁ__init____mutmut_{n}" for n in (18, 20, 46, 57)),
                    "a float array of whole numbers makes the same codes and keys (exact below 2**53)"),
    "moesim.simulator.served_future.xǁPassǁ__init____mutmut_42":
        "256 or more times processed before (a request preempted 256 times) is what the cap is for; below it the same",
    "moesim.simulator.served_future.xǁPassǁ__init____mutmut_49": "numpy reads any negative reshape size as -1",
    **dict.fromkeys((f"moesim.simulator.served_future.xǁPassǁ__init____mutmut_{n}" for n in (63, 65, 67)),
                    "a pass's accesses are distinct keys: every sort orders them alike (numpy reads the kind's case freely)"),
    **dict.fromkeys((f"moesim.simulator.served_future.xǁReferenceǁ__init____mutmut_{n}" for n in (76, 78, 80)),
                    "a schedule's token codes are distinct: every sort orders them alike"),
    **dict.fromkeys((f"moesim.simulator.served_future.xǁReferenceǁ__init____mutmut_{n}"
                     for n in (15, 17, 24, 26, 35, 37, 49, 51)),
                    "an empty schedule's arrays hold nothing a reader reads (an extra token no pair names, a float "
                    "type for no values); a float pass end of a whole number is the same in int()"),
    **dict.fromkeys((f"moesim.simulator.served_future.xǁReferenceǁ__init____mutmut_{n}" for n in (61, 64, 65)),
                    "the position past each key's last pair is read only where Reader.after masks it out"),
    **dict.fromkeys((f"moesim.simulator.served_future.xǁReferenceǁsame__mutmut_{n}" for n in (7, 10, 11)),
                    "the lengths are compared first: zip's strictness never acts"),
    # the routed prefetchers' proposals (MUTATE_ONLY over _Routed, with tests/test_proposals.py,
    # tests/test_kernel.py and tests/test_serving.py)
    **dict.fromkeys(("moesim.policies.prefetch.base.xǁ_Routedǁ_proposals_of__mutmut_31",
                     "moesim.policies.prefetch.base.xǁ_Routedǁ_proposals_of__mutmut_33"),
                    "a workload's access offsets are int64 already: ascontiguousarray without the dtype returns the same array"),
    # compare --rate's glue (MUTATE_ONLY x_compare_load*, with tests/test_load_compare.py)
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "a failed row always carries its error (pooled copies it from the point's error.json): the "
       "default is never read" for n in (184, 186, 190)},
    **dict.fromkeys(("moesim.studies.load.x_compare_load__mutmut_103", "moesim.studies.load.x_compare_load__mutmut_104"), "without an slo the text of the SLO is read by no table: the capacity "
                    "table and the recommendation are not written"),
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "groupby's sort=None is falsy, and the capacities listed are grouped in that order"
       for n in (204, 206)},
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "a NaN baseline capacity divides to NaN, the else branch's value; no capacity is 0"
       for n in (224, 228, 229, 232)},
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "the sort on (capacity, label) has no ties: labels are unique per cache capacity, so every "
       "sort kind gives one order" for n in (238, 241, 242, 256, 257)},
    "moesim.studies.load.x_compare_load__mutmut_276": "pd.NA and None are both written as a null rank",
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "the concatenated index is read by nothing: the tables are read by column and record, and "
       "written without their index" for n in (284, 286, 287)},
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "to_parquet's index=None writes a RangeIndex as metadata only, as index=False does its "
       "absence: the file's columns are the same" for n in (301, 303, 324, 326)},
    **{"moesim.studies.load.x_compare_load__mutmut_" + str(n): "this scenario_from_dict reads the slo of a scenario every point of which plan_load has "
       "built already: where and base_dir only name and resolve files in errors that cannot happen here"
       for n in (48, 49, 51, 52, 57, 58)},
    # compare --rate's seeds, pooled rows, capacity interval and tables (MUTATE_ONLY over them, with
    # tests/test_load_tables.py and tests/test_load_bisection.py)
    **dict.fromkeys(("moesim.studies.load.x_bisect_capacity__mutmut_10", "moesim.studies.load.x_markdown_load__mutmut_127",
                     "moesim.studies.load.x_markdown_load__mutmut_14", "moesim.studies.load.x_terminal_load__mutmut_178",
                     "moesim.studies.load.x_terminal_load__mutmut_30"), "pandas reads to_dict's orient case-insensitively"),
    **{"moesim.studies.load.x_markdown_load__mutmut_" + str(n): "'F' differs from 'f' only in how inf and nan are written: _num "
       "writes NaN as an empty cell, and no latency, rate or ratio here is infinite" for n in (55, 167, 178, 189, 200, 211, 241)},
    **{"moesim.studies.load.x_terminal_load__mutmut_" + str(n): "'F' differs from 'f' only in how inf and nan are written: _num "
       "writes NaN as an empty cell, and no latency or ratio here is infinite" for n in (71, 217, 228, 239)},
    **{"moesim.studies.load.x_plan_load__mutmut_" + str(n): "zip's strict flag: one key per combination by construction"
       for n in (158, 161, 162)},
    **{"moesim.studies.load.x_seed_capacities__mutmut_" + str(n): "zip's strict flag: one list of attainments per rate by construction"
       for n in (16, 19, 20)},
    **{"moesim.studies.load.x_plan_load__mutmut_" + str(n): "the items sort by their keys, which are unique: the same order with or "
       "without a key function" for n in (69, 71)},
    **{"moesim.studies.load.x_pooled__mutmut_" + str(n): "the summary reads the pooled requests' columns as arrays, never their index"
       for n in (54, 56, 57)},
    "moesim.studies.load.x_bisect_capacity__mutmut_60": "a rate run once either meets the SLO or not: no failing rate equals the highest "
        "meeting one",
    "moesim.studies.load.x_terminal_load__mutmut_78": "groupby's sort=None is falsy: the capacities in the order listed, as sort=False",
    "moesim.studies.load.x_terminal_load__mutmut_253": "a fixed sentence whose first line is 79 characters and whose next word is 4: "
        "it wraps alike at 80 and 81 columns",
    # the sweep's reuse path (MUTATE_ONLY over it, with tests/test_sweep_reuse_hand.py)
    **{"moesim.studies.sweep.x_file_digest__mutmut_" + str(n):
       "the size of each read changes how the file is read, not the digest of its bytes" for n in (5, 7, 8)},
    **{"moesim.studies.sweep.x_other_points__mutmut_" + str(n):
       "a values entry that is not a mapping (None included) is read as {} on the next line" for n in (9, 11, 22)},
    "moesim.studies.sweep.x_run_points__mutmut_73":
        "sys.version_info > (3, 11) for >= (3, 11): a version tuple is longer than (3, 11), so never equal to it",
    "moesim.studies.sweep.x_run_points__mutmut_111": "shutdown's wait is True by default",
    # a first compile on two cores : the helper's lock file's name
    **{'moesim.jitplan.x__lock_path__mutmut_' + str(n): "another fixed text for an unset NUMBA_CACHE_DIR: the "
       "name stays one per moesim and cache folder" for n in (4, 6, 9)},
    'moesim.jitplan.x__lock_path__mutmut_13': "17 hexadecimal digits of the digest in the name, not 16: still one "
                                              "name per moesim and cache folder",
    'moesim.jitplan.x_load_plan__mutmut_6': "every warning ignored while the plan's types are made, not only "
                                            "numba's experimental-feature one: none other is raised there",
    # compare --rate's arrival-file rate
    "moesim.studies.load.x_file_rate__mutmut_12": "Path(base) / p is p when p is absolute: the same path either way",
    # the SpecMD-style executor's router output
    'moesim.calibration.hf_loop.xǁHfLoopPoolǁtop_k_index__mutmut_19':
        "more padding than n * k choices: only the first n * k are read",
    # serving under load (MUTATE_ONLY over the scheduler, the bank and the summary)
    'moesim.simulator.serving.xǁSchedulerǁ_chunked__mutmut_16':
        "a prompt chunk of 0 tokens when the decodes took the whole budget: it adds no token, makes no output "
        "and changes no count (its request is in the pass with nothing to compute)",
    **{'moesim.simulator.serving.x_summary__mutmut_' + str(n): "the request table's latency columns are float64 "
       "(NaN for a missing TPOT), so to_numpy(None) returns the same array" for n in (2, 13)},
    'moesim.simulator.serving.x_summary__mutmut_121':
        "n >= 1 for n > 1: with one request the arrivals' span is 0, which the second condition already refuses",
    'moesim.simulator.serving.x_summary__mutmut_135':
        "ok = ... for ok &= ...: ok is all true before the first limit is applied",
    'moesim.simulator.serving.xǁSchedulerǁframe__mutmut_14':
        "a TPOT for one output token too: (finish - first token) / 0 is 0 / 0, NaN as the mask gives",
    **{'moesim.simulator.serving.xǁSchedulerǁframe__mutmut_' + str(n): "np.arange of a Python int is int64 already"
       for n in (24, 26)},
    'moesim.simulator.serving.xǁSchedulerǁframe__mutmut_3': "astype(None) is astype(float64)",
    **{'moesim.simulator.serving.x_read_arrival_file__mutmut_' + str(n): "to_numpy(None) of a numeric column gives "
       "int64 or float64, which the checks and the division treat alike" for n in (56, 92, 98)},
    'moesim.simulator.serving.x_read_arrival_file__mutmut_86':
        "np.where(None, ...) takes the seconds everywhere, and an unparsed date-time's seconds are NaN already",
    'moesim.simulator.serving.x_read_arrival_file__mutmut_87':
        "None for NaN where a date-time is unparsed: to_numeric reads None as NaN, so the same row is refused",
    # the chunked trace reader (MUTATE_ONLY iter_trace, requests_in_order, trace_rows, _open, _repeats,
    # _phase_codes with tests/test_stream.py, test_traces.py, test_bad_input.py)
    **{'moesim.traces.io.x__open__mutmut_' + str(n): "read_dictionary changes memory only: _phase_codes "
       "dictionary-encodes a column of strings itself" for n in (13, 15)},
    **{'moesim.traces.io.x__open__mutmut_' + str(n): "unreachable: read_metadata has read the same footer "
       "without error just before" for n in (18, 19, 20, 21)},
    **{'moesim.traces.io.x__phase_codes__mutmut_' + str(n): "any negative code marks a value that is not a phase "
       "(the check is phase < 0)" for n in (30, 32)},
    **dict.fromkeys(('moesim.traces.io.x__phase_codes__mutmut_34', 'moesim.traces.io.x__phase_codes__mutmut_36', 'moesim.traces.io.x_iter_trace__mutmut_20', 'moesim.traces.io.x_iter_trace__mutmut_64', 'moesim.traces.io.x_requests_in_order__mutmut_12'), "an integer column without nulls converts without a copy whatever zero_copy_only says, and None is as " "falsy as False"),
    **{'moesim.traces.io.x__repeats__mutmut_' + str(n): "both branches are exact at every k (the sort above 16 "
       "columns is for speed), and np.sort's default axis is the last" for n in (3, 4, 9)},
    'moesim.traces.io.x_iter_trace__mutmut_97': "cut's `final` None is as falsy as False",
    **{'moesim.traces.io.x_requests_in_order__mutmut_' + str(n): "the same answer from more columns or other "
       "batch sizes (speed only)" for n in (5, 6, 7)},
    # Least-Stale's prefetch victims (a MUTATE_ONLY run of xǁLeastStaleǁ*)
    'moesim.policies.eviction.xǁLeastStaleǁprefetch_candidates__mutmut_10':
        "_queue's upcoming flag None for False: both falsy, read only by `if upcoming`",
    # the summary from the per-pass totals (MUTATE_ONLY xǁPassTotalsǁ*, x_summarise*)
    **{'moesim.simulator.metrics.x_summarise__mutmut_' + str(n): "unreachable: a replay has a pass, an expert "
       "access, a token and gate mass, and with timing its last pass ends after 0" for n in (129, 151, 159, 32)},
    'moesim.simulator.metrics.x_summarise__mutmut_235':
        "dec_gen >= 0 for > 0: a decode or verify pass generates a token at least, so dec_gen > 0 already",
    **{'moesim.simulator.metrics.x_summarise__mutmut_' + str(n): "dividing by 1,000,000,001 for 1e9 changes "
       "the warning's GB by a billionth, below the digit it prints" for n in (276, 278)},
    'moesim.simulator.metrics.xǁPassTotalsǁadd__mutmut_72':
        "to_numpy(None) of a float64 column is float64, as to_numpy(np.float64)",
    # static pinning counted over the whole trace (MUTATE_ONLY xǁStaticPinǁ*)
    **{'moesim.policies.prefetch.xǁStaticPinǁ__init____mutmut_' + str(n): "the counts as float64 zeros: "
       "bincount's whole numbers add exactly (far below 2**53) and sort the same" for n in (17, 19)},
    'moesim.policies.prefetch.xǁStaticPinǁ__init____mutmut_61': "argsort kind 'STABLE': numpy reads the kind "
        "without regard to case",
    # the digest of a source tree, numba's cache keys' and the code fingerprint's (MUTATE_ONLY x_tree_digest*,
    # tests/test_jit.py)
    **{'moesim.files.x_tree_digest__mutmut_' + str(n): "another fixed separator after each file's name "
       "or contents: the digest still changes exactly when a name or a content does" for n in (15, 18)},
    # the exact sum (MUTATE_ONLY xǁExactSumǁ*, with tests/test_summary.py)
    **{'moesim.simulator.metrics.xǁExactSumǁadd__mutmut_' + str(n): "asarray without dtype float64: PassTotals "
       "hands it float64, and an int or float32 array's values are added exactly either way (frexp widens "
       "them)" for n in (3, 5)},
    # the engine
    # the host thread (a MUTATE_ONLY run of _host*, _compute, _fused, _end_pass with
    # tests/test_host.py and tests/test_engine.py). The judgements of _run and __init__ were
    # dropped: the host thread changed both, so their old mutant numbers no longer name the mutants judged
    **{'moesim.simulator.engine.xǁSimulationǁ_compute__mutmut_' + str(n):
       "a comparison on equality that then sets a value to the value it has (ready, t or the host's clock)"
       for n in (9, 19, 31, 41)},
    'moesim.simulator.engine.xǁSimulationǁ_compute__mutmut_35': "a >= t adds a stall of zero and sets t to the value it has",
    'moesim.simulator.engine.xǁSimulationǁ_end_pass__mutmut_2': "the host's clock set to the value it has when equal",
    **{'moesim.simulator.engine.xǁSimulationǁ_host_issue__mutmut_' + str(n): "the host's clock set to the value it has when equal"
       for n in (4, 11)},
    'moesim.simulator.engine.xǁSimulationǁ_host_ready__mutmut_7': "h = t when the host's clock equals t: the same value",
    # _per_expert with the host (MUTATE_ONLY _per_expert* with the host, engine, kernel and fidelity tests)
    **{'moesim.simulator.engine.xǁSimulationǁ_per_expert__mutmut_' + str(n):
       "_host_issue reads its runs only for a blocking fetch, and None is as falsy as False" for n in (127, 129)},
    **{'moesim.simulator.engine.xǁSimulationǁ_per_expert__mutmut_' + str(n):
       "`looked` is set to 1 before it is read whenever the layer has an expert (none: the loop never runs)"
       for n in (14, 15)},
    **{'moesim.simulator.engine.xǁSimulationǁ_per_expert__mutmut_' + str(n): "`launched` None is as falsy as False"
       for n in (30, 44)},
    **{'moesim.simulator.engine.xǁSimulationǁ_per_expert__mutmut_' + str(n):
       "`issued` is set by the first expert's launch before it is read, and never read without a host" for n in (32, 33)},
    **{'moesim.simulator.engine.xǁSimulationǁ_per_expert__mutmut_' + str(n):
       "a comparison on equality that then sets t to the value it has" for n in (51, 57)},
    'moesim.simulator.engine.xǁSimulationǁ_init_replay_state__mutmut_1': "_begin_pass makes each pass's row before anything reads it",
    'moesim.simulator.engine.xǁSimulationǁ_ep_layer__mutmut_43':
        "an idle GPU's expert time over no experts sums to 0.0, the value of the else branch",
    'moesim.simulator.engine.xǁSimulationǁ_ep_layer__mutmut_65':
        "the traffic is a whole number of 2H-byte hidden states, never in (0, 1]",
    'moesim.simulator.engine.xǁSimulationǁ_steps_frame__mutmut_13': "numpy reads any negative size as the inferred one",
    **{'moesim.simulator.engine.xǁSimulationǁ_steps_frame__mutmut_' + str(n): "np.arange of a Python int is int64 already" for n in (20, 22)},
    'moesim.simulator.engine.xǁSimulationǁffn_table__mutmut_1':
        "every access has at least one token, so the table reaches 1 token with at_least 0 or 1",
    'moesim.simulator.engine.xǁSimulationǁrun__mutmut_41':
        "with timing on, a replay of a trace (never empty) has a positive autoregressive tokens_per_s",
    # the workload's distinct experts per (pass, layer)
    'moesim.simulator.workload.x__accesses__mutmut_7': "reshape's -2 is read as the unknown dimension, like -1",
    'moesim.simulator.workload.x__accesses__mutmut_14': "reshape's -2 is read as the unknown dimension, like -1",
    'moesim.simulator.workload.x__accesses__mutmut_59': "np.empty's default dtype is float64",
    'moesim.simulator.workload.x__accesses__mutmut_61': "np.empty's default dtype is float64",
    # prefetch proposals as arrays (the compiled kernel's)
    'moesim.policies.prefetch.xǁScorePercentileǁproposals__mutmut_6':
        "per-(pass, layer) counts as float64 instead of int64: small integers, held exactly, and cumsum writes them into the int64 offsets",
    'moesim.policies.prefetch.xǁScorePercentileǁproposals__mutmut_8':
        "per-(pass, layer) counts as float64 instead of int64: small integers, held exactly, and cumsum writes them into the int64 offsets",
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_16':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_18':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_19':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_20':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_22':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_24':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_25':
        'the initial arrays are never read: the planned range starts empty, so the first proposal plans before reading them',
    'moesim.policies.prefetch.xǁScorePercentileǁproposals__mutmut_48':
        "reduceat's default axis is 0",
    'moesim.policies.prefetch.xǁScorePercentileǁproposals__mutmut_53':
        "scores multiplied instead of divided by the (pass, layer)'s token count: one positive factor per row keeps the scores' order and the percentile threshold's place among them",
    'moesim.policies.prefetch.xǁScorePercentileǁproposals__mutmut_85':
        "argsort's default axis is the last, here 1",
    'moesim.policies.prefetch.xǁScorePercentileǁproposals__mutmut_90':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.prefetch.xǁPrefetchPolicyǁproposals__mutmut_29':
        "fromiter's count only preallocates: without it the same keys come out",
    "moesim.simulator.cache.xǁExpertCacheǁfetch__mutmut_48":
        "`used >= max_used` for `used > max_used`: when equal it assigns the value max_used already has",
    "moesim.simulator.cache.xǁExpertCacheǁpreload__mutmut_13":
        "on_insert(key, None) for on_insert(key, False): every policy only tests `if demand`, and None is false",
    "moesim.simulator.cache.xǁExpertCacheǁpreload__mutmut_16":
        "on_insert(key, True) for a preloaded key: a statically pinned key is never a victim, and no policy "
        "orders the other keys by a static key's count or recency",
    # the one lookup path
    "moesim.simulator.lookup.x_arrival__mutmut_5":
        "`tr[DONE] <= now` for `<`: when equal it returns tr[DONE], which is now",
    "moesim.simulator.lookup.xǁLayerLookupǁ__init____mutmut_5":
        "plain = None sends every layer down the per-token path, which replays as the plain one when no policy changes routing (same keys in router order, the same expert times from the cost model, unique experts counted per token; the plain fetch policy offers no alternative)",
    "moesim.simulator.lookup.xǁLayerLookupǁ__init____mutmut_13":
        "instant = None: in cache-only replay a fetch then hands on its instant transfer record, which landed at its issue time: the layer's compute and arrival() give now either way",
    **{"moesim.simulator.lookup.xǁLayerLookupǁ__init____mutmut_" + str(n): "plan() sets it before any lookup reads it" for n in (19, 20, 21, 22, 23, 24)},
    **{"moesim.simulator.lookup.xǁLayerLookupǁ__init____mutmut_" + str(n): "read only on the per-token path, whose plan() sets it first" for n in (25, 26)},
    "moesim.simulator.lookup.xǁLayerLookupǁlookup__mutmut_29":
        "`or` for `and`: promote() of a demand or started transfer changes nothing (promote_many moves only queued prefetches)",
    **dict.fromkeys(("moesim.simulator.lookup.xǁLayerLookupǁlookup__mutmut_125",
                     "moesim.simulator.lookup.xǁLayerLookupǁ_uncached__mutmut_33"),
                    "in cache-only replay the transfer record is instant, landed at its issue time: the layer's "
                    "compute and arrival() give now either way"),
    "moesim.simulator.lookup.xǁLayerLookupǁplan__mutmut_42":
        "`r <= ent[0]` for `<`: when equal it assigns the rank the entry has",
    "moesim.simulator.lookup.x_plan__mutmut_21":
        "the budget policy that does not restrict (none) selects each token's routed experts unchanged, as routed.tolist()",
    "moesim.simulator.lookup.x_token_mass__mutmut_5":
        "astype(None) is astype(float64)",
    "moesim.simulator.lookup.x_token_mass__mutmut_23":
        "a sum over no experts is 0.0, the else branch's value",
    "moesim.simulator.lookup.x__predicted__mutmut_30":
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    # prefetch queue
    "moesim.simulator.prefetchq.xǁPrefetchQueueǁadmit__mutmut_4":
        "instant = None: in cache-only replay the admitted copies are then also listed as pending; they have "
        "started (an instant copy starts when submitted), so the withdrawal that reads the list cancels none of them",
    "moesim.simulator.prefetchq.xǁPrefetchQueueǁadmit__mutmut_15":
        "cache.fetch(..., demand=None) for demand=False: the cache and every policy only test `if demand` "
        "or `not demand`, and None is false",
    "moesim.simulator.prefetchq.xǁPrefetchQueueǁwithdraw__mutmut_2":
        "`waiting or any(...)` for `waiting and any(...)`: with nothing waiting any() is false; with proposals "
        "waiting but none for this layer or earlier, the queue is rebuilt from all of them in order, unchanged",
    # copy engine
    "moesim.simulator.copyengine.xǁCopyEngineǁ_project_demand__mutmut_15":
        "`prev >= issued` for `prev > issued`: when equal both pick the same value",
    "moesim.simulator.copyengine.xǁCopyEngineǁadvance__mutmut_36":
        "`prev >= issued` for `prev > issued`: when equal both pick the same value",
    "moesim.simulator.copyengine.xǁCopyEngineǁsubmit__mutmut_1": "the duration cache bypassed: duration() computes the same value",
    "moesim.simulator.copyengine.xǁCopyEngineǁsubmit__mutmut_2": "the duration cache missed: duration() computes the same value",
    "moesim.simulator.copyengine.xǁCopyEngineǁsubmit__mutmut_26":
        "`prev >= now` for `prev > now`: when equal both pick the same value",
    **dict.fromkeys(("moesim.simulator.copyengine.xǁCopyEngineǁsubmit__mutmut_13",
                     "moesim.simulator.copyengine.xǁCopyEngineǁsubmit__mutmut_14"),
                    "other start and end times in the records the projection leaves alone: a queued prefetch's are set "
                    "when advance() starts it or promote_many() projects it, before anything reads them, and an "
                    "instant (cache-only) record is read by nobody (it joins no queue, the cache makes its entry "
                    "resident at once and the lookup and the prefetch queue keep no reference to it)"),
    "moesim.simulator.copyengine.xǁCopyEngineǁadvance__mutmut_15":
        "a demand transfer ending exactly at now queued as running instead of finished at once: the completion "
        "loop below pops it first (it is the running queue's head), so observers see the same transfers in the "
        "same order",
    "moesim.simulator.copyengine.xǁCopyEngineǁpromote_many__mutmut_20":
        "`seq >= t.seq` for `seq > t.seq`: sequence numbers are unique, never equal",
    "moesim.simulator.copyengine.xǁCopyEngineǁduration__mutmut_1":
        "the duration cache bypassed: copy_time is a pure function, recomputed equal",
    "moesim.simulator.copyengine.xǁCopyEngineǁduration__mutmut_2":
        "the duration cache missed: copy_time is a pure function, recomputed equal",
    "moesim.simulator.copyengine.xǁCopyEngineǁfinish__mutmut_4": "float('INF') is float('inf')",
    "moesim.simulator.copyengine.xǁCopyEngineǁhanded__mutmut_4": "float('INF') is float('inf')",
    # prefetch policies
    'moesim.policies.prefetch.xǁNextGateTopKǁ__init____mutmut_1':
        'self.params is not read after __init__ in this class (the local params is)',
    'moesim.policies.prefetch.xǁNextGateTopKǁpropose__mutmut_45':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_84':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_94':
        "zip's strict flag: the three sequences have equal lengths by construction",
    'moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_98':
        "zip's strict flag: the three sequences have equal lengths by construction",
    'moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_99':
        "zip's strict flag: the three sequences have equal lengths by construction",
    'moesim.policies.prefetch.xǁStaticPinǁ__init____mutmut_1':
        'self.params is not read after __init__ in this class (the local params is)',
    'moesim.policies.prefetch.xǁStaticPinǁ__init____mutmut_46':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    # eviction policies
    **{f"moesim.policies.eviction.xǁ{cls}ǁ__init____mutmut_1":
       "NoParams: this policy never reads self.params" for cls in ("LFU", "LeastHighPrecisionUsed", "Random", "Belady")},
    "moesim.policies.eviction.xǁBeladyǁ__init____mutmut_18": "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    **{f"moesim.policies.eviction.xǁBeladyǁ__init____mutmut_{n}":
       "zip's strict flag: starts and ends have equal lengths by construction" for n in (33, 36, 37)},
    **{f"moesim.policies.eviction.xǁLeastStaleǁ_roll__mutmut_{n}":
       "zip's strict flag: both queues have one bucket per layer" for n in (5, 8, 9)},
    "moesim.policies.eviction.xǁBeladyǁ_next_use__mutmut_7": "float('INF') is float('inf')",
    "moesim.policies.eviction.xǁBeladyǁ_next_use__mutmut_38": "float('INF') is float('inf')",
    "moesim.policies.eviction.xǁLFUǁ_bump__mutmut_7":
        "counts c -> c + 1 for used keys, 0 for never-used ones: a strictly increasing map of every count, "
        "so the candidate order (the policy's only output) is the same",
    "moesim.policies.eviction.xǁLFUǁ_bump__mutmut_8":
        "counts c -> 2 c: a strictly increasing map of every count, so the candidate order is the same",
    "moesim.policies.eviction.xǁLeastHighPrecisionUsedǁ_use__mutmut_11":
        "high-precision uses c -> c + 1 for used keys, 0 for unused: strictly increasing, the same order",
    "moesim.policies.eviction.xǁLeastHighPrecisionUsedǁ_use__mutmut_12":
        "high-precision uses c -> 2 c: strictly increasing, the same order",
    "moesim.policies.eviction.xǁLeastHighPrecisionUsedǁcandidates__mutmut_13":
        "a low-precision key's high-precision use count is always 0 (_use counts precision 0 only)",
    "moesim.policies.eviction.xǁLeastHighPrecisionUsedǁcandidates__mutmut_22":
        "low-precision keys all get the same second sort element (0 or 1): their order is recency either way",
    "moesim.policies.eviction.xǁLeastHighPrecisionUsedǁon_insert__mutmut_2":
        "RecencyOrdered.on_insert does not read `demand`",
    "moesim.policies.eviction.xǁLeastStaleǁ__init____mutmut_11":
        "the first event rolls empty queues whatever the initial pass number, then sets it",
    "moesim.policies.eviction.xǁLeastStaleǁ__init____mutmut_12":
        "the first event rolls empty queues whatever the initial pass number, then sets it",
    "moesim.policies.eviction.xǁLeastStaleǁ_touch__mutmut_7": "the queues are dicts used as ordered sets: values are never read",
    "moesim.policies.eviction.xǁLFUǁ_place__mutmut_6": "the buckets are dicts used as ordered sets: values are never read",
    "moesim.policies.eviction.xǁRandomǁon_insert__mutmut_1": "a dict used as an ordered set: values are never read",
    "moesim.policies.eviction.xǁRecencyOrderedǁon_insert__mutmut_1": "a dict used as an ordered set: values are never read",
    "moesim.policies.eviction.xǁLeastStaleǁon_access__mutmut_4":
        "touching a key that is already current re-assigns its entry in place (dict order unchanged): "
        "the same queues",
    "moesim.policies.eviction.xǁScoreBasedǁ__init____mutmut_7": "the first credit finds no scores to decay",
    "moesim.policies.eviction.xǁScoreBasedǁ__init____mutmut_8": "the first credit finds no scores to decay",
    "moesim.policies.eviction.xǁScoreBasedǁ__init____mutmut_11": "the engine always gives the policy its workload",
    "moesim.policies.eviction.xǁScoreBasedǁon_insert__mutmut_2": "RecencyOrdered.on_insert does not read `demand`",
    # budget policies
    'moesim.policies.budget.x__calibration_counts__mutmut_31':
        'numpy reads any negative size as the inferred one',
    'moesim.policies.budget.x__calibration_counts__mutmut_32':
        "every count doubled: the ranking, the counts' only use, is the same",
    'moesim.policies.budget.x_gpu_aware_greedy__mutmut_16':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.budget.x_gpu_aware_greedy__mutmut_21':
        'None is false, like False',
    'moesim.policies.budget.x_gpu_aware_greedy__mutmut_34':
        "each expert occurs once in the sorted order (or its GPU's queue): `have` only matters for the warm-up set",
    'moesim.policies.budget.x_greedy_select__mutmut_12':
        'the sum over no experts is 0.0',
    'moesim.policies.budget.x_greedy_select__mutmut_21':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.budget.x_greedy_select__mutmut_36':
        "each expert occurs once in the sorted order (or its GPU's queue): `have` only matters for the warm-up set",
    'moesim.policies.budget.x_placement_of__mutmut_39':
        'a float mask in place of a boolean one: it is only read for its truth value',
    'moesim.policies.budget.x_top_in__mutmut_14':
        "argsort's default axis is the last, here 1",
    'moesim.policies.budget.x_top_in__mutmut_19':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.budget.xǁBudgetPolicyǁscores__mutmut_15':
        'astype(None) is astype(float64)',
    'moesim.policies.budget.xǁBudgetPolicyǁscores__mutmut_3':
        'astype(None) is astype(float64)',
    'moesim.policies.budget.xǁDynamicSkipǁselect__mutmut_12':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁDynamicSkipǁselect__mutmut_15':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁDynamicSkipǁselect__mutmut_16':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁDynamicSkipǁselect__mutmut_19':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁDynamicSkipǁselect__mutmut_22':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁDynamicSkipǁselect__mutmut_23':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁLynxǁselect__mutmut_16':
        'a float mask in place of a boolean one: it is only read for its truth value',
    'moesim.policies.budget.xǁLynxǁselect__mutmut_18':
        'a float mask in place of a boolean one: it is only read for its truth value',
    'moesim.policies.budget.xǁLynxǁselect__mutmut_19':
        'None stored into a boolean array is False',
    'moesim.policies.budget.xǁMoESpecǁ__init____mutmut_21':
        'the calibration counts are only read with ranking: static',
    'moesim.policies.budget.xǁMoESpecǁselect__mutmut_19':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.budget.xǁMoESpecǁselect__mutmut_22':
        'a float mask in place of a boolean one: it is only read for its truth value',
    'moesim.policies.budget.xǁMoESpecǁselect__mutmut_24':
        'a float mask in place of a boolean one: it is only read for its truth value',
    'moesim.policies.budget.xǁSkipThresholdǁ__init____mutmut_23':
        "np.sort's default axis is the last, here 1",
    'moesim.policies.budget.xǁSkipThresholdǁ__init____mutmut_24':
        'astype(None) is astype(float64)',
    'moesim.policies.budget.xǁSkipThresholdǁ__init____mutmut_42':
        'every layer has calibration rows (each token routes every layer): the fill value is never read',
    'moesim.policies.budget.xǁSkipThresholdǁselect__mutmut_12':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁSkipThresholdǁselect__mutmut_13':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁSkipThresholdǁselect__mutmut_2':
        'astype(None) is astype(float64)',
    'moesim.policies.budget.xǁSkipThresholdǁselect__mutmut_47':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.budget.xǁSkipThresholdǁselect__mutmut_9':
        "zip's strict flag: the sequences have equal lengths by construction",
    'moesim.policies.budget.xǁXShareǁ__init____mutmut_7':
        'the placement is only read with per_gpu',
    'moesim.policies.budget.xǁXShareǁselect__mutmut_47':
        "numpy reads the sort kind case-insensitively: 'STABLE' is 'stable'",
    'moesim.policies.budget.xǁXShareǁselect__mutmut_81':
        'a float mask in place of a boolean one: it is only read for its truth value',
    'moesim.policies.budget.xǁXShareǁselect__mutmut_83':
        'a float mask in place of a boolean one: it is only read for its truth value',
    "moesim.policies.budget.x_gpu_aware_greedy__mutmut_38":
        "the loop ends without additions only when every expert is chosen; `allowed[None] = True` then allows "
        "every expert too",
    "moesim.policies.budget.x_placement_of__mutmut_41": "GPU ids stored as floats: every reader compares them with ints",
    # metrics
    "moesim.simulator.metrics.x__f__mutmut_3":
        "NaN reaches _f only as the mean over no requests, and a replay always has requests (the other "
        "callers check their denominators first)",
    "moesim.simulator.metrics.x_summarise__mutmut_166":
        "a timed replay always takes time (> 0); a cache-only one replaces link_utilisation with null",
    "moesim.simulator.metrics.x_summarise__mutmut_188": "every replay routes tokens: the total gate weight is > 0",
    "moesim.simulator.metrics.x_summarise__mutmut_196": "every replay has tokens",
    "moesim.simulator.metrics.x_summarise__mutmut_265":
        "every decode or verify pass generates at least one token, so dec_gen > 0 whenever there is one",
    "moesim.simulator.metrics.x_summarise__mutmut_316":
        "a relative change of 1e-9 in the divisor does not change a size printed to 0.1 GB",
    "moesim.simulator.metrics.x_summarise__mutmut_318":
        "a relative change of 1e-9 in the divisor does not change a size printed to 1 GB",
    "moesim.simulator.metrics.x_summarise__mutmut_40": "a replay always has passes",
    "moesim.simulator.metrics.x_summarise__mutmut_44": "a replay always has passes",
    "moesim.simulator.metrics.x_summarise__mutmut_63": "every replay has expert accesses",
    "moesim.policies.eviction.xǁScoreBasedǁ_credit__mutmut_2": "with decay 1 the factor is 1: decaying leaves every score as it is",
    "moesim.policies.eviction.xǁScoreBasedǁ_credit__mutmut_4":
        "decay is in (0, 1]: it is never 2, so `decay != 2.0` is always true, and with decay 1 the factor is 1",
    **{f"moesim.policies.budget.xǁSkipThresholdǁselect__mutmut_{n}":
       "a token's k <= 16 weights: numpy's default sort is an insertion sort there, which is stable "
       "(and reads 'STABLE' as 'stable')" for n in (35, 37, 40)},
    # prefetch policies
    "moesim.policies.prefetch.xǁNextGateTopKǁpropose__mutmut_15":
        "count is at most the number of experts: with count == N, argpartition at N - 1 keeps all N, as the else branch does",
    "moesim.policies.prefetch.xǁNextGateTopKǁpropose__mutmut_26":
        "count is at most the number of experts: with count == N both branches choose every expert",
    "moesim.policies.prefetch.xǁNextGateTopKǁpropose__mutmut_21": "argpartition's default axis is the last, here 1",
    "moesim.policies.prefetch.xǁNextGateTopKǁpropose__mutmut_23":
        "kth n + 1 instead of n - 1: numpy's introselect leaves the first n + 1 in order here, so the first n are "
        "the top n; no permutation of 8-64 experts (3,000 random ones each, n 2-12) told them apart",
    "moesim.policies.prefetch.xǁNextGateTopKǁpropose__mutmut_24":
        "kth n - 2 instead of n - 1: as above, no permutation of 8-64 experts told them apart",
    "moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_12":
        "an empty planned range [lo, hi) whatever its bounds: the first proposal plans",
    "moesim.policies.prefetch.xǁScorePercentileǁ__init____mutmut_14": "the first proposal plans before reading the list",
    "moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_14":
        "a longer list of proposals: the extra entries past the chunk are never read",
    "moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_42": "reduceat's default axis is 0",
    "moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_79": "argsort's default axis is the last, here 1",
    "moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_102": "row[:n] is row when n equals the width",
    "moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_103": "row[:n] is row when n equals the width",
    "moesim.policies.prefetch.xǁStaticPinǁ__init____mutmut_22":
        "n_pin is capped at the number of used experts, which a count array ending at the last used key still holds",
    "moesim.policies.prefetch.xǁScorePercentileǁ_plan__mutmut_47":
        "each (pass, layer) row scaled by a positive constant (count squared): its order and which experts lie "
        "above its own percentile are unchanged",
    "moesim.policies.prefetch.xǁScorePercentileǁpropose__mutmut_2":
        "asking for the first pass of the planned range plans it again: the same proposals",
}


def run(module: str) -> dict[str, object]:
    """Mutate ``module`` in a scratch copy of the tree (mutmut reads its configuration from
    the working directory's pyproject: there it mutates only this module and selects only its
    tests), and read the results back."""
    import shutil
    import tempfile

    dotted = module.removesuffix(".py").replace("/", ".")
    work = Path(tempfile.mkdtemp(prefix="moesim-mutation-"))
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (work / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, work / f)
    pyproject = (work / "pyproject.toml").read_text()
    tests = [t for t in os.environ.get("MUTATE_TESTS", "").split(",") if t] or tests_of(module)
    pyproject = pyproject.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + f"only_mutate = [{module!r}]\n"
                                  + f"pytest_add_cli_args_test_selection = {tests!r}\n", 1)
    (work / "pyproject.toml").write_text(pyproject)
    # no jit helper: mutmut waits for any child of its process, and would take a helper started
    # there (its copy of the tree compiles afresh) for a mutant's run (a KeyError ends mutmut);
    # the jit plan's tests set the variable as each needs
    env = {**os.environ, "MOESIM_SHARED": str(ROOT.parent / "shared"), "MOESIM_NO_JIT_HELPER": "1"}
    only = [f for f in os.environ.get("MUTATE_ONLY", "").split(",") if f]  # e.g. "xǁLeastStaleǁ*"
    patterns = [f"{dotted}.{f}" for f in (only or FUNCTIONS.get(module, ["*"]))]
    subprocess.run([sys.executable, "-m", "mutmut", "run", *patterns], cwd=work, env=env, check=False)
    meta = json.loads((work / "mutants" / f"{module}.meta").read_text())
    meta["exit_code_by_key"] = {k: c for k, c in meta["exit_code_by_key"].items()
                                if any(fnmatch.fnmatchcase(k, pat) for pat in patterns)}
    alive_codes = {k: c for k, c in meta["exit_code_by_key"].items()
                   if c in SURVIVED | NO_TESTS and k not in EQUIVALENT}
    diffs = [subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, env=env,
                            capture_output=True, text=True).stdout for name in sorted(alive_codes)]
    alive_diffs = dict(zip(sorted(alive_codes), diffs, strict=True))
    shutil.rmtree(work, ignore_errors=True)
    codes: dict[str, int | None] = meta["exit_code_by_key"]
    killed = sorted(k for k, c in codes.items() if c in KILLED)
    survived = sorted(k for k, c in codes.items() if c in SURVIVED)
    untested = sorted(k for k, c in codes.items() if c in NO_TESTS)
    other = sorted(k for k, c in codes.items() if k not in killed + survived + untested)
    equivalent = [k for k in survived if k in EQUIVALENT]
    live = [k for k in survived + untested if k not in EQUIVALENT]
    judged = len(killed) + len(live)
    return {
        "mutants": len(codes), "killed": len(killed), "survived": len(survived), "no_tests": len(untested),
        "unchecked": len(other), "equivalent": {k: EQUIVALENT[k] for k in equivalent},
        "kill_rate": len(killed) / judged if judged else None,
        "alive": live, "alive_diffs": {k: alive_diffs[k] for k in live if k in alive_diffs},
    }


def reclassify(results: dict[str, dict[str, object]]) -> None:
    """Re-read the recorded survivors against ``EQUIVALENT`` (after adding a judgement)
    without running the mutants again: the results file and the survivors' diffs."""
    for r in results.values():
        alive = [str(k) for k in r["alive"]]  # type: ignore[attr-defined]
        now_eq = [k for k in alive if k in EQUIVALENT]
        eq = dict(r["equivalent"])  # type: ignore[call-overload]
        eq.update({k: EQUIVALENT[k] for k in now_eq})
        r["equivalent"] = eq
        r["alive"] = [k for k in alive if k not in EQUIVALENT]
        judged = int(r["killed"]) + len(r["alive"])  # type: ignore[call-overload, arg-type]
        r["kill_rate"] = int(r["killed"]) / judged if judged else None  # type: ignore[call-overload]
        diffs = r.get("alive_diffs")
        if isinstance(diffs, dict):  # the alive mutants' diffs: drop those judged since
            r["alive_diffs"] = {k: v for k, v in diffs.items() if k not in EQUIVALENT}


def main(modules: list[str]) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if modules == ["--reclassify"]:
        reclassify(results)
        _write(results)
        return
    only = os.environ.get("MUTATE_ONLY", "")
    for module in modules:
        key = f"{module} [{only}]" if only else module  # a run of some functions only is its own row
        results[key] = run(module)
        r = results[key]
        print(f"{module}: {r['killed']} killed of {r['mutants']}, {len(r['alive'])} alive "
              f"(kill rate {r['kill_rate']:.1%})" if r["kill_rate"] is not None else f"{module}: no mutants")
        _write(results)  # after each module: a long run stopped later keeps the modules done


def _write(results: dict[str, dict[str, object]]) -> None:
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    tmp.replace(RESULTS)


if __name__ == "__main__":
    main(sys.argv[1:])
