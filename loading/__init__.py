"""What the user hands the tools, read and checked: models, prompt files, router and exit-adapter files.

A neutral layer below `exporter`, `calibration` and `commands` (they all read these inputs;
none of them may import another for it). It may import `graphs` and `runtimes`, nothing above.
"""
