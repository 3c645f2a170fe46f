"""What the tests use to start processes: the worker pool (:mod:`.pool`, :mod:`.worker`), jobs with a
hard timeout (:mod:`.distributed`, :mod:`.launch`), the suite's small model and its training script
(:mod:`.lightning_run`) and the fault injection (:mod:`.faults`)."""
