"""The launch setup every caller of the job machinery shares: the progress bar's streams and
environment put into a job's options (`displayed`), and the choice of where the ranks run
(`launch`: on Spark or on this machine, elastic or not)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Tuple

from .. import progress
from .driver import JobOptions, payload_of, run_on_driver, run_on_spark
from .pickling import code_files
from .session import get_session

__all__ = ["displayed", "launch"]


@contextlib.contextmanager
def displayed(opts: JobOptions) -> Iterator[Tuple[JobOptions, "progress.Display"]]:
    """(opts, display): the progress bar of `opts.verbose`, and opts with its output going
    through the bar and the ranks told to report (when the bar is shown); the bar closes
    when the block ends."""
    with progress.Display(opts.verbose) as display:
        if display.enabled:
            opts = dataclasses.replace(opts, stdout=display.stream(opts.stdout),
                                       stderr=display.stream(opts.stderr, "stderr"),
                                       env=opts.env + display.env)
        yield opts, display


def launch(fn, args: tuple, kwargs: dict, opts: JobOptions, elastic=None) -> list:
    """Every rank's value, in rank order: opts.np > 0 ranks as Spark barrier tasks, -np
    ranks on this machine for np < 0; with `elastic` (an ElasticOptions), attempts that
    resume from the last commit."""
    with displayed(opts) as (opts, _):
        if elastic is not None:
            from .elastic import run_elastic_on_driver, run_elastic_on_spark

            payload = payload_of(fn, args, kwargs, opts)
            if opts.np < 0:
                return run_elastic_on_driver(payload, opts, elastic, code_files(fn))
            return run_elastic_on_spark(get_session(elastic.max_np), payload, opts, elastic,
                                        code_files(fn))
        if opts.np < 0:
            return run_on_driver(fn, args, kwargs, opts)
        return run_on_spark(get_session(opts.np), fn, args, kwargs, opts)
