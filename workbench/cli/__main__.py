"""python -m workbench.cli: the same as kvwb."""
import sys

from . import main

sys.exit(main())
