"""The serving benchmark of `scripts/bench_serving.py` (its command line: `cli.py`): the hybrid against the
attention-only models a user would serve instead, each in its own vLLM engine, on the same settings.

    checkpoints.py  the models compared and their random-weight checkpoints, of the same shapes
    engine.py       vLLM's engine stepped by hand, its scheduler's block pool at hand (what a sequence holds)
    workloads.py    what is timed: a batch decoding at each prompt length, batch 1, a shared-prefix workload
    worker.py       the worker process (one model, one engine) and the protocol that runs it: a spec file in, a
                    `RESULT_JSON` line out
    driver.py       every requested model, one worker after another, and the results so far saved after each
    report.py       the table and the plot of saved results
    cli.py          the command line
"""
