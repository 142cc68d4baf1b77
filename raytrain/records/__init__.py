"""The run folder's records, each with its guarantee, read and written through ``storage``:
the run state (``runstate``: the spec's fingerprint, attempts, the MLflow run), whether a
run may resume (``run_folder``: ``check_resumable``, the one check), the lease that keeps
two drivers off one run (``lease``), the status record a run's progress is read from
(``status_record`` writes it, ``run_status`` reads it), and the loss-spike rollbacks
(``rollback_record``). The workers read the rollbacks; the rest is the driver's and the
commands'. Nothing here imports Lightning."""
