"""The policy: the order subgroups are updated in, and which path holds each one."""

from __future__ import annotations


class Scheduler:
    """Cache-friendly order and round-robin placement over the paths.

    The order alternates, ascending on even steps and descending on odd ones: the subgroups
    updated last in one step are still in the host cache when the next step starts with them.
    Consecutive subgroups sit on different paths, so reads ahead hit every path at once.

    Args:
      num_subgroups: how many subgroups the plan has.
      num_paths: how many storage paths there are.
    """

    def __init__(self, num_subgroups: int, num_paths: int):
        self.num_subgroups = num_subgroups
        self.num_paths = num_paths

    def order(self, step: int) -> list[int]:
        """The order in which step ``step`` updates the subgroups."""
        ascending = list(range(self.num_subgroups))
        return ascending if step % 2 == 0 else ascending[::-1]

    def path_of(self, subgroup: int) -> int:
        """The index of the path that stores ``subgroup``'s records."""
        return subgroup % self.num_paths
