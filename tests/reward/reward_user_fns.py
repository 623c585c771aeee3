"""User reward functions loaded by dotted path ("reward_user_fns:NAME") in the reward tests.

This directory is on sys.path under pytest, and spawned workers inherit the parent's sys.path.
"""

import os
import signal
import time


def exact(prompt, response, ground_truth, extra):
    """Exact match; reads ``extra`` to prove it is passed through."""
    bonus = (extra or {}).get("bonus", 0.0)
    return float(response == ground_truth) + bonus


def sleepy(prompt, response, ground_truth, extra):
    """Sleeps past any test timeout when the response says so."""
    if response == "sleep":
        time.sleep(60)
    return 1.0


def hang(prompt, response, ground_truth, extra):
    """Ignores SIGTERM and spins: only SIGKILL stops it."""
    if response == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            pass
    return 1.0


def crash(prompt, response, ground_truth, extra):
    """Kills its own process on "crash"."""
    if response == "crash":
        os._exit(3)
    return 1.0


def raising(prompt, response, ground_truth, extra):
    if response == "raise":
        raise ZeroDivisionError("user bug")
    return 1.0


def nan_on(prompt, response, ground_truth, extra):
    """NaN or inf when the response says so (a numeric reward gone wrong)."""
    return {"nan": float("nan"), "inf": float("inf")}.get(response, 1.0)


def always_nan(prompt, response, ground_truth, extra):
    """A numeric reward that went wrong everywhere."""
    return float("nan")


def returns_str(prompt, response, ground_truth, extra):
    return "1.0"


def two_args(response, ground_truth):
    return 1.0


NOT_CALLABLE = 3


def alarm_raise_or_hang(prompt, response, ground_truth, extra):
    """Like math-verify, arms a SIGALRM handler (only possible in a process's main thread); raises on
    "raise", spins on "hang", else exact match."""
    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
    if response == "raise":
        raise ZeroDivisionError("user bug")
    if response == "hang":
        while True:
            pass
    return float(response == ground_truth)


def arith_hangs_on_seven(prompt, response, ground_truth, extra):
    """The synthetic task's exact match, but it never returns on the response "7"."""
    if response.strip() == "7":
        time.sleep(600)
    return float(response.strip() == ground_truth.strip())


def always_raises(prompt, response, ground_truth, extra):
    """A reward broken on every input (a renamed dataset field, say)."""
    raise KeyError("answer_field")


def niceness(prompt, response, ground_truth, extra):
    """The scheduling niceness of the process that scores (0 is the job's own priority)."""
    return float(os.nice(0))
