"""`python -m collectives.launch -n N script.py args`: N local ranks, no Spark."""
import sys

from .launcher import main

sys.exit(main())
