"""The release of the horovod-spark distribution, which ships both packages.

It lives in the lower package so that `collectives` and `horovod_spark` (which
may import downward only) report the same number; setup.py reads this file.
"""
__version__ = "0.3.0"
