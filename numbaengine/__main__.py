"""`python -m numbaengine ...` is `python -m numbaengine.run ...`."""
import sys

from numbaengine.run import main

sys.exit(main())
