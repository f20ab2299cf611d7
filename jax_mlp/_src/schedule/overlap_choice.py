"""Whether the next step overlaps its update with the backward pass: the faster of the two, as measured.

An overlapped step is not always the faster one: on a few cores the backward slows while an update
streams beside it, and an update that starts from the backward's grads reads in their order, not the
cache's. So the offloader times whole steps (from one ``update``'s return to the next's, which
counts the forward, the backward and the update alike in both modes) side by side: ``TRIAL_STEPS``
overlapped, then as many split ones (the backward's grads handed over and let go, the subgroups in
the split route's own order), each block after a step untimed (the first compiles; a switch changes
the order and what the cache keeps). It then runs the faster mode (the overlap on a tie) for
``RETRY_EVERY`` steps and tries again, as caches fill and placement settles. Both modes give the same
bits (an overlapped update commits only what the split one would), so the choice changes where time
goes, never the numbers.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

TRIAL_STEPS = 3
"""Steps timed in each mode per trial; their median is the mode's step time."""

RETRY_EVERY = 100
"""Steps run in the chosen mode before the next trial."""


class Choice(NamedTuple):
    """What the last trial found (the fields of an update's stats that say so).

    Attributes:
      overlap_fallback: the split step was the faster, so steps run split until the next trial.
      overlapped_step_s: the median time of its overlapped steps (0 before the first trial ends).
      split_step_s: the median time of its split steps (0 before the first trial ends).
    """

    overlap_fallback: bool = False
    overlapped_step_s: float = 0.0
    split_step_s: float = 0.0


def _trial(steps: int) -> list[tuple[bool, bool]]:
    """The steps of one trial, each as (whether it overlaps, whether it is timed)."""
    return [(True, False), *[(True, True)] * steps, (False, False), *[(False, True)] * steps]


class OverlapChoice:
    """Chooses, step by step, whether the backward starts the update.

    Args:
      trial_steps: steps timed in each mode per trial.
      retry_every: steps run in the chosen mode between trials.

    Example:
      >>> choice = OverlapChoice(trial_steps=1, retry_every=2)
      >>> [choice.step_ended(now) for now in (0.0, 1.0, 3.0, 4.0, 5.0)]  # overlapped steps take 2 s, split 1 s
      [True, True, False, False, False]
      >>> choice.last
      Choice(overlap_fallback=True, overlapped_step_s=2.0, split_step_s=1.0)
    """

    def __init__(self, trial_steps: int = TRIAL_STEPS, retry_every: int = RETRY_EVERY):
        self._trial_steps, self._retry_every = trial_steps, retry_every
        self._steps = deque(_trial(trial_steps))
        self._running = (True, False)  # the first step: untimed, it compiles
        self._since: float | None = None
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self.last = Choice()
        self.decided = False  # whether the step that just ended closed a trial

    def step_ended(self, now: float) -> bool:
        """The step running ended at ``now`` (its ``update`` returned): whether the next one overlaps."""
        overlaps, timed = self._running
        if timed and self._since is not None:
            self._times[overlaps].append(now - self._since)
        self._since = now
        self.decided = not self._steps
        if self.decided:
            self._decide()
        self._running = self._steps.popleft()
        return self._running[0]

    def interrupted(self) -> None:
        """The offloader was used between steps (a flush, a save, a failed call): the step running is not timed."""
        self._since = None

    def _decide(self) -> None:
        overlapped, split = (statistics.median(self._times[mode] or [0.0]) for mode in (True, False))
        self.last = Choice(bool(self._times[False]) and split < overlapped, overlapped, split)
        chosen = not self.last.overlap_fallback
        self._steps = deque([(chosen, False)] * self._retry_every + _trial(self._trial_steps))
        self._times = {True: [], False: []}
