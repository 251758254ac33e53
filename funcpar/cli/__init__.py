"""The command line: ``funcpar train / plan / convert``, its options, the launcher and its checks, progress,
trackers, plots, the plan, generation."""
