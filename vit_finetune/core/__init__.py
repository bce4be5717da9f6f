"""The floor every wing stands on: the error type and its exit codes (errors), the names of what a run writes and
the one way to write them atomically (layout), what a run shows while it works (progress), the processes of one
launch (processes), the Hub's token and timeouts (hub), and an output folder's lock and previous run (run_lock,
previous_run). It imports nothing of the other wings.
"""
