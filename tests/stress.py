"""Run the tests that send signals, start processes or wait on time many times in a row while other
processes keep every core busy: a test that passes alone but fails under load fails here.

    python tests/stress.py                      # every test below, 20 times, beside 2 busy processes
    python tests/stress.py --repeats 5 --only flower --busy 2
    python tests/stress.py tests/test_ux.py::test_ctrl_c_stops_a_run_with_the_resume_hint   # named tests only

Not part of CI (it takes an hour or more); a maintainer runs it after changing a test that waits on
a process or a signal. Each repetition runs the test in a fresh pytest process (``-n 0``); the busy
processes are plain Python loops, stopped at the end. It prints, per test, the passes and the
failures with the first line of each failure, and exits 1 if any test failed.
"""

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# test -> group; the tests that signal runs and sweeps, kill workers, refuse resumes, and start Flower,
# Ray and torchrun processes
TESTS = {
    "tests/test_ux.py::test_ctrl_c_stops_a_run_with_the_resume_hint": "signals",
    "tests/test_ux.py::test_ctrl_c_inside_a_checkpoint_write_is_the_interruption_not_a_traceback": "signals",
    "tests/test_ux.py::test_ctrl_c_stops_a_parallel_sweep_and_the_same_command_finishes_it": "signals",
    "tests/test_durability.py::test_a_signal_stops_the_run_with_the_resume_command": "signals",
    "tests/test_durability.py::test_a_signalled_sweep_stops_its_runs_at_a_round_boundary": "signals",
    "tests/test_durability.py::test_a_second_signal_inside_the_first_handler_cannot_deadlock_a_worker": "signals",
    "tests/test_durability.py::test_an_interrupted_bench_resumes_to_the_same_board_but_its_time_line": "signals",
    "tests/test_durability.py::test_workers_die_with_a_killed_sweep": "kills",
    "tests/test_durability.py::test_workers_die_with_a_sweep_killed_while_they_start": "kills",
    "tests/test_durability.py::test_a_dead_worker_fails_only_its_run": "kills",
    "tests/test_reliability.py::test_sigkill_then_resume_is_bit_identical": "kills",
    "tests/test_tracking.py::test_sigkill_around_the_checkpoint_loses_no_tracked_round": "kills",
    "tests/test_durability.py::test_two_sweeps_on_one_folder_one_is_refused": "refusals",
    "tests/test_durability.py::test_two_runs_with_one_run_name_never_share_the_directory": "refusals",
    "tests/test_first_day.py::test_resume_refuses_a_folder_holding_a_config_copied_from_a_real_run": "refusals",
    "tests/test_first_day.py::test_a_folder_from_elsewhere_runs_no_code_and_nothing_of_the_user_s_is_replaced":
        "refusals",
    "tests/test_flower.py": "flower",
    "tests/test_scaling.py": "ray-torchrun",
}


def busy() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help="pytest node ids to run instead of the list's")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the tests (default 2)")
    parser.add_argument("--only", help="only the tests of these groups (comma-separated: " +
                                       ", ".join(sorted(set(TESTS.values()))) + ")")
    args = parser.parse_args()
    groups = set(args.only.split(",")) if args.only else set(TESTS.values())
    chosen = args.tests or [t for t, g in TESTS.items() if g in groups]
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.busy)]
    for h in hogs:
        h.start()
    results: dict[str, list[str]] = {t: [] for t in chosen}
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        for i in range(args.repeats):
            for test in chosen:
                done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q", "-x",
                                       test], cwd=ROOT, capture_output=True, text=True, env=env)
                failure = ""
                if done.returncode != 0:
                    found = re.findall(r"^(?:E\s+|FAILED ).*$", done.stdout, re.M)
                    failure = (found[0] if found else done.stdout.strip().splitlines()[-1:] or ["?"])[0][:200]
                results[test].append(failure)
                print(f"[{i + 1}/{args.repeats}] {'ok  ' if not failure else 'FAIL'} {test} "
                      f"({time.monotonic() - start:.0f} s){': ' + failure if failure else ''}", flush=True)
    finally:
        for h in hogs:
            h.terminate()
    print("\n| test | passed | failed | first failure |\n|---|---|---|---|")
    bad = 0
    for test, runs in results.items():
        fails = [f for f in runs if f]
        bad += bool(fails)
        print(f"| `{test.split('::')[-1]}` | {len(runs) - len(fails)} | {len(fails)} | {fails[0] if fails else ''} |")
    print(f"\n{args.repeats} repetitions beside {args.busy} busy processes on {os.cpu_count()} cores, "
          f"{time.monotonic() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
