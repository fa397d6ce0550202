"""Exit codes a stage job and the orchestration agree on (defined once, imported by both sides)."""

OK = 0
BAD_INPUT = 2  # the user's config, data, code or model path: a retry cannot help, so it is never retried
ORPHANED = 3  # a stage job whose run is gone (its lease was not renewed): it stopped itself
SERVICE_UNAVAILABLE = 75  # a service the stage calls (a remote reward) stayed down past its retries: retried (EX_TEMPFAIL)
