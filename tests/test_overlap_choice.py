"""``schedule/overlap_choice.py``: whether the next step overlaps, from step times given to it (no clock here)."""

from __future__ import annotations

from jax_mlp._src.schedule.overlap_choice import Choice, OverlapChoice


def run(choice: OverlapChoice, cost, steps: int, start: float = 0.0) -> list[bool]:
    """Each step's mode when a step in mode ``m`` takes ``cost(m)`` seconds."""
    modes, now = [], start
    overlaps = choice.step_ended(now)  # the step before: nothing is timed from before it
    for _ in range(steps):
        modes.append(overlaps)
        now += cost(overlaps)
        overlaps = choice.step_ended(now)
    return modes


def test_a_trial_times_both_modes_then_runs_the_faster_until_the_next():
    choice = OverlapChoice(trial_steps=2, retry_every=4)
    # trial: untimed + 2 overlapped, untimed + 2 split; 4 steps of the winner; the next trial
    modes = run(choice, lambda overlapped: 3.0 if overlapped else 2.0, 14)
    assert modes == [True] * 3 + [False] * 3 + [False] * 4 + [True] * 3 + [False]
    assert choice.last == Choice(overlap_fallback=True, overlapped_step_s=3.0, split_step_s=2.0)


def test_the_overlap_comes_back_when_it_becomes_the_faster():
    choice = OverlapChoice(trial_steps=1, retry_every=2)
    assert run(choice, lambda overlapped: 3.0 if overlapped else 2.0, 4) == [True, True, False, False]
    assert choice.last.overlap_fallback
    choice.interrupted()  # a pause (a checkpoint save) before the next steps
    modes = run(choice, lambda overlapped: 1.0 if overlapped else 2.0, 10, start=100.0)
    # the fallback's last step, a trial the overlap wins (untimed, overlapped, untimed, split), its 2 steps, the next
    assert modes == [False, True, True, False, False, True, True, True, True, False]
    assert choice.last == Choice(overlap_fallback=False, overlapped_step_s=1.0, split_step_s=2.0)


def test_a_tie_keeps_the_overlap_and_an_interrupted_step_is_not_timed():
    choice = OverlapChoice(trial_steps=1, retry_every=10)
    choice.step_ended(0.0)  # step 0 ends
    assert choice.step_ended(1.0)  # step 1 (untimed) ends: step 2 overlaps, timed
    choice.interrupted()  # a flush in step 2
    assert not choice.step_ended(50.0)  # step 3: untimed split
    assert not choice.step_ended(51.0)  # step 4: timed split, 1 s
    assert choice.step_ended(52.0)  # the trial ends: no overlapped time, so no fallback
    assert choice.last == Choice(overlap_fallback=False, overlapped_step_s=0.0, split_step_s=1.0)
    tie = OverlapChoice(trial_steps=1, retry_every=10)
    run(tie, lambda overlapped: 1.0, 4)
    assert tie.last == Choice(overlap_fallback=False, overlapped_step_s=1.0, split_step_s=1.0)
