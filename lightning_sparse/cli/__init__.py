"""The command line: LightningCLI with ``fit``, ``validate`` and ``plan``, the plan itself, FLOP
estimates and the schedule plot."""
