"""The Planner pane: size a deployment against a workload and present it."""
