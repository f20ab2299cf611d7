"""The policy: the order of the subgroups, their paths, and the performance model behind both."""
