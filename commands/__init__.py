"""The `adaptive-export` command line (build, check, run, inspect, bench), above everything else.

`commands` parses arguments into the typed options of commands/options.py and orchestrates
the layers below it: `exporter` (graphs -> engines -> bundle), `calibration` (what is worth
an engine) and `runtimes` (running a bundle). It is the only package that may import all of
them; `run`, `inspect` and `bench` import only the runtime, so they work without torch.
"""

# exit codes: success; `check` found a mismatch; bad usage or input (one `error: ... Fix: ...` line)
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
