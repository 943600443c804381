"""The distributed world, the ground every rank stands on: where ranks come from (env), the process group (world),
the store and its networking (store), naming what failed (failures), and how a process ends (ending)."""
