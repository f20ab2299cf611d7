"""What runs where: the optimizer check, the subgroups, the device programs and the params' sharding."""
