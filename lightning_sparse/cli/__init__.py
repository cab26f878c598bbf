"""The command line: its light entry (help, version, the OpenMP wait policy), LightningCLI with
``fit``, ``validate`` and ``plan``, the plan itself, FLOP estimates and the schedule plot."""
