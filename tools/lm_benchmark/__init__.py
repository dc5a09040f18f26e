"""The language-modelling benchmark of `scripts/bench_lm.py` (its command line: `cli.py`): the hybrid against
sliding-window and full attention on real text, and what upcycling and distillation recover.

    corpus.py          the Python sources on this machine, deduplicated and split by file
    tokens.py          the BPE trained on them, the token arrays (cached) and the packed training sequences
    models.py          the models compared, of one shape; those made from a trained `full` (upcycled, distilled)
    timed_training.py  training through `modeling.training.train`, timed (tokens/s, peak memory)
    evaluation.py      loss by position, the loss with a context cut to 2W, passkey probes, the SSM's memory
    report.py          the tables and the loss-by-position plot of saved results
    cli.py             the command line: every model in turn, its results written as JSON
"""
