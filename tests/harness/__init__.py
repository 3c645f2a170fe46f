"""What the tests use to start processes: the worker pool (:mod:`.pool`, :mod:`.worker`), jobs with a
hard timeout (:mod:`.distributed`, :mod:`.launch`), the suite's small model and its training script
(:mod:`.lightning_run`), the fault injection (:mod:`.faults`) and the loader of benchmark scripts
(:mod:`.benchmark_scripts`)."""
