"""`python -m alignflow.stages --config FILE --stage NAME [--set KEY=VALUE ...]`: see stages/common/entry.py."""

import atexit
import os
import sys
import threading


def exit_now(code: int) -> None:
    """Exit once the stage has returned, as the interpreter would (threads joined, atexit handlers run: Ray's
    shutdown, temporary folders, logging) but without its teardown of torch, transformers, DeepSpeed and MLflow's
    modules (1 s a job here). A process with children left (an engine's) exits the usual way, whose object
    finalizers may be what stops them."""
    import psutil

    if psutil.Process().children():
        sys.exit(code)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from alignflow.infra import warm

    warm.delegate(sys.argv[1:])  # a fork of the head's warm stage server runs the job, if there is one
    from alignflow.stages.common.entry import run_stage_cli

    exit_now(run_stage_cli())
